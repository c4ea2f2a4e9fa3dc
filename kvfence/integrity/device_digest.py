"""The page digest that torch computes wherever the pages live: `mlh62`, a multilinear hash in exact arithmetic.

What it knows: one definition of the digest of a page (all its (layer, buffer) slices, logical order) and two
implementations of it that must agree bit for bit:

* `page_digests_torch(pool, pages)`: torch ops on the pool's own device (CUDA, or a CPU pool standing in for one),
  reading the pool in place; only the P digests come back to the host, never the pages;
* `bytes_digest_mlh(data, layout)`: numpy over a page's raw bytes on the host, the reference the first is tested
  against (and the way to digest a page held outside a pool).

The definition. A slice of S bytes is read as S/2 little-endian signed 16-bit units u (every KV dtype is 2 or 4
bytes wide, so S is even), zero-padded to whole blocks of `BLOCK` units. For block j of slice s and inner lane
l in 0..3, `inner[s, j, l] = sum_i K[i, l] * u[j*BLOCK + i]` over the integers, with fixed pseudo-random keys
K < 2^24: every product is below 2^39 and every partial sum below 2^51, so float64 arithmetic is exact in any
summation order, and a float64 matrix product (cuBLAS on a GPU, BLAS on a CPU) gives the same integers everywhere.
Then, modulo the prime p = 2^31 - 1 and with fixed keys O < p, outer lane a in 0..1 is
`sum_{s, j, l} O[s, j, l, a] * (inner[s, j, l] mod p) mod p`, and the digest is `(lane0 << 31) | lane1` (62 bits).

Why it detects what a handoff can do to a page: for two different pages a fixed in advance (keys independent of
the data, as for any unkeyed hash), some unit differs by d with 0 < |d| < 2^16 < p; the inner lanes of its block
then differ modulo p except with probability <= 2^-24 each (four independent lanes), and given a difference the
two outer lanes collide with probability 1/p each: about 2^-62 in all, against 2^-64 for an ideal 64-bit hash.
Swapped pages, a stale page, half a page, one flipped bit: each is such a pair. Like xxh3 it is not a MAC: the
keys are public constants (the manifest's seal is what stops a stranger, docs/handoff.md "Trust model").

What it does not know: which pages belong to a request, or what a mismatch means (`integrity.verify`); when to
use it rather than xxh3_64 (`integrity.digest.digest_algorithm_for`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvfence.errors import KvfenceError
from kvfence.integrity.algorithms import MLH_ALGORITHM as MLH_ALGORITHM  # re-exported: named where torch is not needed
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool
from kvfence.math_utils import cdiv

BLOCK = 4096  # 16-bit units per inner block: |inner| < 2^15 * 2^24 * 2^12 = 2^51 < 2^53 (exact in float64)
PRIME = (1 << 31) - 1
INNER_LANES = 4
OUTER_LANES = 2
_KEY_BITS = 24
_TEMP_BYTES = 64 << 20  # float64 working set on the device (slices of one size x a group of pages)
_SEED = int.from_bytes(hashlib.sha256(b"kvfence mlh62 v1").digest()[:8], "little")

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 wrap-around is the definition
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _stream(tag: int, counters: np.ndarray) -> np.ndarray:
    """Pseudo-random uint64 for each counter of stream `tag` (the keys are these, reduced)."""
    with np.errstate(over="ignore"):
        return _splitmix64(np.uint64(_SEED ^ tag) ^ _splitmix64(counters.astype(np.uint64)))


@functools.lru_cache(maxsize=1)
def inner_keys() -> np.ndarray:
    """K: [BLOCK, INNER_LANES] int64, each < 2^24."""
    c = np.arange(BLOCK * INNER_LANES, dtype=np.uint64)
    return (_stream(1, c) >> np.uint64(64 - _KEY_BITS)).astype(np.int64).reshape(BLOCK, INNER_LANES)


def slice_units(layout: KVLayout) -> tuple[int, ...]:
    """16-bit units of each slice of a page, logical order (layer, buffer)."""
    units = []
    for _ in range(layout.num_layers):
        for spec in layout.buffers:
            nb = layout.buffer_bytes_per_page(spec)
            assert nb % 2 == 0, f"slice of {nb} bytes is not whole 16-bit units"
            units.append(nb // 2)
    return tuple(units)


def _blocks(units: int) -> int:
    return cdiv(units, BLOCK)


@functools.lru_cache(maxsize=16)
def outer_keys(units: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """O for each slice s: [blocks of s, INNER_LANES, OUTER_LANES] int64, each < p."""
    out = []
    for s, n in enumerate(units):
        j = np.arange(_blocks(n), dtype=np.uint64)[:, None, None]
        lane = np.arange(INNER_LANES, dtype=np.uint64)[None, :, None]
        a = np.arange(OUTER_LANES, dtype=np.uint64)[None, None, :]
        with np.errstate(over="ignore"):
            c = (np.uint64(s) << np.uint64(40)) | (j << np.uint64(8)) | (lane << np.uint64(1)) | a
        out.append((_stream(2, c) % np.uint64(PRIME)).astype(np.int64))
    return tuple(out)


def _combine(lanes: Sequence[int]) -> int:
    return (int(lanes[0]) << 31) | int(lanes[1])


# -- host reference ------------------------------------------------------------------------------------------


def bytes_digest_mlh(data: bytes | bytearray | memoryview, layout: KVLayout) -> int:
    """mlh62 of one page's bytes in logical order (numpy int64 arithmetic; the reference for the torch path)."""
    raw = memoryview(data).cast("B")
    if len(raw) != layout.bytes_per_page:
        raise ValueError(f"{len(raw)} bytes are not one page of {layout.bytes_per_page}")
    units = slice_units(layout)
    k = inner_keys()  # [BLOCK, 4]
    acc = np.zeros(OUTER_LANES, dtype=np.int64)
    off = 0
    for n, o in zip(units, outer_keys(units), strict=True):
        u = np.zeros(_blocks(n) * BLOCK, dtype=np.int64)
        u[:n] = np.frombuffer(raw[off : off + 2 * n], dtype="<i2")
        off += 2 * n
        inner = (u.reshape(-1, BLOCK) @ k) % PRIME  # [blocks, 4]: exact (< 2^51 before the reduction)
        acc = (acc + ((inner[:, :, None] * o) % PRIME).sum(axis=(0, 1))) % PRIME  # [2]
    return _combine(acc.tolist())


# -- torch, on the pool's device -----------------------------------------------------------------------------


class _SliceGroup(NamedTuple):
    """The slices of a layout that have one size: hashed together, a few kernels for all of them."""

    units: int
    members: tuple[tuple[int, str], ...]  # (layer, buffer) of each, in layout order
    outer: torch.Tensor  # [S, blocks, 4, 2] int64: their outer keys, on the device


class _DeviceKeys:
    """The keys of one layout on one device: inner keys as float64 [BLOCK, 4], outer keys by slice size."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        units = slice_units(layout)
        outer = outer_keys(units)
        self.inner = torch.as_tensor(inner_keys(), dtype=torch.float64, device=device)  # [BLOCK, 4]
        names = [(layer, spec.name) for layer in range(layout.num_layers) for spec in layout.buffers]
        self.groups = []
        for n in sorted(set(units)):
            ss = [s for s, u in enumerate(units) if u == n]
            stacked = torch.as_tensor(np.stack([outer[s] for s in ss]), device=device)  # [S, blocks, 4, 2]
            self.groups.append(_SliceGroup(n, tuple(names[s] for s in ss), stacked))


@functools.lru_cache(maxsize=16)
def _device_keys(layout: KVLayout, device: torch.device) -> _DeviceKeys:
    return _DeviceKeys(layout, device)


def _pool_device(pool: KVPool) -> torch.device:
    return pool.tensors[0][pool.layout.buffers[0].name].device  # with its index (torch.device("cuda") has none)


def page_digests_torch(pool: KVPool, pages: Sequence[int]) -> list[int]:
    """mlh62 of each page of `pages` (in order), computed by torch ops where the pool lives; P integers come back."""
    if len(pages) == 0:
        return []
    check_exact(_pool_device(pool))
    return _digests(pool, pages)


def _digests(pool: KVPool, pages: Sequence[int]) -> list[int]:
    device = _pool_device(pool)
    keys = _device_keys(pool.layout, device)
    idx = torch.as_tensor(list(pages), dtype=torch.long, device=device)  # [P]
    lanes = torch.zeros(len(pages), OUTER_LANES, dtype=torch.int64, device=device)  # [P, 2]
    for grp in keys.groups:
        rows = [pool.tensors[layer][name].view(torch.int16).reshape(pool.num_pages, grp.units) for layer, name in
                grp.members]  # fmt: skip
        per_page = len(rows) * _blocks(grp.units) * BLOCK * 8  # float64 bytes of one page's slices of this size
        group = max(1, _TEMP_BYTES // per_page)  # pages per working set
        for start in range(0, len(pages), group):
            lanes[start : start + group] += _group_lanes(rows, idx[start : start + group], grp, keys.inner)
            lanes.remainder_(PRIME)
    return [_combine(row) for row in lanes.tolist()]  # the one device -> host copy: P x 2 integers


def _group_lanes(
    rows: list[torch.Tensor], sel: torch.Tensor, grp: _SliceGroup, inner_keys_f64: torch.Tensor
) -> torch.Tensor:
    """Outer lanes [G, 2] of the slices of `grp` for the pages `sel` ([G]); rows: [N, U] int16 view of each slice."""
    n_s, g, nblk, units = len(rows), sel.numel(), _blocks(grp.units), grp.units
    u = torch.empty(n_s, g, units, dtype=torch.int16, device=sel.device)  # [S, G, U]
    for s, r in enumerate(rows):
        torch.index_select(r, 0, sel, out=u[s])
    if units % BLOCK:
        x = torch.zeros(n_s, g, nblk * BLOCK, dtype=torch.float64, device=sel.device)  # [S, G, nblk * BLOCK]
        x[:, :, :units] = u
    else:
        x = u.to(torch.float64)  # [S, G, U]
    inner = x.view(n_s * g * nblk, BLOCK) @ inner_keys_f64  # [S * G * nblk, 4]: integers below 2^51, so exact
    inner_i = inner.to(torch.int64).remainder_(PRIME).view(n_s, g, nblk, INNER_LANES, 1)  # [S, G, nblk, 4, 1]
    outer = grp.outer.view(n_s, 1, nblk, INNER_LANES, OUTER_LANES)  # [S, 1, nblk, 4, 2]
    return (inner_i * outer).remainder_(PRIME).sum(dim=(0, 2, 3))  # [G, 2], each < 2^31 * S * nblk * 4


@functools.lru_cache(maxsize=8)
def check_exact(device: torch.device) -> None:
    """Once per device: the torch path equals the numpy reference on pages with a slice of whole blocks, one of
    a part block, and units at their largest magnitude. A device whose float64 products are not exact (an
    emulated or reduced-precision mode) is refused rather than producing digests no other device reproduces."""
    from kvfence.kv.layout import KVBufferSpec  # only this check builds a layout of its own

    layout = KVLayout("mlh62-check", 1, (KVBufferSpec("a", (BLOCK,)), KVBufferSpec("b", (3,))), 2, torch.bfloat16)
    pool = KVPool(layout, 2, device=device, host_visible=False)
    g = torch.Generator().manual_seed(62)
    for t in pool.tensors[0].values():
        t.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, t.shape, generator=g, dtype=torch.int16))
    pool.tensors[0]["a"].view(torch.int16)[1].fill_(-(1 << 15))  # partial sums at their bound
    want = [bytes_digest_mlh(pool.read_page(p), layout) for p in range(2)]
    got = _digests(pool, [0, 1])
    if got != want:
        raise KvfenceError(
            f"mlh62 digests on {device} differ from the host reference ({got} != {want}): float64 matrix products "
            "are not exact on this device (emulated or reduced-precision float64?), so its pools cannot be verified"
        )
