"""A time window of the logs (a minute, ten minutes, an hour or a day): what happened in it, as counts.

What it knows: the per-window counters the report's window table shows (batches, sequences and tokens
prefilled, decode batches and finished requests, peak pool usage, too-long / truncated / capacity / context
rejects, transfer failures, checksum mismatches, corruption, deferred-release timeouts, canary violations, leak
candidates and placeholder signatures, and checksum coverage of the requests decoded in it).
What it does not know: which requests they were (kvfence.audit.logs.notes keeps the notable ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Window:
    prefill_batches: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_max_usage: float = 0.0
    decode_batches: int = 0
    decode_max_usage: float = 0.0
    decode_requests: int = 0
    too_long: int = 0
    truncated: int = 0
    decode_capacity_rejects: int = 0
    context_rejects: int = 0
    transfer_failures: int = 0
    checksum_mismatches: int = 0
    corruption: int = 0
    deferred_timeouts: int = 0
    canary_violations: int = 0
    candidates: int = 0
    placeholder: int = 0
    coverage: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
