"""The OpenAI-compatible HTTP API in front of an `EngineClient` (aggregated engine or PD router).

What it knows: the endpoints (POST /v1/completions and /v1/chat/completions, with
SSE streaming; GET /v1/models, /health, /metrics, /server_info), turning a request
body into prompt token ids and `SamplingParams` (one engine request per choice, see
sampling.py), admission control before anything reaches the engine (a response_format
schema is compiled here first, so a bad one is a 400 in every mode), echo and
logprobs in the response shapes OpenAI and vLLM return (see logprobs.py), the
integrity record of every choice, the OpenAI error shape for every failure, and
aborting the engine requests of a client that went away. docs/api.md is the reference.

Errors (always `{"error": {"message", "type", "param", "code"}}`):
  413 request_too_large      body over `max_body_bytes`, checked while reading, before parsing
  400 invalid_json           not UTF-8, not JSON, NaN/Infinity, nested too deep, not an object
  400 invalid_type/_value    a field has the wrong type or is out of range (param names the field)
  400 unsupported_value      a field kvfence does not implement has a non-default value
  400 context_length_exceeded prompt (+ max_tokens) over the context length or a role's KV pool
  404 model_not_found        `model` is not the served model name
  404/405                    unknown path / method
  500 server_error           a generation failed (message from the engine; integrity record attached)
                             or an unexpected exception (logged with its traceback)

What it does not know: scheduling, KV pages or transfers (all behind `EngineClient`),
nor how the server process is started (see launch.py); body parsing, the error object and the encodings
are http.py's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from kvfence.engine.sampler import TokenLogprobs
from kvfence.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from kvfence.errors import KvfenceError
from kvfence.server import openai_schema as p
from kvfence.server import sampling
from kvfence.server.admission import admit
from kvfence.server.engine_client import EngineClient, GenerationChunk
from kvfence.server.http import (
    ApiError,
    BodyLimitMiddleware,
    dump_model,
    parse_body,
    parse_json_object,
    sse_event,
    to_api_error,
)
from kvfence.server.logprobs import chat_logprobs, completion_logprobs
from kvfence.server.metrics import CONTENT_TYPE, Metrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_ENCODE_IN_THREAD_CHARS = 16384  # tokenize longer texts off the event loop


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> Any: ...


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    vocab_size: int | None = None  # token ids in a prompt must be below this (the engine checks too)
    server_args: Mapping[str, Any] = field(default_factory=dict)  # resolved launch settings, for /server_info
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (vLLM's --logprobs-mode)


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="unsupported_value")


def _prompt_entries(c: _Choice) -> list[TokenLogprobs | None]:
    """The prompt's logprob entries of an echoed choice (null ones if the engine sent none, e.g. after an error)."""
    if c.prompt_logprobs is not None and len(c.prompt_logprobs) == len(c.prompt_ids):
        return list(c.prompt_logprobs)
    return [None] * len(c.prompt_ids)


# ---- one choice = one engine request -------------------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    request_id: str
    prompt_index: int  # which prompt of a batched /v1/completions request
    prompt_ids: list[int]
    params: SamplingParams
    score_only: bool = False  # max_tokens 0: the engine's one token is dropped
    echo_text: str | None = None  # the prompt's text, when echoed
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    echoed: bool = False  # streaming: the echoed prompt went out
    text_sent: int = 0  # streaming: characters sent so far (the text_offset of the next token)
    finished: bool = False
    finish_reason: str | None = None
    integrity: dict[str, Any] | None = None
    error: str | None = None
    error_code: str | None = None
    num_output_tokens: int = 0
    t_first: float | None = None

    def absorb(self, chunk: GenerationChunk) -> None:
        if chunk.token_ids and self.t_first is None:
            self.t_first = time.monotonic()
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if not self.score_only:
            self.token_ids += chunk.token_ids
            self.text.append(chunk.text)
            if chunk.logprobs:
                self.logprobs += chunk.logprobs
            self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens, len(self.token_ids))
        if chunk.integrity is not None:
            self.integrity = chunk.integrity
        if chunk.finished:
            self.finished = True
            self.finish_reason = chunk.finish_reason
            if self.score_only and chunk.finish_reason in ("stop", "length"):
                self.finish_reason = "length"  # nothing was generated: the 0-token limit ended it
            if chunk.finish_reason == "error":
                self.error = chunk.error or "generation failed"
                self.error_code = str(chunk.extra.get("code", "generation_failed"))


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(request: Request) -> str:
    """The client's `X-Request-Id` (as vLLM honours it), else a random one; the response `id` carries it.

    Engine request ids are `<cmpl|chatcmpl>-<this>-<choice index>`: fault specs and logs can select them."""
    rid = request.headers.get("x-request-id")
    if rid is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(rid):
        raise ApiError(400, "X-Request-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -", param="X-Request-Id")
    return rid


def _failed_chunk(chunk: GenerationChunk) -> bool:
    """The engine's last chunk of a choice that failed (its finish_reason "error" is internal, never sent)."""
    return chunk.finished and chunk.finish_reason == "error"


def _stream_error_event(err: ApiError, choices: list[_Choice]) -> dict[str, Any]:
    """The SSE event a failed stream ends with: the OpenAI error object, plus every choice's integrity record
    (the failure is the handoff's, often, and the record says why)."""
    return {
        **p.error_body(err.message, err.type, err.param, err.code),
        "kvfence": {"integrity": [c.integrity for c in choices]},
    }


def _integrity_header(choices: list[_Choice]) -> dict[str, str]:
    records = [c.integrity for c in choices]
    if all(r is None for r in records):
        return {}
    parts = []
    for r in records:
        status = "none" if r is None else str(r.get("status", "unknown"))
        parts.append("".join(ch for ch in status if ch.isascii() and ch.isprintable() and ch != ","))
    return {"X-Kvfence-Integrity": ",".join(parts)}


class OpenAIServer:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, settings: ApiSettings) -> None:
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        extra = getattr(engine, "metrics_registry", None) or getattr(
            getattr(engine, "integrity_metrics", None), "registry", None
        )
        self.metrics = Metrics(engine.stats, [extra] if extra is not None else [])
        self.started = time.time()
        self._grammar_compiler: Any = None  # made on the first response_format request

    # -- request -> choices -----------------------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.settings.served_model_name:
            raise ApiError(
                404,
                f"The model {name[:200]!r} does not exist; this server serves {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _encode(self, text: str) -> list[int]:
        if len(text) > _ENCODE_IN_THREAD_CHARS:
            return list(await anyio.to_thread.run_sync(self.tokenizer.encode, text))
        return list(self.tokenizer.encode(text))

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.settings.vocab_size
        if vocab:
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                    param="prompt",
                    code="invalid_value",
                )

    def _params(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        max_tokens: int,
        index: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        return sampling.params_for(
            req,
            max_tokens=max_tokens,
            index=index,
            logprobs_mode=self.settings.logprobs_mode,
            vocab_size=self.settings.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    async def _check_grammar(self, spec: StructuredOutputs | None) -> None:
        """Compile a response_format here first, so a schema xgrammar refuses is a 400 in every mode."""
        if spec is None or not hasattr(self.tokenizer, "backend"):  # test fakes have no real tokenizer
            return
        if self._grammar_compiler is None:
            from kvfence.engine.structured_output import GrammarCompiler

            vocab = self.settings.vocab_size or int(getattr(self.tokenizer, "vocab_size", 0))
            eos = getattr(self.tokenizer, "eos_token_ids", frozenset())
            self._grammar_compiler = await anyio.to_thread.run_sync(GrammarCompiler, self.tokenizer, vocab, eos)
        await anyio.to_thread.run_sync(self._grammar_compiler.compile, spec)

    async def _completion_choices(self, req: p.CompletionRequest, base_id: str) -> list[_Choice]:
        sampling.refuse_unsupported(req)
        if req.suffix:
            raise _unsupported("suffix", "is not supported by kvfence; omit it")
        if req.best_of is not None and req.best_of != req.n:
            raise _unsupported("best_of", "is not supported by kvfence unless it equals n")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [await self._encode(prompt)]
            texts = [prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]  # type: ignore[arg-type]
            texts = [None]
        elif isinstance(prompt[0], str):
            prompts = [await self._encode(text) for text in prompt]  # type: ignore[arg-type]
            texts = list(prompt)  # type: ignore[arg-type]
        else:
            prompts = [list(ids) for ids in prompt]  # type: ignore[union-attr]
            texts = [None] * len(prompts)
        capacity = self.engine.capacity()
        choices: list[_Choice] = []
        prompt_logprobs = req.logprobs if req.echo else None
        for k, (ids, text) in enumerate(zip(prompts, texts, strict=True)):
            self._check_token_ids(ids)
            max_tokens = admit(len(ids), max(req.max_tokens, 1), capacity, param="prompt")
            echo_text = None
            if req.echo:
                echo_text = text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
            for j in range(req.n):
                index = k * req.n + j
                limit = req.max_tokens if req.max_tokens == 0 else max_tokens
                params = self._params(req, limit, j, req.logprobs, prompt_logprobs)
                choice = _Choice(index, f"{base_id}-{index}", k, ids, params, req.max_tokens == 0, echo_text)
                choices.append(choice)
        await self._check_grammar(choices[0].params.structured_outputs)
        return choices

    async def _chat_choices(self, req: p.ChatCompletionRequest, base_id: str) -> list[_Choice]:
        sampling.refuse_unsupported(req)
        if req.tools:
            raise _unsupported("tools", "tool calling is not supported by kvfence; omit it")
        if req.echo:
            raise _unsupported("echo", "is not supported on chat completions by kvfence; send false or omit it")
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs", code="invalid_value")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = await anyio.to_thread.run_sync(
                lambda: self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            )
        except (ValueError, TypeError, KeyError, IndexError, TemplateError) as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from None
        ids = await self._encode(rendered) if isinstance(rendered, str) else list(rendered)
        max_tokens = admit(len(ids), req.requested_max_tokens(), self.engine.capacity(), param="messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = [
            _Choice(j, f"{base_id}-{j}", 0, ids, self._params(req, max_tokens, j, logprobs)) for j in range(req.n)
        ]
        await self._check_grammar(choices[0].params.structured_outputs)
        return choices

    # -- running choices ----------------------------------------------------------------------------------------
    async def _events(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, GenerationChunk]]:
        """All choices' chunks as they arrive; on exit (done, error, cancelled) unfinished ones are aborted."""
        queue: asyncio.Queue[tuple[_Choice, GenerationChunk | BaseException | None]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                stream = self.engine.generate(choice.request_id, choice.prompt_ids, choice.params)
                try:
                    async for chunk in stream:
                        queue.put_nowait((choice, chunk))
                        if chunk.finished:
                            break
                finally:
                    aclose = getattr(stream, "aclose", None)
                    if aclose is not None:
                        await aclose()
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, which maps it to an HTTP error
                queue.put_nowait((choice, e))
            finally:
                queue.put_nowait((choice, None))

        t0 = time.monotonic()
        self.metrics.in_flight.inc()
        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        open_streams = len(choices)
        try:
            while open_streams:
                choice, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                choice.absorb(item)
                if item.finished:
                    self._observe(choice, t0)
                yield choice, item
        finally:
            self.metrics.in_flight.dec()
            unfinished = [c for c in choices if not c.finished]
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                for c in unfinished:
                    try:
                        await self.engine.abort(c.request_id)
                    except Exception:
                        logger.exception("abort of %s failed", c.request_id)
                if unfinished:
                    self.metrics.aborted.inc(len(unfinished))
                await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, choice: _Choice, t0: float) -> None:
        now = time.monotonic()
        m = self.metrics
        m.generation_tokens.inc(choice.num_output_tokens)
        m.finished.labels(choice.finish_reason or "unknown").inc()
        m.observe_integrity(choice.integrity)
        ttft = None if choice.t_first is None else choice.t_first - t0
        m.observe_choice(ttft, now - (choice.t_first or now), choice.num_output_tokens)
        m.e2e.observe(now - t0)

    async def _collect_or_error(
        self, request: Request, choices: list[_Choice]
    ) -> tuple[dict[str, str], Response | None]:
        """Run every choice to the end; (integrity headers, the error response if any choice failed, else None)."""
        await self._collect(request, choices)
        headers = _integrity_header(choices)
        if (err := self._failed(choices)) is not None:
            return headers, err.response(headers, {"kvfence": {"integrity": [c.integrity for c in choices]}})
        return headers, None

    async def _collect(self, request: Request, choices: list[_Choice]) -> None:
        """Run every choice to the end; a client that disconnects meanwhile aborts them."""

        failure: list[BaseException] = []

        async def run(scope: anyio.CancelScope) -> None:
            try:
                async for _ in self._events(choices):
                    pass
            except Exception as e:  # re-raised below, outside the task group (which would wrap it)
                failure.append(e)
            scope.cancel()

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    scope.cancel()
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, tg.cancel_scope)
            tg.start_soon(watch_disconnect, tg.cancel_scope)
        if failure:
            raise failure[0]

    @staticmethod
    def _count_prompts(choices: list[_Choice]) -> int:
        return sum({c.prompt_index: len(c.prompt_ids) for c in choices}.values())

    def _usage(self, choices: list[_Choice]) -> p.Usage:
        prompt_tokens = self._count_prompts(choices)
        completion = sum(c.num_output_tokens for c in choices)
        return p.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
        )

    def _failed(self, choices: list[_Choice]) -> ApiError | None:
        bad = next((c for c in choices if c.error is not None), None)
        if bad is None:
            return None
        return ApiError(500, f"choice {bad.index}: {bad.error}", type="server_error", code=bad.error_code)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- endpoints -------------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: p.CompletionRequest = parse_body(p.CompletionRequest, parse_json_object(await request.body()))
        self._check_model(req.model)
        base_id = f"cmpl-{_request_id(request)}"
        choices = await self._completion_choices(req, base_id)
        self.metrics.prompt_tokens.inc(self._count_prompts(choices))
        if req.stream:
            return await self._stream(choices, lambda c, ch: self._completion_chunk(req, base_id, c, ch), req, base_id)
        headers, error = await self._collect_or_error(request, choices)
        if error is not None:
            return error
        body = p.CompletionResponse(
            id=base_id,
            model=req.model,
            choices=[
                p.CompletionChoice(
                    index=c.index,
                    text=(c.echo_text or "") + "".join(c.text),
                    logprobs=self._completion_logprobs(c) if req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    kvfence=None if c.integrity is None else {"integrity": c.integrity},
                )
                for c in choices
            ],
            usage=self._usage(choices),
            kvfence=self._top_kvfence(choices),
        )
        return JSONResponse(dump_model(body), headers=headers)

    def _completion_logprobs(self, c: _Choice) -> p.CompletionLogprobs:
        """The whole choice: the echoed prompt's tokens (if echoed), then the output's."""
        ids: list[int] = list(c.prompt_ids) if c.echo_text is not None else []
        entries = _prompt_entries(c) if c.echo_text is not None else []
        return completion_logprobs(ids + c.token_ids, entries + list(c.logprobs), self._token_text)

    @staticmethod
    def _top_kvfence(choices: list[_Choice]) -> dict[str, Any] | None:
        if len(choices) == 1 and choices[0].integrity is not None:
            return {"integrity": choices[0].integrity}
        return None

    async def chat_completions(self, request: Request) -> Response:
        req: p.ChatCompletionRequest = parse_body(p.ChatCompletionRequest, parse_json_object(await request.body()))
        self._check_model(req.model)
        base_id = f"chatcmpl-{_request_id(request)}"
        choices = await self._chat_choices(req, base_id)
        self.metrics.prompt_tokens.inc(len(choices[0].prompt_ids))
        if req.stream:
            return await self._stream(choices, lambda c, ch: self._chat_chunk(req, base_id, c, ch), req, base_id)
        headers, error = await self._collect_or_error(request, choices)
        if error is not None:
            return error
        body = p.ChatCompletionResponse(
            id=base_id,
            model=req.model,
            choices=[
                p.ChatCompletionChoice(
                    index=c.index,
                    message=p.ChatResponseMessage(content="".join(c.text)),
                    logprobs=chat_logprobs(c.token_ids, c.logprobs, self._token_text) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    kvfence=None if c.integrity is None else {"integrity": c.integrity},
                )
                for c in choices
            ],
            usage=self._usage(choices),
            kvfence=self._top_kvfence(choices),
        )
        return JSONResponse(dump_model(body), headers=headers)

    # -- streaming ---------------------------------------------------------------------------------------------
    def _completion_chunk(
        self, req: p.CompletionRequest, base_id: str, c: _Choice, chunk: GenerationChunk | None
    ) -> list[BaseModel]:
        if chunk is None:
            return []
        text, ids, entries = "", [], []
        if c.echo_text is not None and not c.echoed:  # the prompt goes out first, with its scores
            c.echoed = True
            text, ids, entries = c.echo_text, list(c.prompt_ids), _prompt_entries(c)
        if not c.score_only:
            text += chunk.text
            ids += chunk.token_ids
            entries += list(chunk.logprobs or [])
        logprobs = None
        if req.logprobs is not None and ids:
            logprobs = completion_logprobs(ids, entries, self._token_text, c.text_sent)
        c.text_sent += len(text)
        if _failed_chunk(chunk):  # no made-up finish_reason: the stream ends with an error event instead
            if not (text or ids):
                return []
            choice = p.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=None)
            return [p.CompletionResponse(id=base_id, model=req.model, choices=[choice])]
        choice = p.CompletionChoice(
            index=c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason if chunk.finished else None,
            kvfence={"integrity": chunk.integrity} if chunk.integrity is not None else None,
        )
        return [p.CompletionResponse(id=base_id, model=req.model, choices=[choice])]

    def _chat_chunk(
        self, req: p.ChatCompletionRequest, base_id: str, c: _Choice, chunk: GenerationChunk | None
    ) -> list[BaseModel]:
        if chunk is None:  # the opening chunk of each choice: the role
            delta = p.ChatDelta(role="assistant", content="")
            return [
                p.ChatCompletionChunk(
                    id=base_id, model=req.model, choices=[p.ChatStreamChoice(index=c.index, delta=delta)]
                )
            ]
        out: list[BaseModel] = []
        if chunk.text or chunk.token_ids:
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(chunk.token_ids, list(chunk.logprobs or []), self._token_text)
            delta = p.ChatDelta(content=chunk.text)
            choice = p.ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs)
            out.append(p.ChatCompletionChunk(id=base_id, model=req.model, choices=[choice]))
        if chunk.finished and not _failed_chunk(chunk):  # a failure ends the stream with an error event
            choice = p.ChatStreamChoice(
                index=c.index,
                delta=p.ChatDelta(),
                finish_reason=chunk.finish_reason,
                kvfence={"integrity": chunk.integrity} if chunk.integrity is not None else None,
            )
            out.append(p.ChatCompletionChunk(id=base_id, model=req.model, choices=[choice]))
        return out

    async def _stream(
        self,
        choices: list[_Choice],
        render: Callable[[_Choice, GenerationChunk | None], list[BaseModel]],
        req: p.CompletionRequest | p.ChatCompletionRequest,
        base_id: str,
    ) -> Response:
        """SSE response; the first engine event is awaited here so early errors still get an HTTP status."""
        events = self._events(choices)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        model = req.model

        async def body() -> AsyncIterator[bytes]:
            try:
                for c in choices:
                    for m in render(c, None):
                        yield sse_event(dump_model(m))
                pending = [first] if first is not None else []
                while True:
                    if pending:
                        c, chunk = pending.pop()
                    else:
                        try:
                            c, chunk = await events.__anext__()
                        except StopAsyncIteration:
                            break
                    for m in render(c, chunk):
                        yield sse_event(dump_model(m))
                    if c.error is not None:  # one choice failed: the error event ends the whole stream
                        break
                err = self._failed(choices)
                if err is not None:
                    yield sse_event(_stream_error_event(err, choices))
                elif include_usage:
                    obj = "chat.completion.chunk" if isinstance(req, p.ChatCompletionRequest) else "text_completion"
                    usage = self._usage(choices).model_dump()
                    yield sse_event(
                        {
                            "id": base_id,
                            "object": obj,
                            "created": int(time.time()),
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                yield b"data: [DONE]\n\n"
            except (KvfenceError, ApiError) as e:
                api = to_api_error(e)
                yield sse_event(p.error_body(api.message, api.type, api.param, api.code))
                yield b"data: [DONE]\n\n"
            except Exception:
                logger.exception("stream failed")
                yield sse_event(p.error_body("internal error while streaming; see the server log", "server_error"))
                yield b"data: [DONE]\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- info endpoints ----------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        cap = self.engine.capacity()
        card = p.ModelCard(
            id=self.settings.served_model_name, created=int(self.started), max_model_len=cap.context_length
        )
        return p.ModelList(data=[card]).model_dump()

    def server_info(self) -> dict[str, Any]:
        from kvfence import __version__

        cap = self.engine.capacity()
        return {
            "version": __version__,
            "served_model_name": self.settings.served_model_name,
            "launch_command": list(sys.argv),
            "server_args": dict(self.settings.server_args),
            "capacity": {
                "context_length": cap.context_length,
                "max_total_tokens": dict(cap.max_total_tokens),
                "page_size": cap.page_size,
                "max_request_tokens": cap.max_request_tokens,
            },
            "api": {
                "max_body_bytes": self.settings.max_body_bytes,
                "max_n": p.MAX_N,
                "max_stop": p.MAX_STOP,
                "max_prompts": p.MAX_PROMPTS,
                "vocab_size": self.settings.vocab_size,
                "max_logprobs": MAX_LOGPROBS,
                "logprobs_mode": self.settings.logprobs_mode,
            },
            "engine": self.engine.server_info(),
            "stats": self.engine.stats(),
            "started_at": self.started,
        }

    def health(self) -> Response:
        check = getattr(self.engine, "check_health", None)
        try:
            if check is not None:
                check()
            self.engine.stats()
        except Exception as e:
            return JSONResponse(
                p.error_body(f"engine unhealthy: {e}", "server_error", code="unhealthy"), status_code=503
            )
        return JSONResponse({"status": "ok"})


# ---- the app -------------------------------------------------------------------------------------------------------

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": p.ErrorResponse, "description": "Invalid request"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    413: {"model": p.ErrorResponse, "description": "Body too large"},
    500: {"model": p.ErrorResponse, "description": "Generation failed"},
}


def _body_spec(name: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def build_app(engine: EngineClient, tokenizer: Tokenizer, settings: ApiSettings) -> FastAPI:
    """The FastAPI app for one EngineClient; every app has its own metrics registry."""
    server = OpenAIServer(engine, tokenizer, settings)
    app = FastAPI(title="kvfence", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.server = server

    def observe_rejection(e: ApiError) -> None:
        server.metrics.rejected.labels(e.code or str(e.status)).inc()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> Response:
        observe_rejection(e)
        return e.response()

    @app.exception_handler(KvfenceError)
    async def _kvfence_error(_: Request, e: KvfenceError) -> Response:
        api = to_api_error(e)
        if api.status >= 500:
            logger.error("request failed: %s", e)
        observe_rejection(api)
        return api.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return ApiError(e.status_code, str(e.detail), code=code).response(e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        return to_api_error(e).response()

    responses = dict(_ERROR_RESPONSES)

    @app.post(
        "/v1/completions",
        openapi_extra=_body_spec("CompletionRequest"),
        responses={200: {"model": p.CompletionResponse}, **responses},
    )
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_body_spec("ChatCompletionRequest"),
        responses={200: {"model": p.ChatCompletionResponse}, **responses},
    )
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return server.server_info()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(p.CompletionRequest, "validation"), (p.ChatCompletionRequest, "validation")],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, metrics=server.metrics)
    return app
