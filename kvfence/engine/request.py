"""One generation request: its tokens, how many are in the KV pool, and its pages.

What it knows: the prompt and output token ids, a few integer counters (prompt
length, tokens whose KV is already in the pool), its status, its page table, its
sampling state (generator, grammar) and the log probabilities it was asked to keep
(one entry per output token; prompt entries from the second prompt token on).
Everything else (lengths, finish reason, whether it is prefilling) is a property
derived from those. Invariants are asserted where it is made.

What it does not know: the model, the batch it is in, or how pages were chosen
(the scheduler decides and the allocator records ownership).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from kvfence.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvfence.engine.structured_output import Grammar
    from kvfence.engine.token_logprobs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages taken back; waits again and recomputes its tokens
    FINISHED_STOPPED = "stop"  # eos, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILL_DONE = "prefill_done"  # prefill-only request: first token sampled, pages kept

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED_"))


class Request:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "sampling_params",
        "status",
        "page_table",
        "prefill_only",
        "generator",
        "stop_reason",
        "num_preemptions",
        "grammar",
        "logprobs",
        "prompt_logprobs",
        "num_cached_pages",
        "prefix_key",
        "prefix_cacheable",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prefill_only: bool = False,
        generator: torch.Generator | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        assert isinstance(request_id, str) and request_id, request_id
        assert len(prompt_token_ids) > 0, "a request needs at least one prompt token"
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then outputs as they are sampled
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens of token_ids whose KV is in the pool
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.page_table: list[int] = []
        self.prefill_only = prefill_only
        self.generator = generator  # None for greedy requests
        self.stop_reason: int | str | None = None  # the stop token or string that finished it
        self.num_preemptions = 0
        self.num_cached_pages = 0  # leading pages of page_table already offered to the prefix cache
        self.prefix_key: bytes | None = None  # the prefix cache's chain key of those pages (None while there are none)
        self.prefix_cacheable = sampling_params.prompt_logprobs is None  # prompt logprobs need every row computed
        self.grammar = grammar  # where the output stands in its response_format grammar
        self.logprobs: list[TokenLogprobs] = []  # one per output token, when sampling_params.logprobs is set
        # prompt tokens' entries (the first has none: nothing predicts it); None when not asked for
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )

    # -- derived --------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status in _FINISHED else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, pages={len(self.page_table)})"
        )
