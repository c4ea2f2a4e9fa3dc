"""A streamed response: the SSE body every generation endpoint sends, whatever its event shapes.

What it knows: the order of a stream (the renderer's opening events, then the events of each engine chunk as it
arrives, then either the closing events or, when a choice failed or anything raised, the renderer's error
events; `data: [DONE]` last where the endpoint sends it), that the first engine event is awaited before the HTTP
status goes out (so a request the engine refuses at once still gets a 4xx/5xx, not a 200 with an error inside),
and that the engine streams are closed however the stream ends (the client gone included). What it does not
know: what the events look like (each endpoint's `StreamRenderer`), or how choices run (generation.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Protocol

import anyio
from fastapi.responses import StreamingResponse
from starlette.responses import Response

from kvfence.engine.engine_client import GenerationChunk
from kvfence.errors import KvfenceError
from kvfence.server.choice import Choice, failure
from kvfence.server.http import ApiError, sse_event, to_api_error

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class SseEvent(NamedTuple):
    data: dict[str, Any]
    event: str | None = None  # the `event:` line, for endpoints that name their events


class StreamRenderer(Protocol):
    """An endpoint's stream shapes; it may keep state of its own across one stream."""

    sends_done: bool  # end with `data: [DONE]` (chat and completions do; the Responses API does not)

    def opening(self, choices: list[Choice]) -> list[SseEvent]: ...

    def chunk(self, choice: Choice, chunk: GenerationChunk) -> list[SseEvent]: ...

    def closing(self, choices: list[Choice]) -> list[SseEvent]: ...

    def failed(self, err: ApiError, choices: list[Choice]) -> list[SseEvent]: ...


def _encode(events: list[SseEvent]) -> bytes:
    return b"".join(sse_event(e.data, e.event) for e in events)


async def stream_response(
    events: AsyncIterator[tuple[Choice, GenerationChunk]], choices: list[Choice], renderer: StreamRenderer
) -> Response:
    """The SSE response of `choices`, whose engine chunks `events` yields (generation.Generation.events)."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _encode(renderer.opening(choices))
            pending = [first] if first is not None else []
            while True:
                if pending:
                    c, chunk = pending.pop()
                else:
                    try:
                        c, chunk = await events.__anext__()
                    except StopAsyncIteration:
                        break
                yield _encode(renderer.chunk(c, chunk))
                if c.error is not None:  # one choice failed: the error events end the whole stream
                    break
            err = failure(choices)
            yield _encode(renderer.failed(err, choices) if err is not None else renderer.closing(choices))
        except (KvfenceError, ApiError) as e:
            yield _encode(renderer.failed(to_api_error(e), choices))
        except Exception:
            logger.exception("stream failed")
            err = ApiError(500, "internal error while streaming; see the server log", type="server_error")
            yield _encode(renderer.failed(err, choices))
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
        if renderer.sends_done:
            yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
