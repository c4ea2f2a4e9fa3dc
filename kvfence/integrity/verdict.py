"""What one verification of a KV handoff concluded: its reason codes and its result.

What it knows: every reason a handoff can end with (the checks of `kvfence.integrity.verify`, in their order, and the
transport-level endings transfer_error, timeout and aborted, so every ending has one code), which of them mean the
landed pages were inspected and refused (`VERIFY_REASONS`: "rejected", the others "failed"), and the result record.
Plain Python, so the router and the integrity records import it without torch. What it does not know: how any
check is made (`kvfence.integrity.verify`).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Reason(str, Enum):
    REQUEST_MISMATCH = "request_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    TOKEN_COUNT_MISMATCH = "token_count_mismatch"
    TOKEN_HASH_MISMATCH = "token_hash_mismatch"
    PAGE_COUNT_MISMATCH = "page_count_mismatch"
    COVERAGE_GAP = "coverage_gap"
    DIGEST_MISMATCH = "digest_mismatch"
    CANARY_MISMATCH = "canary_mismatch"
    TRANSFER_ERROR = "transfer_error"
    TIMEOUT = "timeout"
    ABORTED = "aborted"


# Reasons found by inspecting the landed pages/manifest (the request is "rejected");
# the others mean the transfer itself did not complete (the request "failed").
VERIFY_REASONS = frozenset(
    {
        Reason.REQUEST_MISMATCH,
        Reason.LAYOUT_MISMATCH,
        Reason.TOKEN_COUNT_MISMATCH,
        Reason.TOKEN_HASH_MISMATCH,
        Reason.PAGE_COUNT_MISMATCH,
        Reason.COVERAGE_GAP,
        Reason.DIGEST_MISMATCH,
        Reason.CANARY_MISMATCH,
    }
)


class VerifyResult(NamedTuple):
    ok: bool
    reason: Reason | None
    detail: str
    pages_checked: int
    tokens_covered: int
    digest_algorithm: str | None = None  # the manifest's, once verification got as far as reading it
