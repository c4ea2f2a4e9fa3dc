"""POST /v1/chat/completions: messages in, assistant messages (text and tool calls) out.

What it knows: the chat-specific parts of a request (messages rendered by the chat template with the request's
tools; `tools` / `tool_choice` / `parallel_tool_calls` through a `ToolPlan`, whose grammar replaces the
response_format's for a forced call; logprobs as `top_logprobs` alternatives; `max_completion_tokens` over
`max_tokens`; refusing `echo`), and the response shapes: the whole `chat.completion` body (content, `tool_calls`,
finish reason "tool_calls" when the model called tools) and the stream's chunks (the role first, content deltas,
tool calls as OpenAI tool-call deltas: id, type and name first, then the arguments; usage last when asked, or on
every chunk with `continuous_usage_stats`). What it does not know: how the output is split into text and calls
(tool_output.py), how choices run or how the stream is driven.
"""

from __future__ import annotations

from typing import Any

from kvfence.engine.admission import admit
from kvfence.engine.engine_client import GenerationChunk
from kvfence.server import openai_schema as p
from kvfence.server import sampling
from kvfence.server.choice import Choice, choice_integrity, failed_chunk, integrity_records, top_level_integrity, usage
from kvfence.server.context import ServerContext
from kvfence.server.endpoint import Prepared
from kvfence.server.http import ApiError, dump_model
from kvfence.server.logprobs import chat_logprobs
from kvfence.server.streaming import SseEvent
from kvfence.server.tool_output import CallArguments, CallStart, OutputEvent, OutputReader, Text, read_whole
from kvfence.server.tools import ToolPlan, plan_tools


def has_response_format(fmt: p.ResponseFormat | None) -> bool:
    return fmt is not None and fmt.type != "text"


async def chat_choices(
    ctx: ServerContext, req: p.ChatCompletionRequest, base_id: str, messages: list[p.ChatMessage]
) -> Prepared:
    """The choices of a chat request (also what the Responses API runs): tools planned, messages rendered,
    admitted, each choice's parameters."""
    sampling.refuse_unsupported(req)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, has_response_format(req.response_format))
    ids = await ctx.prompts.chat(messages, plan.template_tools)
    max_tokens = admit(len(ids), req.requested_max_tokens(), ctx.engine.capacity(), param="messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    grammar = sampling.FROM_REQUEST if plan.grammar is None else plan.grammar  # a forced call's replaces it
    choices = [
        Choice(j, f"{base_id}-{j}", 0, ids, ctx.params(req, max_tokens, j, logprobs, structured_outputs=grammar))
        for j in range(req.n)
    ]
    param = "tools" if plan.grammar is not None else "response_format"
    return Prepared(choices, choices[0].params.structured_outputs, param, plan)


def _without_nulls(value: Any) -> Any:
    """A delta as OpenAI sends one: fields without a value left out (the client's stream helper merges deltas
    key by key and would overwrite a tool call's `type` with a null)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def tool_call_models(reader: OutputReader) -> list[p.ToolCall]:
    return [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in reader.calls]


class ChatEndpoint:
    request_model = p.ChatCompletionRequest
    id_prefix = "chatcmpl"

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: p.ChatCompletionRequest, base_id: str) -> Prepared:
        if req.echo:
            raise ApiError(
                400,
                "echo: is not supported on chat completions by kvfence; send false or omit it",
                param="echo",
                code="unsupported_value",
            )
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs", code="invalid_value")
        return await chat_choices(self.ctx, req, base_id, req.messages)

    def streams(self, req: p.ChatCompletionRequest) -> bool:
        return req.stream

    def response(self, req: p.ChatCompletionRequest, base_id: str, prepared: Prepared) -> dict[str, Any]:
        choices = prepared.choices
        fmt = self.ctx.settings.tool_call_parser
        out = []
        for c in choices:
            reader = read_whole(prepared.plan, fmt, c.output_text)
            calls = tool_call_models(reader)
            out.append(
                p.ChatCompletionChoice(
                    index=c.index,
                    message=p.ChatResponseMessage(
                        content=reader.text if reader.text or not calls else None, tool_calls=calls
                    ),
                    logprobs=chat_logprobs(c.token_ids, c.logprobs, self.ctx.prompts.token_text)
                    if req.logprobs
                    else None,
                    finish_reason=reader.finish_reason(c.finish_reason),
                    kvfence=choice_integrity(c),
                )
            )
        body = p.ChatCompletionResponse(
            id=base_id, model=req.model, choices=out, usage=usage(choices), kvfence=top_level_integrity(choices)
        )
        return dump_model(body)

    def renderer(self, req: p.ChatCompletionRequest, base_id: str, prepared: Prepared) -> ChatStream:
        return ChatStream(self.ctx, req, base_id, prepared.plan)


class ChatStream:
    """The `chat.completion.chunk` events of one streamed request, each choice's output read under the plan."""

    sends_done = True

    def __init__(self, ctx: ServerContext, req: p.ChatCompletionRequest, base_id: str, plan: ToolPlan) -> None:
        self.ctx, self.req, self.base_id = ctx, req, base_id
        self.readers: dict[int, OutputReader] = {}
        self.plan = plan
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options and options.continuous_usage_stats)

    def _reader(self, c: Choice) -> OutputReader:
        if c.index not in self.readers:
            self.readers[c.index] = OutputReader(self.plan, self.ctx.settings.tool_call_parser)
        return self.readers[c.index]

    def _event(self, c: Choice, choice: p.ChatStreamChoice) -> SseEvent:
        body = dump_model(p.ChatCompletionChunk(id=self.base_id, model=self.req.model, choices=[choice]))
        for c_body in body["choices"]:
            c_body["delta"] = _without_nulls(c_body["delta"])
        if self.continuous_usage:
            body["usage"] = usage([c]).model_dump()
        return SseEvent(body)

    def opening(self, choices: list[Choice]) -> list[SseEvent]:
        """Each choice's first chunk: the role."""
        delta = p.ChatDelta(role="assistant", content="")
        return [self._event(c, p.ChatStreamChoice(index=c.index, delta=delta)) for c in choices]

    @staticmethod
    def _deltas(events: list[OutputEvent]) -> list[p.ChatDelta]:
        deltas: list[p.ChatDelta] = []
        for e in events:
            if isinstance(e, Text):
                deltas.append(p.ChatDelta(content=e.text))
            elif isinstance(e, CallStart):
                fn = p.FunctionCallDelta(name=e.name, arguments="")
                deltas.append(
                    p.ChatDelta(tool_calls=[p.ToolCallDelta(index=e.index, id=e.id, type="function", function=fn)])
                )
            elif isinstance(e, CallArguments) and e.delta:
                fn = p.FunctionCallDelta(arguments=e.delta)
                deltas.append(p.ChatDelta(tool_calls=[p.ToolCallDelta(index=e.index, function=fn)]))
        return deltas

    def chunk(self, c: Choice, chunk: GenerationChunk) -> list[SseEvent]:
        reader = self._reader(c)
        events = reader.feed(chunk.text)
        if chunk.finished and not failed_chunk(chunk):
            events += reader.finish()
        deltas = self._deltas(events)
        logprobs = None
        if self.req.logprobs and chunk.token_ids:
            logprobs = chat_logprobs(chunk.token_ids, list(chunk.logprobs or []), self.ctx.prompts.token_text)
            if not deltas:  # the text is held back (it may be a tool call): the scores still go out now
                deltas.append(p.ChatDelta(content=""))
        out = []
        for k, delta in enumerate(deltas):
            choice = p.ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs if k == 0 else None)
            out.append(self._event(c, choice))
        if chunk.finished and not failed_chunk(chunk):  # a failure ends the stream with an error event
            choice = p.ChatStreamChoice(
                index=c.index,
                delta=p.ChatDelta(),
                finish_reason=reader.finish_reason(chunk.finish_reason),
                kvfence={"integrity": chunk.integrity} if chunk.integrity is not None else None,
            )
            out.append(self._event(c, choice))
        return out

    def closing(self, choices: list[Choice]) -> list[SseEvent]:
        if not self.include_usage:
            return []
        return [SseEvent(p.usage_chunk(self.base_id, "chat.completion.chunk", self.req.model, usage(choices)))]

    def failed(self, err: ApiError, choices: list[Choice]) -> list[SseEvent]:
        return [SseEvent({**p.error_body(err.message, err.type, err.param, err.code), **integrity_records(choices)})]
