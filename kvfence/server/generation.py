"""Running a response's choices against the `EngineClient`: one engine request per choice, all at once.

What it knows: how the chunks of several engine streams are merged into one sequence of (choice, chunk) as they
arrive, that every unfinished engine request is aborted when the consumer stops (done, error, cancelled, the
client gone), how a non-streamed response waits for the end while watching for the client's disconnect, and
what each finished choice adds to the metrics (tokens, latencies, the engine's timings, its integrity record).
What it does not know: request bodies or response shapes (the endpoints), SSE (streaming.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request

from kvfence.engine.engine_client import EngineClient, GenerationChunk
from kvfence.server.choice import Choice
from kvfence.server.metrics import Metrics

logger = logging.getLogger(__name__)


class Generation:
    """Runs choices on one EngineClient and counts them in one Metrics."""

    def __init__(self, engine: EngineClient, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics

    async def events(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, GenerationChunk]]:
        """All choices' chunks as they arrive; on exit (done, error, cancelled) unfinished ones are aborted.

        Each chunk is absorbed into its choice before it is yielded; an exception from the engine is raised here.
        """
        queue: asyncio.Queue[tuple[Choice, GenerationChunk | BaseException | None]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
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
                previous = choice.t_last
                choice.absorb(item)
                if item.token_ids and previous is not None and choice.t_last is not None:
                    self.metrics.itl.observe(choice.t_last - previous)
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

    def _observe(self, choice: Choice, t0: float) -> None:
        now = time.monotonic()
        self.metrics.observe_integrity(choice.integrity)
        first = choice.t_first
        self.metrics.observe_finished(
            reason=choice.finish_reason,
            num_prompt_tokens=len(choice.prompt_ids),
            num_output_tokens=choice.num_output_tokens,
            ttft=None if first is None else first - t0,
            first_to_last=0.0 if first is None else (choice.t_last or first) - first,
            e2e=now - t0,
            timings=choice.timings,
        )

    async def run_to_end(self, request: Request, choices: list[Choice]) -> None:
        """Run every choice to the end; a client that disconnects meanwhile aborts them."""
        failure: list[BaseException] = []

        async def run(scope: anyio.CancelScope) -> None:
            try:
                async for _ in self.events(choices):
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
