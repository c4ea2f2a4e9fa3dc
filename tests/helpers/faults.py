"""The fault matrix shared by the transport tests: each named fault with the rejection reason verification
must give (EXPECTED), one request's prefill + decode handoffs on a rig of pools, allocators and a
transport (handoff_pair), a poll loop (drive), a byte comparison (same_bytes) and the whole check of
one fault beside an innocent transfer (check_fault_case). It builds no rig and picks no transport:
the test modules do (tests/test_faults.py: local and TCP; tests/test_transfer_mooncake_backend.py)."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvfence.disagg.handoff import DecodeHandoff, DecodeState, PrefillHandoff, PrefillState
from kvfence.faults import FaultInjector
from kvfence.integrity.digest import digest_algorithm_for, token_hash
from kvfence.integrity.verify import Expectation
from kvfence.kv.pool import KVPool
from tests.helpers.auth import cap


def handoff_pair(rig: Any, rid: str, num_tokens: int, seed: int) -> tuple[PrefillHandoff, DecodeHandoff, list[bytes]]:
    """Prefill + decode handoffs for one request on `rig` (p_alloc, p_pool, d_alloc, d_pool, sender, receiver,
    config, metrics, faults); prefill's pages get seeded random 'KV'. Also returns a snapshot of their bytes."""
    pages = rig.p_alloc.allocate(rid, -(-num_tokens // rig.p_pool.layout.page_size))
    g = torch.Generator().manual_seed(seed)
    for layer in rig.p_pool.tensors:
        for t in layer.values():
            t[pages] = torch.randn((len(pages), *t.shape[1:]), generator=g).to(t.dtype).to(t.device)
    ids = [seed * 1000 + i for i in range(num_tokens)]
    dec = DecodeHandoff(
        Expectation(rid, num_tokens, token_hash(ids), cap(rid)),
        rig.d_alloc,
        rig.d_pool,
        rig.receiver,
        rig.config,
        rig.metrics,
    )
    dec.start()
    pre = PrefillHandoff(
        rid,
        ids,
        rig.p_alloc,
        rig.p_pool,
        rig.sender,
        rig.receiver.address,
        rig.config,
        rig.faults,
        transfer_id=cap(rid),
    )
    return pre, dec, [rig.p_pool.read_page(p) for p in pages]


def drive(*handoffs, until=None, timeout: float = 10.0) -> None:
    """Poll every handoff until all are settled (or `until()` holds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for h in handoffs:
            h.poll()
        if until() if until is not None else all(h.settled for h in handoffs):
            return
        time.sleep(0.001)
    raise AssertionError(f"not settled: {[(type(h).__name__, h.state) for h in handoffs]}")


def same_bytes(src: list[bytes], dst_pool: KVPool, dst_pages: list[int]) -> bool:
    return all(s == dst_pool.read_page(d) for s, d in zip(src, dst_pages, strict=True))


EXPECTED = {
    "placeholder_handoff": "token_count_mismatch",
    "short_write": "coverage_gap",
    "drop_page": "coverage_gap",
    "corrupt_byte": "digest_mismatch",
    "reorder_pages": "digest_mismatch",
    "stale_page": "digest_mismatch",
    "wrong_layout": "layout_mismatch",
}


def check_fault_case(rig: Any, make_pair: Any, fault: str, faults: FaultInjector, bad: str, good: str) -> Any:
    """Hand off `bad` (37 tokens, which the fault hits) beside `good` (29 tokens) and check the fault is caught
    with its expected reason, the innocent transfer lands byte-exact and verified, and every page comes back.

    rig: has p_alloc, d_alloc, d_pool, metrics; make_pair(rid, num_tokens, seed) -> (prefill, decode, source
    bytes). Returns the good request's PrefillHandoff for transport-specific checks."""
    baseline_p, baseline_d = rig.p_alloc.num_free, rig.d_alloc.num_free
    bad_pre, bad_dec, _ = make_pair(bad, 37, seed=1)  # 5 pages of 8
    good_pre, good_dec, good_src = make_pair(good, 29, seed=2)
    bad_pre.send()
    good_pre.send()
    drive(bad_pre, bad_dec, good_pre, good_dec)

    assert faults.fired[fault] >= 1
    assert bad_dec.state == DecodeState.FINISHED and bad_dec.ok is False
    assert bad_dec.record.status == "rejected" and bad_dec.record.reason == EXPECTED[fault], bad_dec.record
    assert bad_pre.state == PrefillState.FINISHED and bad_pre.outcome == "failed" and "rejected" in bad_pre.reason
    assert good_dec.state == DecodeState.VERIFIED and good_dec.record.status == "verified"
    assert good_dec.record.digest_algorithm == digest_algorithm_for(rig.p_pool)  # mlh62 from a device pool
    assert good_pre.state == PrefillState.FINISHED and good_pre.outcome == "verified"
    assert same_bytes(good_src, rig.d_pool, good_dec.pages)
    assert rig.metrics.value("kvfence_handoff_failed_total", {"reason": EXPECTED[fault]}) == 1
    assert rig.metrics.value("kvfence_handoff_verified_total") == 1

    rig.d_alloc.free(good)  # the decode scheduler would do this when the request finishes
    for alloc in (rig.p_alloc, rig.d_alloc):
        alloc.check()
    assert (rig.p_alloc.num_free, rig.d_alloc.num_free) == (baseline_p, baseline_d)
    assert rig.d_alloc.num_quarantined == 0
    return good_pre
