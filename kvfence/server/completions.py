"""POST /v1/completions: prompts in, text choices out (one engine request per prompt and choice).

What it knows: the completion-specific parts of a request (batched prompts with `n` choices each, index = prompt
x n + choice; `echo`, with the prompt's logprobs when `logprobs` is set; `max_tokens: 0`, which scores the
prompt and generates nothing; refusing `suffix` and a `best_of` other than `n`), and the response shapes: the
whole `text_completion` body with legacy logprobs, and the stream's chunks (the echoed prompt first, offsets
continued across events, no made-up finish_reason for a failed choice; usage last when asked, or on every chunk
with `continuous_usage_stats`). What it does not know: how choices run or how the stream is driven
(generation.py, streaming.py, endpoint.py).
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
from kvfence.server.logprobs import completion_logprobs
from kvfence.server.streaming import SseEvent


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported_value")


def _logprobs(ctx: ServerContext, c: Choice) -> p.CompletionLogprobs:
    """The whole choice: the echoed prompt's tokens (if echoed), then the output's."""
    ids: list[int] = list(c.prompt_ids) if c.echo_text is not None else []
    entries = c.prompt_entries() if c.echo_text is not None else []
    return completion_logprobs(ids + c.token_ids, entries + list(c.logprobs), ctx.prompts.token_text)


class CompletionsEndpoint:
    request_model = p.CompletionRequest
    id_prefix = "cmpl"

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: p.CompletionRequest, base_id: str) -> Prepared:
        sampling.refuse_unsupported(req)
        if req.suffix:
            raise _unsupported("suffix", "is not supported by kvfence; omit it")
        if req.best_of is not None and req.best_of != req.n:
            raise _unsupported("best_of", "is not supported by kvfence unless it equals n")
        prompts = await self.ctx.prompts.completion_prompts(req.prompt)
        capacity = self.ctx.engine.capacity()
        choices: list[Choice] = []
        prompt_logprobs = req.logprobs if req.echo else None
        for k, prompt in enumerate(prompts):
            max_tokens = admit(len(prompt.ids), max(req.max_tokens, 1), capacity, param="prompt")
            echo_text = None
            if req.echo:
                echo_text = prompt.text if prompt.text is not None else self.ctx.prompts.decode(prompt.ids)
            for j in range(req.n):
                index = k * req.n + j
                limit = req.max_tokens if req.max_tokens == 0 else max_tokens
                params = self.ctx.params(req, limit, j, req.logprobs, prompt_logprobs)
                choices.append(
                    Choice(index, f"{base_id}-{index}", k, prompt.ids, params, req.max_tokens == 0, echo_text)
                )
        return Prepared(choices, choices[0].params.structured_outputs)

    def streams(self, req: p.CompletionRequest) -> bool:
        return req.stream

    def response(self, req: p.CompletionRequest, base_id: str, prepared: Prepared) -> dict[str, Any]:
        choices = prepared.choices
        body = p.CompletionResponse(
            id=base_id,
            model=req.model,
            choices=[
                p.CompletionChoice(
                    index=c.index,
                    text=(c.echo_text or "") + c.output_text,
                    logprobs=_logprobs(self.ctx, c) if req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    kvfence=choice_integrity(c),
                )
                for c in choices
            ],
            usage=usage(choices),
            kvfence=top_level_integrity(choices),
        )
        return dump_model(body)

    def renderer(self, req: p.CompletionRequest, base_id: str, prepared: Prepared) -> CompletionStream:
        return CompletionStream(self.ctx, req, base_id)


class CompletionStream:
    """The `text_completion` chunks of one streamed request."""

    sends_done = True

    def __init__(self, ctx: ServerContext, req: p.CompletionRequest, base_id: str) -> None:
        self.ctx, self.req, self.base_id = ctx, req, base_id
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options and options.continuous_usage_stats)

    def opening(self, choices: list[Choice]) -> list[SseEvent]:
        return []

    def _event(self, c: Choice, choice: p.CompletionChoice) -> SseEvent:
        body = dump_model(p.CompletionResponse(id=self.base_id, model=self.req.model, choices=[choice]))
        if self.continuous_usage:
            body["usage"] = usage([c]).model_dump()
        return SseEvent(body)

    def chunk(self, c: Choice, chunk: GenerationChunk) -> list[SseEvent]:
        text, ids, entries = "", [], []
        if c.echo_text is not None and not c.echoed:  # the prompt goes out first, with its scores
            c.echoed = True
            text, ids, entries = c.echo_text, list(c.prompt_ids), c.prompt_entries()
        if not c.score_only:
            text += chunk.text
            ids += chunk.token_ids
            entries += list(chunk.logprobs or [])
        logprobs = None
        if self.req.logprobs is not None and ids:
            logprobs = completion_logprobs(ids, entries, self.ctx.prompts.token_text, c.text_sent)
        c.text_sent += len(text)
        if failed_chunk(chunk):  # no made-up finish_reason: the stream ends with an error event instead
            if not (text or ids):
                return []
            return [self._event(c, p.CompletionChoice(index=c.index, text=text, logprobs=logprobs))]
        choice = p.CompletionChoice(
            index=c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason if chunk.finished else None,
            kvfence={"integrity": chunk.integrity} if chunk.integrity is not None else None,
        )
        return [self._event(c, choice)]

    def closing(self, choices: list[Choice]) -> list[SseEvent]:
        if not self.include_usage:
            return []
        return [SseEvent(p.usage_chunk(self.base_id, "text_completion", self.req.model, usage(choices)))]

    def failed(self, err: ApiError, choices: list[Choice]) -> list[SseEvent]:
        return [SseEvent({**p.error_body(err.message, err.type, err.param, err.code), **integrity_records(choices)})]
