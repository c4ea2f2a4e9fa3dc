"""The request body of OpenAI's Responses API (POST /v1/responses), as far as kvfence serves it.

What it knows: the fields a stateless server can honour (`input` as text or as message, `function_call` and
`function_call_output` items; `instructions`; `max_output_tokens`, `temperature`, `top_p`, `seed`; function
`tools`, `tool_choice`, `parallel_tool_calls`; `text.format` as text, a JSON object or a JSON schema; `stream`;
`metadata` and `user`, echoed), validated as strictly as the chat body, and the fields it refuses at a value
that needs state or features it lacks (`previous_response_id`, `background`, `conversation`, `top_logprobs`,
`truncation: auto`), each a 400 naming the field. `store` is accepted and nothing is ever stored (the response
says `store: false`). Unknown fields are ignored, as elsewhere. What it does not know: generation, the response
shapes (responses.py builds them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfence.server.openai_schema import MAX_TOOLS, FunctionName, PositiveTokens

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
_NAMED = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = FunctionCallItem | FunctionCallOutputItem | MessageItem


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _NAMED
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = _STRICT

    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    max_output_tokens: PositiveTokens | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # extension, as on the other endpoints
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # prefix-cache tenant (vLLM's)
    # refused at any other value: they need state (or features) a stateless server does not have
    previous_response_id: str | None = None
    background: bool = False
    conversation: Any = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
