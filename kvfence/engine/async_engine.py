"""An `EngineClient` over the in-process `LLMEngine`: the aggregated (one process) server.

What it knows: one background thread owns the LLMEngine and is the only thread that
touches it. asyncio callers hand it commands (add / abort) through a locked inbox and
a condition variable; it applies them between steps, runs `step()` while work
remains, and sleeps on the condition when idle. Each request's outputs go to that
request's asyncio queue via `loop.call_soon_threadsafe`, so `generate` is an ordinary
async iterator. Errors the engine raises for a request (bad input) are delivered to
that request's caller; a crash inside `step()` fails every request in flight with
finish_reason "error" and is counted, and the engine keeps serving new ones.
Numbers for /metrics are a snapshot the engine thread takes after every iteration,
so readers never race the engine. Each request's last chunk carries its `RequestTimings`
(vLLM's meanings): queued from `generate` to the first step that scheduled it, prefill
from then to its first token, decode from there to its last.

What it does not know: HTTP, admission (the API checks the capacity this reports) or
disaggregation (the router is a different EngineClient). Aggregated mode has no KV
handoff; each request's final chunk carries a `local` integrity record saying so.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvfence.engine.engine_client import Capacity, GenerationChunk, RequestTimings
from kvfence.engine.llm_engine import LLMEngine, RequestOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError
from kvfence.integrity.record import IntegrityRecord
from kvfence.roles import AGGREGATED as ROLE  # the one role this engine serves

logger = logging.getLogger(__name__)

_IDLE_STEP_WAIT_S = 0.005  # work is queued but nothing could be scheduled: wait this long for a change


class _Stream(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # GenerationChunk | BaseException


class _Add(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrived: float  # monotonic time `generate` was called


@dataclass
class _Clock:
    """When one request arrived, was first scheduled and got its first token (monotonic seconds)."""

    arrived: float
    scheduled: float | None = None
    first_token: float | None = None

    def timings(self, now: float) -> RequestTimings:
        scheduled = self.scheduled if self.scheduled is not None else now
        first = self.first_token if self.first_token is not None else now
        return RequestTimings(queued_s=scheduled - self.arrived, prefill_s=first - scheduled, decode_s=now - first)


class _Abort(NamedTuple):
    request_id: str


def _chunk(out: RequestOutput, layout_fingerprint: str, timings: RequestTimings | None = None) -> GenerationChunk:
    extra: dict[str, Any] = {}
    if out.finished and out.stop_reason is not None:
        extra["stop_reason"] = out.stop_reason
    return GenerationChunk(
        token_ids=list(out.new_token_ids),
        text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        logprobs=out.new_logprobs,
        prompt_logprobs=out.prompt_logprobs,
        integrity=_local_record(out.request_id, out.num_prompt_tokens, layout_fingerprint) if out.finished else None,
        timings=timings,
        extra=extra,
    )


def _local_record(request_id: str, num_prompt_tokens: int, layout_fingerprint: str) -> dict[str, Any]:
    return IntegrityRecord.local(request_id, num_prompt_tokens, layout_fingerprint).to_api()


class AsyncLLMEngine:
    """EngineClient for aggregated serving; `start()` it, `shutdown()` it (or use as a context manager)."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        capacity: Capacity | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """`capacity` defaults to what the engine resolved; pass one to enforce a lower per-request limit
        (--allow-context-above-pool). `settings` are extra resolved values shown in server_info()."""
        self.engine = engine
        self.model_name = model_name
        r = engine.resolved
        self._capacity = capacity or Capacity(r.context_length, {ROLE: r.pool_tokens}, r.page_size)
        assert self._capacity.page_size == r.page_size, (self._capacity, r)
        assert self._capacity.max_request_tokens <= r.pool_tokens, "capacity promises more than the pool holds"
        self._settings = dict(settings or {})
        self._cond = threading.Condition()
        self._inbox: collections.deque[_Add | _Abort] = collections.deque()
        self._streams: dict[str, _Stream] = {}  # requests in flight, by id
        self._num_prompt: dict[str, int] = {}  # their prompt lengths, for the record of a failed step
        self._clocks: dict[str, _Clock] = {}  # their timings so far (engine thread only)
        self._stopping = False
        self._step_errors = 0
        self._last_error: str | None = None
        self._num_steps = 0
        self._snapshot: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="kvfence-engine", daemon=True)
        self._take_snapshot()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> AsyncLLMEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for stream in list(self._streams.values()):
            self._deliver(stream, KvfenceError("the engine is shutting down"))
        self._streams.clear()

    def __enter__(self) -> AsyncLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- EngineClient -----------------------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        return self._capacity

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise KvfenceError("the engine is not running")
            if request_id in self._streams:
                raise KvfenceError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._num_prompt[request_id] = len(prompt_token_ids)
            self._inbox.append(_Add(request_id, list(prompt_token_ids), params, time.monotonic()))
            self._cond.notify()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            with self._cond:
                self._streams.pop(request_id, None)
                self._num_prompt.pop(request_id, None)
                if not done:  # the caller stopped listening (client gone, cancelled): free the pages
                    self._inbox.append(_Abort(request_id))
                    self._cond.notify()

    async def abort(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)
            self._num_prompt.pop(request_id, None)
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise KvfenceError("the engine thread is not running")

    def server_info(self) -> dict[str, Any]:
        e = self.engine
        r, cfg = e.resolved, e.config
        layout = e.pool.layout
        return {
            "mode": "aggregated",
            "model_name": self.model_name,
            "model_dir": cfg.model.model_dir,
            "architecture": getattr(e.loaded, "architecture", None),
            "dtype": cfg.model.dtype,
            "device": cfg.model.device,
            "kernels": r.kernels,
            "vocab_size": e.vocab_size,
            "eos_token_ids": sorted(getattr(e.tokenizer, "eos_token_ids", []) or []),
            "context_length": self._capacity.context_length,
            "engine_context_length": r.context_length,
            "page_size": r.page_size,
            "num_pages": r.num_pages,
            "max_total_tokens": {ROLE: r.pool_tokens},
            "max_request_tokens": self._capacity.max_request_tokens,
            "bytes_per_page": r.bytes_per_page,
            "layout_fingerprint": r.layout_fingerprint,
            "layout": layout.describe(),
            "scheduler": dataclasses.asdict(cfg.scheduler),
            "seed": cfg.seed,
            **self._settings,
        }

    def stats(self) -> dict[str, Any]:
        return {**self._snapshot, "num_in_flight": len(self._streams)}

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _take_snapshot(self) -> None:
        s = self.engine.stats()
        self._snapshot = {
            "roles": {
                ROLE: {
                    "pages_total": s.num_pages,
                    "pages_used": s.num_used_pages - s.num_evictable_pages,  # evictable cached pages count free
                    "pages_free": s.num_free_pages + s.num_evictable_pages,
                    "pages_quarantined": s.num_quarantined_pages,
                    "page_size": self.engine.resolved.page_size,
                }
            },
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "prefix_cache": {
                "queries": s.prefix_cache_queries,
                "hits": s.prefix_cache_hits,
                "corrupt_pages": s.prefix_cache_corrupt,
                "pages": s.num_cached_pages,
            },
            "num_steps": self._num_steps,
            "step_errors": self._step_errors,
            "last_error": self._last_error,
            "transfers": {},
        }

    def _deliver(self, stream: _Stream, item: GenerationChunk | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def _clock_step(self, step_start: float, outputs: list[RequestOutput]) -> None:
        """After a step: requests it scheduled for the first time, and first tokens it produced."""
        now = time.monotonic()
        scheduled = {r.request_id for r in self.engine.scheduler.running}
        scheduled.update(out.request_id for out in outputs)
        for request_id in scheduled:
            clock = self._clocks.get(request_id)
            if clock is not None and clock.scheduled is None:
                clock.scheduled = step_start
        for out in outputs:
            clock = self._clocks.get(out.request_id)
            if clock is not None and clock.first_token is None and out.new_token_ids:
                clock.first_token = now

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Abort):
                self._clocks.pop(cmd.request_id, None)
                self.engine.abort_request(cmd.request_id)
                continue
            stream = self._streams.get(cmd.request_id)
            if stream is None:  # aborted before it was added
                continue
            try:
                self.engine.add_request(
                    cmd.request_id, sampling_params=cmd.params, prompt_token_ids=cmd.prompt_token_ids
                )
                self._clocks[cmd.request_id] = _Clock(cmd.arrived)
            except Exception as e:  # bad input: the caller gets the error (InvalidRequestError -> HTTP 400)
                self._deliver(stream, e)

    def _fail_all(self, error: BaseException) -> None:
        message = f"engine step failed: {type(error).__name__}: {error}"
        fingerprint = self.engine.resolved.layout_fingerprint
        for request_id, stream in list(self._streams.items()):
            num_prompt = self._num_prompt.get(request_id, 0)
            self._clocks.pop(request_id, None)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after a failed step also failed", request_id)
            chunk = GenerationChunk([], "", True, "error", num_prompt_tokens=num_prompt, error=message)
            chunk.integrity = _local_record(request_id, num_prompt, fingerprint)
            chunk.extra["code"] = "engine_error"
            self._deliver(stream, chunk)

    def _run(self) -> None:
        """The engine thread. A step that raises fails its requests and the loop goes on; anything else that
        raises (applying commands, a snapshot, building a chunk) ends the thread, and then every request in
        flight gets the error instead of waiting forever for a token."""
        try:
            self._loop()
        except BaseException as e:
            logger.exception("the engine thread failed; failing every request in flight")
            with self._cond:
                self._stopping = True  # `generate` now refuses new requests instead of queueing them for nobody
                self._last_error = f"{type(e).__name__}: {e}"
                streams = list(self._streams.values())
            for stream in streams:
                self._deliver(stream, KvfenceError(f"the engine thread stopped: {self._last_error}"))

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._stopping and not self._inbox and not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            self._apply(commands)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    step_start = time.monotonic()
                    outputs = engine.step()
                    self._num_steps += 1
                    self._clock_step(step_start, outputs)
                except Exception as e:
                    logger.exception("engine step failed; failing the requests in flight")
                    self._step_errors += 1
                    self._last_error = f"{type(e).__name__}: {e}"
                    self._fail_all(e)
            self._take_snapshot()  # before delivering: a client that saw its last token sees its pages freed
            for out in outputs:
                stream = self._streams.get(out.request_id)
                clock = self._clocks.pop(out.request_id, None) if out.finished else None
                timings = clock.timings(time.monotonic()) if clock is not None else None
                if stream is not None:
                    self._deliver(stream, _chunk(out, self.engine.resolved.layout_fingerprint, timings))
            if not outputs and engine.has_unfinished_requests():
                with self._cond:  # nothing could run (e.g. waiting for pages): do not spin
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_IDLE_STEP_WAIT_S)
        self._take_snapshot()
