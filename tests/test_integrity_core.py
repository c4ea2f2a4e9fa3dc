"""Digests, canaries, manifests, verification and records, without any transport."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvfence.integrity.canary import canary_offsets, check_canaries, compute_canaries
from kvfence.integrity.digest import PageBytes, bytes_digest, page_digest, page_digests, run_digest, token_hash
from kvfence.integrity.manifest import HandoffManifest, ManifestError, build_manifest, pages_for_tokens
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import CoverageBitmap, Expectation, Reason, VerifyResult, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from tests.helpers.auth import cap

GQA = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 8)), KVBufferSpec("v", (2, 8))), 4, torch.float16)
DSA = KVLayout(
    "GlmMoeDsaForCausalLM",
    2,
    (KVBufferSpec("latent", (1, 16)), KVBufferSpec("rope", (1, 4)), KVBufferSpec("indexer", (1, 8))),
    4,
    torch.bfloat16,
)


def filled_pool(layout: KVLayout, num_pages: int, seed: int = 0) -> KVPool:
    pool = KVPool(layout, num_pages)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.tensors:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def copy_pages(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> CoverageBitmap:
    cov = CoverageBitmap(len(dst_pages))
    for i, (s, d) in enumerate(zip(src_pages, dst_pages, strict=True)):
        dst.write_page(d, src.read_page(s))
        cov.mark(i)
    return cov


def test_page_digest_equals_digest_of_read_page_bytes() -> None:
    pool = filled_pool(GQA, 4)
    assert page_digest(pool, 2) == bytes_digest(pool.read_page(2))
    assert run_digest(pool, [1, 3]) == bytes_digest(pool.read_page(1) + pool.read_page(3))


@pytest.mark.parametrize("layout", [GQA, DSA], ids=["gqa", "dsa"])
def test_page_bytes_views_are_the_pool_page_memoryviews_and_share_memory(layout: KVLayout) -> None:
    pool = filled_pool(layout, 3)
    pb = PageBytes(pool)
    assert [bytes(v) for v in pb.views(2)] == [bytes(v) for v in pool.page_memoryviews(2)]
    before = pool.read_page(2)
    pb.views(2)[-1][0] ^= 0xFF  # writing through the view changes the pool: no copy
    after = pool.read_page(2)
    off = layout.bytes_per_page - len(pb.views(2)[-1])  # the last slice starts here
    assert after[off] == before[off] ^ 0xFF and after[:off] == before[:off]


@pytest.mark.parametrize("layout", [GQA, DSA], ids=["gqa", "dsa"])
def test_digest_changes_when_any_buffer_of_any_layer_changes(layout: KVLayout) -> None:
    pool = filled_pool(layout, 3)
    before = page_digests(pool, [0, 1, 2])
    for layer in range(layout.num_layers):
        for spec in layout.buffers:
            t = pool.tensors[layer][spec.name]
            t.view(torch.uint8)[1].view(-1)[-1] ^= 0x01  # last byte of page 1 of this buffer
            after = page_digests(pool, [0, 1, 2])
            assert after[0] == before[0] and after[2] == before[2]
            assert after[1] != before[1], (layer, spec.name)
            t.view(torch.uint8)[1].view(-1)[-1] ^= 0x01
    assert page_digests(pool, [0, 1, 2]) == before


def test_token_hash_is_int64_little_endian_xxh3_and_type_independent() -> None:
    ids = [1, 2, 70000]
    h = token_hash(ids)
    assert h == token_hash(np.array(ids, dtype=np.int32)) == token_hash(torch.tensor(ids))
    assert len(h) == 16 and h != token_hash([1, 2, 70001]) and h != token_hash([1, 2])
    assert int(h, 16) == bytes_digest(np.array(ids, dtype="<i8").tobytes())


@pytest.mark.parametrize("layout", [GQA, DSA], ids=["gqa", "dsa"])
def test_canary_detects_a_change_at_a_sampled_byte_of_every_buffer(layout: KVLayout) -> None:
    pool = filled_pool(layout, 4)
    pages = [3, 1]  # logical 0 -> page 3, logical 1 -> page 1
    expected = compute_canaries(pool, pages, "req-a")
    assert check_canaries(pool, pages, "req-a", expected) == []
    slice_index = 0
    for layer in range(layout.num_layers):
        for spec in layout.buffers:
            flat = pool.tensors[layer][spec.name].view(torch.uint8).view(pool.num_pages, -1)
            off = int(canary_offsets("req-a", slice_index, flat.shape[1], 2)[1, 0])  # logical 1, first sample
            flat[1, off] ^= 0xFF
            assert check_canaries(pool, pages, "req-a", expected) == [1], (layer, spec.name)
            flat[1, off] ^= 0xFF
            slice_index += 1


def test_canaries_are_bound_to_the_request_id() -> None:
    pool = filled_pool(GQA, 2)
    assert compute_canaries(pool, [0, 1], "req-a") != compute_canaries(pool, [0, 1], "req-b")


def test_manifest_round_trips_through_bytes() -> None:
    pool = filled_pool(DSA, 5)
    m = build_manifest("r1", "x1", list(range(10)), pool, [4, 0, 2, 1])
    assert m.num_pages == pages_for_tokens(10, 4) == 3
    assert m.page_digests == tuple(page_digests(pool, [4, 0, 2]))
    back = HandoffManifest.from_bytes(m.to_bytes())
    assert back == m
    assert b"pickle" not in m.to_bytes() and json.loads(m.to_bytes())["version"] == 1


def test_manifest_carries_prefills_first_token_and_its_scores() -> None:
    pool = filled_pool(GQA, 2)
    m = build_manifest("r1", "x1", [3, 4, 5], pool, [0], first_token=42, first_logprobs=[42, -0.5, [[42, -0.5]]])
    back = HandoffManifest.from_bytes(m.to_bytes())
    assert (back.first_token, back.first_logprobs) == (42, [42, -0.5, [[42, -0.5]]])
    plain = build_manifest("r1", "x1", [3, 4, 5], pool, [0])
    assert HandoffManifest.from_bytes(plain.to_bytes()).first_token is None and b"first_token" not in plain.to_bytes()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(version=99),
        lambda d: d.update(first_token=-3),
        lambda d: d.pop("token_hash"),
        lambda d: d.update(page_digests="!!notbase64"),
        lambda d: d.update(num_pages=7),
    ],
    ids=["version", "first_token", "missing", "badpack", "inconsistent"],
)
def test_manifest_from_bytes_refuses_what_it_does_not_understand(mutate) -> None:
    pool = filled_pool(GQA, 2)
    d = json.loads(build_manifest("r1", "x1", [1, 2, 3], pool, [0]).to_bytes())
    mutate(d)
    with pytest.raises(ManifestError):
        HandoffManifest.from_bytes(json.dumps(d).encode())


def _handoff(layout: KVLayout = GQA, tokens: int = 10):
    src = filled_pool(layout, 6, seed=1)
    dst = filled_pool(layout, 6, seed=2)
    ids = list(range(100, 100 + tokens))
    src_pages = [5, 0, 3][: pages_for_tokens(tokens, layout.page_size)]
    dst_pages = [1, 4, 2][: len(src_pages)]
    m = build_manifest("r1", "x1", ids, src, src_pages)
    cov = copy_pages(src, src_pages, dst, dst_pages)
    return m, Expectation("r1", tokens, token_hash(ids), cap("r1")), dst, dst_pages, cov


def test_verify_accepts_an_exact_handoff() -> None:
    m, exp, dst, pages, cov = _handoff(DSA)
    r = verify_handoff(m, exp, DSA, pages, cov, dst)
    assert r == VerifyResult(True, None, "verified", 3, 10, "xxh3_64")


@pytest.mark.parametrize(
    "breakage, reason",
    [
        ("request", Reason.REQUEST_MISMATCH),
        ("layout", Reason.LAYOUT_MISMATCH),
        ("tokens", Reason.TOKEN_COUNT_MISMATCH),
        ("hash", Reason.TOKEN_HASH_MISMATCH),
        ("pages", Reason.PAGE_COUNT_MISMATCH),
        ("gap", Reason.COVERAGE_GAP),
        ("twice", Reason.COVERAGE_GAP),
        ("outside", Reason.COVERAGE_GAP),
        ("digest", Reason.DIGEST_MISMATCH),
        ("canary", Reason.CANARY_MISMATCH),
    ],
)
def test_verify_names_the_first_failing_check(breakage: str, reason: Reason) -> None:
    m, exp, dst, pages, cov = _handoff()
    layout = GQA
    if breakage == "request":
        exp = exp._replace(request_id="r2")
    elif breakage == "layout":
        layout = KVLayout(GQA.architecture, 3, GQA.buffers, GQA.page_size, GQA.dtype)
    elif breakage == "tokens":
        exp = exp._replace(tokens_expected=11)
    elif breakage == "hash":
        exp = exp._replace(token_hash=token_hash([1]))
    elif breakage == "pages":
        pages = pages + [5]
    elif breakage == "gap":
        cov.counts[1] = 0
    elif breakage == "twice":
        cov.mark(2)
    elif breakage == "outside":
        cov.mark(7)
    elif breakage == "digest":
        dst.tensors[1]["v"].view(torch.uint8)[pages[2]].view(-1)[0] ^= 0x10
    elif breakage == "canary":
        m = HandoffManifest(**{**m.__dict__, "canaries": (m.canaries[0] ^ 1, *m.canaries[1:])})
    r = verify_handoff(m, exp, layout, pages, cov, dst)
    assert not r.ok and r.reason == reason, r
    assert r.detail


def test_record_json_api_and_prometheus_counters() -> None:
    metrics = IntegrityMetrics()
    ok = IntegrityRecord.from_result(
        "r1",
        VerifyResult(True, None, "verified", 3, 10),
        tokens_expected=10,
        pages=3,
        layout_fingerprint="abc",
        timings={"verify": 0.001},
    )
    bad = IntegrityRecord.from_result(
        "r2",
        VerifyResult(False, Reason.TOKEN_COUNT_MISMATCH, "manifest covers 1 tokens", 0, 0),
        tokens_expected=5000,
        pages=313,
        layout_fingerprint="abc",
    )
    failed = IntegrityRecord.from_result(
        "r3",
        VerifyResult(False, Reason.TIMEOUT, "no manifest", 0, 0),
        tokens_expected=4,
        pages=1,
        layout_fingerprint="abc",
    )
    for rec in (ok, bad, failed):
        metrics.observe(rec)
    assert (ok.status, bad.status, failed.status) == ("verified", "rejected", "failed")
    line = json.loads(bad.to_json())
    assert line["reason"] == "token_count_mismatch" and line["tokens_expected"] == 5000 and line["pages"] == 313
    assert ok.to_api()["status"] == "verified" and ok.to_api()["digest_algorithm"] == "xxh3_64"
    assert metrics.value("kvfence_handoff_verified_total") == 1
    assert metrics.value("kvfence_handoff_failed_total", {"reason": "token_count_mismatch"}) == 1
    assert metrics.value("kvfence_handoff_failed_total", {"reason": "timeout"}) == 1
    assert IntegrityMetrics().value("kvfence_handoff_verified_total") == 0  # registries are independent
