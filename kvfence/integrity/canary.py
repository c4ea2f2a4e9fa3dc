"""Canaries: a few sampled bytes of every buffer slice of every page, bound to the request.

What it knows: for logical page i of request r, layer l and buffer b, a deterministic
set of `samples` byte offsets inside that page's slice of that buffer, derived only
from (r, i, l, b) by a splitmix64 mix, so prefill and decode pick the same bytes
without talking. The sampled bytes of all slices of a page are folded into one
xxh3_64 seeded by the request id: one 64-bit canary per page. A slice exists for
every (layer, buffer) of the layout, so MLA latent/rope and DSA indexer buffers get
canaries by construction, like K and V.

Because the seed is the request id, a canary copied from another request's manifest
does not match even when the page bytes happen to; and because the check gathers
only L*B*samples bytes per page, it is much cheaper than a full digest.

Where the pool lives does not change a canary: on a host-visible pool the bytes are gathered through
numpy views, on a device pool by one torch gather per slice on the device, and only the sampled bytes
(pages x slices x samples) come to the host to be hashed; both give the same canaries.

What it does not know: whether a mismatch should fail the request (`integrity.verify`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvfence.integrity.digest import PageBytes
from kvfence.kv.pool import KVPool

CANARY_SAMPLES = 8  # sampled bytes per (page, layer, buffer)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # x: uint64 array; wrapping arithmetic is what we want.
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def request_seed(request_id: str) -> int:
    return xxhash.xxh3_64_intdigest(request_id.encode())


def canary_offsets(
    request_id: str, slice_index: int, slice_bytes: int, num_pages: int, samples: int = CANARY_SAMPLES
) -> np.ndarray:
    """Byte offsets [num_pages, samples] into each logical page's slice `slice_index` (= layer * B + buffer)."""
    seed = np.uint64(request_seed(request_id))
    with np.errstate(over="ignore"):
        page = np.arange(num_pages, dtype=np.uint64)[:, None]  # [P, 1]
        k = np.arange(samples, dtype=np.uint64)[None, :]  # [1, K]
        x = seed ^ _splitmix64(np.uint64(slice_index) * np.uint64(1 << 32) + page * np.uint64(samples) + k)
    return (_splitmix64(x) % np.uint64(slice_bytes)).astype(np.int64)  # [P, K]


def _gather(pool: KVPool, pages: Sequence[int], request_id: str, samples: int) -> np.ndarray:
    """Sampled bytes [P, num_slices * samples] of `pages` (logical order) in `pool`."""
    if not pool.host_visible:
        return _gather_on_device(pool, pages, request_id, samples)
    rows = np.asarray(pages, dtype=np.int64)[:, None]  # [P, 1]
    cols: list[np.ndarray] = []
    for slice_index, flat in enumerate(PageBytes(pool).slices):  # flat: [num_pages, slice_bytes], layout order
        offs = canary_offsets(request_id, slice_index, flat.shape[1], len(rows), samples)  # [P, K]
        cols.append(flat[rows, offs])  # [P, K]
    return np.concatenate(cols, axis=1)  # [P, S * K]


def _gather_on_device(pool: KVPool, pages: Sequence[int], request_id: str, samples: int) -> np.ndarray:
    """`_gather` by torch ops where the pool lives; only the sampled bytes come back."""
    slices = pool.slice_offsets()  # (layer, buffer, offset, bytes), layout order
    offs = np.stack(
        [canary_offsets(request_id, s, nb, len(pages), samples) for s, (_, _, _, nb) in enumerate(slices)]
    )  # [S, P, K]
    device = pool.tensors[0][pool.layout.buffers[0].name].device
    cols_all = torch.as_tensor(offs, device=device)  # [S, P, K]: one upload for every slice
    rows = torch.as_tensor(list(pages), dtype=torch.long, device=device)[:, None]  # [P, 1]
    picked = [pool.page_rows(layer, name)[rows, cols_all[s]] for s, (layer, name, _, _) in enumerate(slices)]
    return torch.cat(picked, dim=1).cpu().numpy()  # [P, S * K]


def compute_canaries(pool: KVPool, pages: Sequence[int], request_id: str, samples: int = CANARY_SAMPLES) -> list[int]:
    """One canary per page of `pages` (position in `pages` = logical index)."""
    if len(pages) == 0:
        return []
    seed = request_seed(request_id)
    sampled = _gather(pool, pages, request_id, samples)  # [P, S * K]
    return [xxhash.xxh3_64_intdigest(row.tobytes(), seed=seed) for row in sampled]


def check_canaries(
    pool: KVPool, pages: Sequence[int], request_id: str, expected: Sequence[int], samples: int = CANARY_SAMPLES
) -> list[int]:
    """Logical indices whose canary differs from `expected` (empty list = all intact)."""
    assert len(pages) == len(expected), (len(pages), len(expected))
    got = compute_canaries(pool, pages, request_id, samples)
    return [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
