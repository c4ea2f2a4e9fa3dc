"""What the HTTP front end needs from whatever generates tokens behind it.

What it knows: the narrow async interface the OpenAI-compatible API talks to — the
aggregated engine (one process) and the disaggregated router (prefill + decode
workers) both implement it, so the API code is the same for both. What it does not
know: scheduling, KV pages or transports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.engine.token_logprobs import TokenLogprobs


@dataclass(frozen=True)
class Capacity:
    """Limits the front end enforces before any worker sees a request."""

    context_length: int  # max prompt + output tokens of one request
    max_total_tokens: dict[str, int]  # KV pool capacity in tokens per role, e.g. {"prefill": .., "decode": ..}
    page_size: int

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens a single request may have on every role."""
        return min(self.context_length, *self.max_total_tokens.values())


@dataclass(frozen=True)
class RequestTimings:
    """An engine's account of one request's time, in seconds, with vLLM's meanings (sent on the last chunk).

    queued: from the engine receiving it to its first scheduled step; prefill: from then to its first
    token; decode: from the first token to the last. An engine that cannot tell (the disaggregated router
    today) sends none, and the front end observes nothing for them."""

    queued_s: float
    prefill_s: float
    decode_s: float

    @property
    def inference_s(self) -> float:
        """First scheduled step to last token (vLLM's request_inference_time)."""
        return self.prefill_s + self.decode_s


@dataclass
class GenerationChunk:
    """One increment of a request's output, as streamed to the client."""

    token_ids: list[int]  # new tokens since the previous chunk
    text: str  # new text since the previous chunk (stop strings already removed)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first chunk, when asked for
    integrity: dict[str, Any] | None = None  # the request's integrity record, on the final chunk
    error: str | None = None  # set with finish_reason "error": message for the client
    timings: RequestTimings | None = None  # on the final chunk, when the engine keeps them
    extra: dict[str, Any] = field(default_factory=dict)


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    def capacity(self) -> Capacity: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until one with finished=True."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def server_info(self) -> dict[str, Any]:
        """Every resolved setting and capacity, per role (what `kvfence audit` would need)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Live numbers for /metrics: pages used/free per role, running/waiting requests, transfers."""
        ...
