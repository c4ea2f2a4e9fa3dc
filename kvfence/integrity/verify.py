"""Decode-side verification of one KV handoff, before the request may be scheduled.

What it knows: the checks, in order, that decide whether the pages that landed in
decode's pool are the prompt the router asked for:

  1. request_mismatch       manifest.request_id == the router's request id
  2. layout_mismatch        manifest layout (fingerprint, and the fingerprint of its own
                            description) == decode's layout; an unknown layout is refused
  3. token_count_mismatch   manifest.num_tokens == the router's expected token count
  4. token_hash_mismatch    manifest.token_hash == the router's token hash
  5. page_count_mismatch    ceil(num_tokens / page_size) == manifest.num_pages ==
                            pages decode allocated == digests/canaries in the manifest
  6. coverage_gap           every allocated page written in full exactly once by this
                            transfer (the receiver's `CoverageBitmap`), nothing outside
  7. digest_mismatch        the digest of each destination page, recomputed now with the manifest's
                            algorithm (xxh3_64 or mlh62, `integrity.digest`) where the pool lives, == manifest
  8. canary_mismatch        sampled canaries of each destination page == manifest

The router's expectation is independent of prefill: a manifest that covers fewer
tokens than the router says the prompt has is rejected at step 3 (the 2026 incident).
The reason codes, transport-level endings (transfer_error, timeout, aborted) included so every ending has one
code, and the result type are `integrity.verdict` (torch-free, for the router), re-exported here.

What it does not know: how pages got there (transport) or what happens next (the
handoff state machine quarantines and records).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvfence.integrity.canary import check_canaries
from kvfence.integrity.digest import DIGEST_ALGORITHMS, page_digests
from kvfence.integrity.manifest import HandoffManifest, pages_for_tokens
from kvfence.integrity.verdict import VERIFY_REASONS as VERIFY_REASONS
from kvfence.integrity.verdict import Reason, VerifyResult
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool


class Expectation(NamedTuple):
    """What the router says the request is; never taken from prefill."""

    request_id: str
    tokens_expected: int  # the router's count of the prompt it admitted (the manifest's `num_tokens` is prefill's)
    token_hash: str
    transfer_id: str  # the capability the router issued for this handoff: the only transfer decode accepts


class CoverageBitmap:
    """Which logical pages of one transfer were written in full, and how many times.

    The receiver calls `mark(i)` after the last byte of logical page i landed in its
    destination page, `mark_outside()` for a page index beyond decode's allocation.
    A page written twice (duplicate / replay) counts 2 and fails like a gap does.
    """

    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 0, num_pages
        self.num_pages = num_pages
        self.counts = np.zeros(num_pages, dtype=np.int32)  # [num_pages]
        self.outside = 0
        self._lock = threading.Lock()

    def mark(self, index: int) -> None:
        with self._lock:
            if 0 <= index < self.num_pages:
                self.counts[index] += 1
            else:
                self.outside += 1

    def mark_outside(self) -> None:
        with self._lock:
            self.outside += 1

    @property
    def num_covered(self) -> int:
        return int((self.counts == 1).sum())

    @property
    def complete(self) -> bool:
        return self.outside == 0 and bool((self.counts == 1).all())

    def describe_gaps(self, limit: int = 8) -> str:
        missing = np.flatnonzero(self.counts == 0).tolist()
        twice = np.flatnonzero(self.counts > 1).tolist()
        parts = []
        if missing:
            parts.append(f"{len(missing)} page(s) never fully written (logical {missing[:limit]})")
        if twice:
            parts.append(f"{len(twice)} page(s) written more than once (logical {twice[:limit]})")
        if self.outside:
            parts.append(f"{self.outside} page write(s) outside the allocation")
        return "; ".join(parts) or "complete"


def _fail(
    reason: Reason, detail: str, pages_checked: int = 0, tokens_covered: int = 0, algorithm: str | None = None
) -> VerifyResult:
    return VerifyResult(False, reason, detail, pages_checked, tokens_covered, algorithm)


def verify_handoff(
    manifest: HandoffManifest,
    expect: Expectation,
    layout: KVLayout,
    dest_pages: Sequence[int],
    coverage: CoverageBitmap,
    pool: KVPool,
    check_canary: bool = True,
) -> VerifyResult:
    """Run checks 1-8 in order; the first failure decides the reason. See the module docstring."""
    m, ps = manifest, layout.page_size
    if m.request_id != expect.request_id:
        return _fail(
            Reason.REQUEST_MISMATCH, f"manifest is for request {m.request_id!r}, decode expects {expect.request_id!r}"
        )
    try:
        described = KVLayout.from_description(m.layout).fingerprint
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        return _fail(Reason.LAYOUT_MISMATCH, f"manifest layout description is not understood: {e}")
    if m.layout_fingerprint != layout.fingerprint or described != layout.fingerprint:
        return _fail(
            Reason.LAYOUT_MISMATCH,
            f"manifest layout {m.layout_fingerprint} (described {described}) differs from decode layout "
            f"{layout.fingerprint} {layout.describe()}",
        )
    if m.digest_algorithm not in DIGEST_ALGORITHMS:
        return _fail(
            Reason.LAYOUT_MISMATCH,
            f"digest algorithm {m.digest_algorithm!r} is unknown; decode verifies {', '.join(DIGEST_ALGORITHMS)}",
        )
    algo = m.digest_algorithm
    if m.num_tokens != expect.tokens_expected:
        return _fail(
            Reason.TOKEN_COUNT_MISMATCH,
            f"manifest covers {m.num_tokens} tokens, router expects {expect.tokens_expected}",
            algorithm=algo,
        )
    if m.token_hash != expect.token_hash:
        return _fail(
            Reason.TOKEN_HASH_MISMATCH,
            f"manifest token hash {m.token_hash}, router's is {expect.token_hash}",
            algorithm=algo,
        )
    need = pages_for_tokens(expect.tokens_expected, ps)
    if not (m.num_pages == need == len(dest_pages) == coverage.num_pages):
        return _fail(
            Reason.PAGE_COUNT_MISMATCH,
            f"{expect.tokens_expected} tokens need {need} pages of {ps}; manifest has {m.num_pages}, "
            f"decode allocated {len(dest_pages)}, coverage tracks {coverage.num_pages}",
            algorithm=algo,
        )
    if not coverage.complete:
        return _fail(
            Reason.COVERAGE_GAP,
            coverage.describe_gaps(),
            tokens_covered=min(expect.tokens_expected, coverage.num_covered * ps),
            algorithm=algo,
        )
    # computed where the pool lives (mlh62 on a device pool: only the digests come to the host)
    got = page_digests(pool, dest_pages, algo)
    for i, page in enumerate(dest_pages):
        if got[i] != m.page_digests[i]:
            return _fail(
                Reason.DIGEST_MISMATCH,
                f"logical page {i} (decode page {page}): {algo} {got[i]:016x}, manifest {m.page_digests[i]:016x}",
                pages_checked=i + 1,
                tokens_covered=min(expect.tokens_expected, i * ps),
                algorithm=algo,
            )
    if check_canary:
        bad = check_canaries(pool, dest_pages, expect.request_id, m.canaries, m.canary_samples)
        if bad:
            return _fail(
                Reason.CANARY_MISMATCH,
                f"{len(bad)} page(s) with broken canaries (logical {bad[:8]})",
                pages_checked=len(dest_pages),
                tokens_covered=min(expect.tokens_expected, bad[0] * ps),
                algorithm=algo,
            )
    return VerifyResult(True, None, "verified", len(dest_pages), expect.tokens_expected, algo)
