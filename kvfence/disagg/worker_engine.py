"""The engine a disaggregated worker drives: the verbs prefill and decode call, as Protocols.

What it knows: which parts of `kvfence.engine.llm_engine.LLMEngine` each worker role
uses (its KV pool and allocator, the resolved sizes, stepping, releasing and aborting
requests; prefill adds prompt-only requests, decode reserves pages and adds requests
whose prompt KV arrived by handoff). `LLMEngine` satisfies both; tests may pass fakes.

What it does not know: how the engine schedules or runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvfence.config import ResolvedEngineConfig
    from kvfence.engine.llm_engine import EngineStats, RequestOutput
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.engine.scheduler import Scheduler
    from kvfence.engine.token_logprobs import TokenLogprobs
    from kvfence.kv.allocator import PageAllocator
    from kvfence.kv.pool import KVPool
    from kvfence.kv.prefix_cache import PrefixCache


class WorkerEngine(Protocol):
    """What both roles use."""

    pool: KVPool
    allocator: PageAllocator
    resolved: ResolvedEngineConfig

    def stats(self) -> EngineStats: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def abort_request(self, request_id: str) -> bool: ...
    def release(self, request_id: str, quarantine: bool = False) -> list[int]: ...


class PrefillEngine(WorkerEngine, Protocol):
    """Prefill: prompts run `prefill_only` and keep their pages until `release`."""

    prefix_cache: PrefixCache | None  # strict mode has it poison the pages it evicts

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        prefill_only: bool = False,
    ) -> None: ...
    def first_token_text(self, token_id: int, params: SamplingParams) -> str | None: ...
    def held_pages(self, request_id: str) -> list[int]: ...


class DecodeEngine(WorkerEngine, Protocol):
    """Decode: reserve pages for the router's length, then add the request once its KV verified."""

    scheduler: Scheduler  # read only to advance a seeded request's generator past prefill's draw

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None: ...
    def report_pending(self) -> list[RequestOutput]: ...
    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling_params: SamplingParams,
        page_table: Sequence[int] | None = None,
        first_logprobs: TokenLogprobs | None = None,
    ) -> None: ...
