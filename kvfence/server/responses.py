"""POST /v1/responses: OpenAI's Responses API, stateless, served as a chat completion underneath.

What it knows: how a Responses body becomes a chat request (instructions as the first system message; message
items as messages; `function_call` items as an assistant's tool calls and `function_call_output` items as tool
results; function tools and tool_choice in chat's form; `text.format` as the response_format; one choice), and
the Responses shapes of the result: the `response` object (status `completed`, or `incomplete` with reason
`max_output_tokens` when the length limit ended it; output items: one assistant `message` with `output_text`
and one `function_call` item per call; usage in input/output tokens; the integrity record under `kvfence`), and
the stream's named events in OpenAI's order (`response.created`, `response.in_progress`, then per item
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`... or
`response.function_call_arguments.delta`..., their `.done` events, `response.output_item.done`, and
`response.completed`, whose status may be `incomplete`, as vLLM sends it; a failure ends with
`response.failed`), each with its `sequence_number`. Nothing is
stored: `previous_response_id` and the other stateful fields are refused. What it does not know: chat rendering
or tool parsing (chat.py, tool_output.py), how choices run.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvfence.engine.engine_client import GenerationChunk
from kvfence.server import openai_schema as p
from kvfence.server.chat import chat_choices
from kvfence.server.choice import Choice, failed_chunk, integrity_records, top_level_integrity
from kvfence.server.context import ServerContext
from kvfence.server.endpoint import Prepared
from kvfence.server.http import ApiError, parse_body
from kvfence.server.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    ResponsesRequest,
)
from kvfence.server.streaming import SseEvent
from kvfence.server.tool_output import CallArguments, CallEnd, CallStart, OutputReader, Text, read_whole
from kvfence.server.tools import ToolPlan


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported_value")


def _refuse_stateful(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise _unsupported("previous_response_id", "kvfence stores no responses; send the whole conversation in input")
    if req.background:
        raise _unsupported("background", "is not supported by kvfence")
    if req.conversation is not None:
        raise _unsupported("conversation", "kvfence stores no conversations; send them in input")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "is not supported on /v1/responses by kvfence; use /v1/chat/completions")
    if req.truncation != "disabled":
        raise _unsupported("truncation", 'only "disabled": kvfence never truncates an input')


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a Responses input."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for item in req.input_items():
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls are one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            messages.append({"role": item.role, "content": item.text()})
    return messages


def chat_request(req: ResponsesRequest) -> p.ChatCompletionRequest:
    """The chat request a Responses body runs as."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "cache_salt": req.cache_salt,
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        response_format: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ApiError(
                    400,
                    "text.format: type json_schema needs a schema",
                    param="text.format.schema",
                    code="missing_required_parameter",
                )
            response_format["json_schema"] = {
                "name": fmt.name or "response",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            }
        body["response_format"] = response_format
    return parse_body(p.ChatCompletionRequest, body)  # type: ignore[no-any-return]


def _tool_choice(req: ResponsesRequest) -> Any:
    """The tool_choice in effect, as the response states it."""
    choice = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return choice.model_dump()
    return choice if choice is not None else ("auto" if req.tools else "none")


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(choices: list[Choice]) -> dict[str, Any]:
    c = choices[0]
    return {
        "input_tokens": len(c.prompt_ids),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": c.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(c.prompt_ids) + c.num_output_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesEndpoint:
    request_model = ResponsesRequest
    id_prefix = "resp"

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: ResponsesRequest, base_id: str) -> Prepared:
        _refuse_stateful(req)
        chat = chat_request(req)
        return await chat_choices(self.ctx, chat, base_id, chat.messages)

    def streams(self, req: ResponsesRequest) -> bool:
        return req.stream

    def envelope(
        self, req: ResponsesRequest, base_id: str, created: float, status: str, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The `response` object with everything but its outcome (status, output) taken from the request."""
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": base_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": _tool_choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": req.truncation,
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def finished(body: dict[str, Any], choices: list[Choice], finish_reason: str | None) -> dict[str, Any]:
        """`body` with the outcome of its one choice: status, usage, integrity."""
        if finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        body["completed_at"] = time.time()
        body["usage"] = _usage(choices)
        if (record := top_level_integrity(choices)) is not None:
            body["kvfence"] = record
        return body

    def response(self, req: ResponsesRequest, base_id: str, prepared: Prepared) -> dict[str, Any]:
        c = prepared.choices[0]
        reader = read_whole(prepared.plan, self.ctx.settings.tool_call_parser, c.output_text)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        output = []
        if reader.text:
            output.append(_message_item(_hex_id("msg"), reader.text, status))
        output += [_call_item(_hex_id("fc"), call.id, call.name, call.arguments, "completed") for call in reader.calls]
        body = self.envelope(req, base_id, time.time(), status, output)
        return self.finished(body, prepared.choices, c.finish_reason)

    def renderer(self, req: ResponsesRequest, base_id: str, prepared: Prepared) -> ResponsesStream:
        return ResponsesStream(self, req, base_id, prepared.plan)


class ResponsesStream:
    """The named events of one streamed response, its output items opened and closed as the text arrives."""

    sends_done = False

    def __init__(self, endpoint: ResponsesEndpoint, req: ResponsesRequest, base_id: str, plan: ToolPlan) -> None:
        self.endpoint, self.req, self.base_id = endpoint, req, base_id
        self.created = time.time()
        self.reader = OutputReader(plan, endpoint.ctx.settings.tool_call_parser)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.message_id: str | None = None  # the open message item
        self.message_text = ""  # its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # open function_call items by call index

    def _event(self, kind: str, **fields: Any) -> SseEvent:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return SseEvent(data, kind)

    def _snapshot(self, status: str) -> dict[str, Any]:
        return self.endpoint.envelope(self.req, self.base_id, self.created, status, list(self.output))

    def opening(self, choices: list[Choice]) -> list[SseEvent]:
        return [
            self._event("response.created", response=self._snapshot("in_progress")),
            self._event("response.in_progress", response=self._snapshot("in_progress")),
        ]

    def _open_message(self) -> list[SseEvent]:
        if self.message_id is not None:
            return []
        self.message_id, self.message_text = _hex_id("msg"), ""
        index = len(self.output)
        item = dict(_message_item(self.message_id, "", "in_progress"), content=[])
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ids = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", part=part, **ids),
        ]

    def _close_message(self, status: str) -> list[SseEvent]:
        if self.message_id is None:
            return []
        item = _message_item(self.message_id, self.message_text, status)
        index = len(self.output)
        ids = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        self.message_id = None
        self.output.append(item)
        return [
            self._event("response.output_text.done", text=self.message_text, logprobs=[], **ids),
            self._event("response.content_part.done", part=item["content"][0], **ids),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _render(self, events: list[Any]) -> list[SseEvent]:
        out: list[SseEvent] = []
        for e in events:
            if isinstance(e, Text):
                out += self._open_message()
                self.message_text += e.text
                ids = {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}
                out.append(self._event("response.output_text.delta", delta=e.text, logprobs=[], **ids))
            elif isinstance(e, CallStart):
                out += self._close_message("completed")
                item = _call_item(_hex_id("fc"), e.id, e.name, "", "in_progress")
                self.calls[e.index] = item
                out.append(self._event("response.output_item.added", output_index=len(self.output), item=dict(item)))
            elif isinstance(e, CallArguments) and e.delta:
                item = self.calls[e.index]
                item["arguments"] += e.delta
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(self.output),
                        delta=e.delta,
                    )
                )
            elif isinstance(e, CallEnd):
                item = self.calls.pop(e.index)
                item.update(arguments=e.arguments, status="completed")
                index = len(self.output)
                self.output.append(item)
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=e.arguments,
                    )
                )
                out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def chunk(self, c: Choice, chunk: GenerationChunk) -> list[SseEvent]:
        events = self.reader.feed(chunk.text)
        if chunk.finished and not failed_chunk(chunk):
            events += self.reader.finish()
        return self._render(events)

    def closing(self, choices: list[Choice]) -> list[SseEvent]:
        c = choices[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        out = self._close_message(status)
        body = self.endpoint.finished(self._snapshot(status), choices, c.finish_reason)
        # always `response.completed` (its response's status says "incomplete" when the length limit ended it), as
        # vLLM does: the openai SDK's stream helper waits for that event to give its final response
        return [*out, self._event("response.completed", response=body)]

    def failed(self, err: ApiError, choices: list[Choice]) -> list[SseEvent]:
        body = self._snapshot("failed")
        body["error"] = {"code": err.code or "server_error", "message": err.message}
        body.update(integrity_records(choices))
        return [self._event("response.failed", response=body)]
