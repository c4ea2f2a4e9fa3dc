"""The digests, canaries and verification of device pools (`integrity.device_digest`, the device paths of
`integrity.digest`, `.canary`, `.verify`), run on CPU tensors standing in for a device (KVFENCE_TEST_DEVICE=cuda
runs them on a GPU): the torch digest equals the numpy reference over the same bytes, changes with any bit of a
page, tells apart the pages a faulty handoff produces, and verification works across host and device pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfence.errors import KvfenceError
from kvfence.integrity import device_digest
from kvfence.integrity.canary import check_canaries, compute_canaries
from kvfence.integrity.device_digest import BLOCK, MLH_ALGORITHM, bytes_digest_mlh, page_digests_torch
from kvfence.integrity.digest import DIGEST_ALGORITHM, bytes_digest, digest_algorithm_for, page_digests, token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.record import IntegrityRecord
from kvfence.integrity.verify import CoverageBitmap, Expectation, Reason, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from tests.helpers.auth import cap
from tests.helpers.device import TEST_DEVICE, device_pool

GQA = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 8)), KVBufferSpec("v", (2, 8))), 4, torch.float16)
DSA = KVLayout(
    "GlmMoeDsaForCausalLM",
    2,
    (KVBufferSpec("latent", (1, 16)), KVBufferSpec("rope", (1, 4)), KVBufferSpec("indexer", (1, 8))),
    4,
    torch.bfloat16,
)
F32 = KVLayout("LlamaForCausalLM", 1, (KVBufferSpec("k", (1, 3)), KVBufferSpec("v", (1, 3))), 3, torch.float32)
# slices of 2 whole blocks and of 1.5 blocks of 16-bit units
WIDE = KVLayout(
    "LlamaForCausalLM", 1, (KVBufferSpec("k", (BLOCK,)), KVBufferSpec("v", (3 * BLOCK // 4,))), 2, torch.bfloat16
)
LAYOUTS = pytest.mark.parametrize("layout", [GQA, DSA, F32, WIDE], ids=["gqa-fp16", "dsa-bf16", "fp32", "wide"])


def fill(pool: KVPool, seed: int) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    for layer in pool.tensors:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def twin(pool: KVPool) -> KVPool:
    """A host-visible CPU pool with the same bytes."""
    host = KVPool(pool.layout, pool.num_pages)
    for a, b in zip(host.tensors, pool.tensors, strict=True):
        for name in a:
            a[name].copy_(b[name])
    return host


@LAYOUTS
def test_torch_digest_on_a_device_pool_equals_the_numpy_reference_over_its_bytes(layout: KVLayout) -> None:
    pool = fill(device_pool(layout, 6), seed=1)
    pages = [5, 0, 3, 3]
    got = page_digests_torch(pool, pages)
    assert got == [bytes_digest_mlh(pool.read_page(p), layout) for p in pages]
    assert got == [bytes_digest(pool.read_page(p), MLH_ALGORITHM, layout) for p in pages]
    assert got == page_digests(twin(pool), pages, MLH_ALGORITHM)  # the same digest from a host pool's bytes
    assert all(0 <= d < (1 << 62) for d in got) and len(set(got[:3])) == 3


def test_a_device_pool_digests_with_mlh62_and_a_host_pool_with_xxh3() -> None:
    assert digest_algorithm_for(device_pool(GQA, 2)) == MLH_ALGORITHM
    assert digest_algorithm_for(KVPool(GQA, 2)) == DIGEST_ALGORITHM == "xxh3_64"
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        page_digests(KVPool(GQA, 2), [0], "md5")
    with pytest.raises(ValueError, match="needs the page's layout"):
        bytes_digest(b"\0" * GQA.bytes_per_page, MLH_ALGORITHM)


def test_xxh3_of_a_device_pool_reads_the_pages_to_the_host_and_equals_the_in_place_digest() -> None:
    pool = fill(device_pool(DSA, 5), seed=2)
    assert page_digests(pool, [4, 1, 2], DIGEST_ALGORITHM) == page_digests(twin(pool), [4, 1, 2], DIGEST_ALGORITHM)


def test_every_single_bit_of_a_page_changes_its_digest() -> None:
    """One pool page per flipped bit of page 0 (every bit of every slice of a small page): all digests differ."""
    layout = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (1, 2)), KVBufferSpec("v", (1, 2))), 2, torch.float16)
    bits = layout.bytes_per_page * 8
    pool = fill(device_pool(layout, bits + 1), seed=3)
    base = pool.read_page(0)
    for b in range(bits):
        flipped = bytearray(base)
        flipped[b // 8] ^= 1 << (b % 8)
        pool.write_page(b + 1, flipped)
    pool.write_page(0, base)
    digests = page_digests_torch(pool, range(bits + 1))
    assert len(set(digests)) == bits + 1  # each flip changed it, and no two flips collide


def test_the_pages_a_faulty_handoff_produces_all_have_digests_of_their_own() -> None:
    """A page against what a fault leaves in its place: the other page (swap), another request's page (stale), the
    first half of it over stale bytes (half a page), its K and V slices exchanged, all zeros; at any position."""
    layout = GQA
    pool = fill(device_pool(layout, 8), seed=4)
    a, b = pool.read_page(0), pool.read_page(1)
    half = layout.bytes_per_page // 2
    k_bytes = layout.buffer_bytes_per_page(layout.buffers[0])
    swapped_kv = b""
    for off in range(0, layout.bytes_per_page, 2 * k_bytes):  # per layer: v then k
        swapped_kv += a[off + k_bytes : off + 2 * k_bytes] + a[off : off + k_bytes]
    variants = [b, a[:half] + b[half:], swapped_kv, bytes(layout.bytes_per_page), a[:-1] + bytes([a[-1] ^ 0x80])]
    for i, v in enumerate(variants, start=2):
        pool.write_page(i, v)
    pool.write_page(7, a)  # the same bytes in another pool page
    d = page_digests_torch(pool, range(8))  # page 1 holds b as well: left out below
    assert d[7] == d[0], "a digest depends on the bytes only, not on the pool page they sit in"
    assert d[2] == d[1]
    assert len({d[0], *d[2:7]}) == 6


def test_a_device_whose_float64_products_are_not_exact_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = device_digest._group_lanes

    def off_by_one(*args: object) -> torch.Tensor:
        return real(*args) + 1  # type: ignore[arg-type]

    monkeypatch.setattr(device_digest, "_group_lanes", off_by_one)
    device_digest.check_exact.cache_clear()
    try:
        with pytest.raises(KvfenceError, match="not exact on this device"):
            page_digests_torch(device_pool(GQA, 2), [0])
    finally:
        device_digest.check_exact.cache_clear()


@pytest.mark.parametrize("layout", [GQA, DSA], ids=["gqa", "dsa"])
def test_canaries_gathered_on_the_device_equal_the_host_gather_and_catch_a_changed_byte(layout: KVLayout) -> None:
    pool = fill(device_pool(layout, 5), seed=5)
    pages = [3, 1, 4]
    expected = compute_canaries(pool, pages, "req-a")
    assert expected == compute_canaries(twin(pool), pages, "req-a")
    assert check_canaries(pool, pages, "req-a", expected) == []
    assert compute_canaries(pool, pages, "req-b") != expected  # bound to the request
    hits = 0
    for off in range(layout.bytes_per_page):  # flip bytes one at a time until a sampled one is hit
        raw = bytearray(pool.read_page(1))
        raw[off] ^= 0xFF
        before = pool.read_page(1)
        pool.write_page(1, raw)
        bad = check_canaries(pool, pages, "req-a", expected)
        pool.write_page(1, before)
        if bad:
            assert bad == [1]
            hits += 1
    assert 0 < hits <= layout.num_layers * len(layout.buffers) * 8  # exactly the sampled bytes are watched


def _handoff(src: KVPool, dst: KVPool, tokens: int = 10) -> tuple:
    ids = list(range(100, 100 + tokens))
    src_pages, dst_pages = [5, 0, 3], [1, 4, 2]
    m = build_manifest("r1", "x1", ids, src, src_pages)
    cov = CoverageBitmap(3)
    for i, (s, d) in enumerate(zip(src_pages, dst_pages, strict=True)):
        dst.write_page(d, src.read_page(s))
        cov.mark(i)
    return m, Expectation("r1", tokens, token_hash(ids), cap("r1")), dst_pages, cov


@pytest.mark.parametrize(
    "prefill, decode", [("device", "device"), ("host", "device"), ("device", "host")], ids=lambda s: s
)
def test_verification_across_host_and_device_pools(prefill: str, decode: str) -> None:
    """Prefill digests with its pool's algorithm; decode verifies whichever the manifest names, where its pool
    lives; the record names it."""

    def make(kind: str, seed: int) -> KVPool:
        return fill(device_pool(DSA, 6) if kind == "device" else KVPool(DSA, 6), seed)

    src, dst = make(prefill, 1), make(decode, 2)
    m, exp, pages, cov = _handoff(src, dst)
    assert m.digest_algorithm == (MLH_ALGORITHM if prefill == "device" else DIGEST_ALGORITHM)
    r = verify_handoff(m, exp, DSA, pages, cov, dst)
    assert r.ok and r.digest_algorithm == m.digest_algorithm, r
    record = IntegrityRecord.from_result("r1", r, tokens_expected=10, pages=3, layout_fingerprint=DSA.fingerprint)
    assert record.digest_algorithm == m.digest_algorithm
    dst.tensors[1]["rope"].view(torch.uint8)[pages[2]].view(-1)[0] ^= 0x10  # one bit of the last page
    r = verify_handoff(m, exp, DSA, pages, cov, dst)
    assert not r.ok and r.reason == Reason.DIGEST_MISMATCH and "logical page 2" in r.detail, r


def test_a_manifest_naming_an_unknown_digest_algorithm_is_refused() -> None:
    src, dst = fill(device_pool(GQA, 6), 1), fill(device_pool(GQA, 6), 2)
    m, exp, pages, cov = _handoff(src, dst)
    r = verify_handoff(dataclasses.replace(m, digest_algorithm="crc32"), exp, GQA, pages, cov, dst)
    assert not r.ok and r.reason == Reason.LAYOUT_MISMATCH and "'crc32' is unknown" in r.detail


def test_device_pools_live_on_the_test_device() -> None:
    pool = device_pool(GQA, 2)
    assert pool.device.type == TEST_DEVICE.type and not pool.host_visible
    with pytest.raises(AssertionError, match="host-visible"):
        pool.page_memoryviews(0)
