"""What a request's `tools` and `tool_choice` ask of generation: a `ToolPlan`.

What it knows: OpenAI's tool_choice values and what each means here, following vLLM:

* `none` (the default without tools): the tools still go to the chat template, the output is plain text;
* `auto` (the default with tools): the tools go to the template and the output is parsed for calls in the
  server's format (tool_parsers.py); the model decides;
* `required`: the output is constrained by a grammar to a JSON array of `{"name": <one of the tools>,
  "parameters": <that tool's schema>}` (one item at most when `parallel_tool_calls` is false), each item a call;
* a named function: the output is constrained to that function's parameter schema and is its arguments.

The grammar is a JSON schema the engine's grammar engine (xgrammar, engine/structured_output.py) compiles, so it
goes through the same bounded compile as a `response_format`, and a response_format cannot be combined with
tools other than under `none` (two grammars for one output). What it does not know: parsing (tool_parsers.py),
HTTP, rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.server import openai_schema as p
from kvfence.server.http import ApiError

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # NONE, AUTO, REQUIRED or NAMED
    template_tools: list[dict[str, Any]] | None = None  # what the chat template gets as `tools`
    grammar: StructuredOutputs | None = None  # REQUIRED / NAMED: what the output is held to
    function: str | None = None  # NAMED: the function called
    parallel: bool = True

    @property
    def parses_output(self) -> bool:
        """AUTO: the output is searched for calls in the server's format."""
        return self.mode == AUTO


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _parameters(tool: p.ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else dict(_NO_ARGUMENTS)


def _grammar(schema: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))


def plan_tools(
    tools: list[p.ToolDefinition] | None,
    tool_choice: p.ToolChoice | None,
    parallel_tool_calls: bool,
    has_response_format: bool,
) -> ToolPlan:
    """The plan of one request; a 400 naming the field for a choice that cannot be honoured."""
    if not tools:
        if tool_choice not in (None, NONE):
            raise _invalid("tool_choice", "needs tools; send tools or omit tool_choice")
        return ToolPlan(NONE)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise _invalid("tools", "function names must be unique")
    template_tools = [t.model_dump(mode="json", exclude_none=True) for t in tools]
    choice = tool_choice if tool_choice is not None else AUTO
    if choice == NONE:
        return ToolPlan(NONE, template_tools)
    if has_response_format:
        raise ApiError(
            400,
            'response_format: cannot be combined with tools unless tool_choice is "none" (both would constrain '
            "the same output)",
            param="response_format",
            code="unsupported_value",
        )
    if choice == AUTO:
        return ToolPlan(AUTO, template_tools, parallel=parallel_tool_calls)
    if choice == REQUIRED:
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(REQUIRED, template_tools, _grammar(schema), parallel=parallel_tool_calls)
    assert isinstance(choice, p.NamedToolChoice)
    wanted = choice.function.name
    tool = next((t for t in tools if t.function.name == wanted), None)
    if tool is None:
        raise _invalid("tool_choice", f"names function {wanted[:64]!r}, which is not among the tools")
    return ToolPlan(NAMED, template_tools, _grammar(_parameters(tool)), wanted, parallel_tool_calls)
