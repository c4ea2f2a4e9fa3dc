"""Digests of KV pages and of prompt token ids.

What it knows: the page digest algorithms a manifest may name (`DIGEST_ALGORITHMS`) and which one a pool uses
(`digest_algorithm_for`): every algorithm hashes the raw bytes of one page in the layout's logical order (for
layer, for buffer: the page's slice), so every buffer a model keeps (K/V, MLA latent + rope key, DSA indexer
keys, ...) is covered by construction.

* `xxh3_64` for a host-visible (CPU) pool: streaming xxh3_64 over the zero-copy views of `PageBytes` (the same
  bytes as `KVPool.page_memoryviews`), about 40 times faster on a CPU than the torch path below
  (docs/benchmarks.md, "Handoff cost").
* `mlh62` (`integrity.device_digest`) for a device pool: torch ops where the pages live, identical on every
  device; only the digests come back to the host.

Either side computes either algorithm for any pool (`page_digests(pool, pages, algorithm)`): decode verifies
with the algorithm its manifest names, so a CPU prefill and a GPU decode work together (at the cost of reading
the pages to the host for xxh3_64, one group at a time).

The prompt token hash that the router computes and decode checks is `integrity.token_hash` (torch-free, for
the router), re-exported here; the algorithm names are `integrity.algorithms`.

What it does not know: which pages belong to which request, or what a mismatch
means; `integrity.verify` decides that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvfence.integrity.algorithms import DIGEST_ALGORITHM, DIGEST_ALGORITHMS, MLH_ALGORITHM
from kvfence.integrity.device_digest import bytes_digest_mlh, page_digests_torch
from kvfence.integrity.token_hash import token_hash as token_hash  # re-exported: its home is torch-free
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool

_HOST_GROUP_BYTES = 64 << 20  # xxh3_64 of a device pool's pages: bytes read to the host at a time


def digest_algorithm_for(pool: KVPool) -> str:
    """The algorithm prefill digests `pool` with: xxh3_64 where its bytes are host-visible, else mlh62."""
    return DIGEST_ALGORITHM if pool.host_visible else MLH_ALGORITHM


class PageBytes:
    """Zero-copy byte views of a CPU pool's pages, in the layout's logical order.

    Same bytes and order as `KVPool.page_memoryviews(page)`, but the torch -> numpy
    conversion is done once per (layer, buffer) here instead of once per page and view
    (which costs ~10 us a view): one uint8 array [num_pages, slice_bytes] per slice, and
    a page's views are rows of those arrays.
    """

    def __init__(self, pool: KVPool) -> None:
        assert pool.host_visible, "raw byte views need a host-visible pool; device pools go through host staging"
        self.pool = pool
        self.slices: list[np.ndarray] = [  # each [num_pages, slice_bytes] uint8, sharing the pool's memory
            pool.tensors[layer][spec.name].view(torch.uint8).view(pool.num_pages, -1).numpy()
            for layer in range(pool.layout.num_layers)
            for spec in pool.layout.buffers
        ]

    def views(self, page: int) -> list[memoryview]:
        assert 0 <= page < self.pool.num_pages, (page, self.pool.num_pages)
        return [memoryview(s[page]) for s in self.slices]


def page_digest(pool: KVPool | PageBytes, page: int) -> int:
    """xxh3_64 over one page's bytes, layer by layer, buffer by buffer (layout order)."""
    pb = pool if isinstance(pool, PageBytes) else PageBytes(pool)
    h = xxhash.xxh3_64()
    for s in pb.slices:
        h.update(s[page])
    return h.intdigest()


def page_digests(pool: KVPool | PageBytes, pages: Sequence[int], algorithm: str = DIGEST_ALGORITHM) -> list[int]:
    """Digest of each page of `pages`, in the order given (the request's logical order), with `algorithm`."""
    if algorithm == MLH_ALGORITHM:
        return page_digests_torch(pool.pool if isinstance(pool, PageBytes) else pool, pages)
    if algorithm != DIGEST_ALGORITHM:
        raise ValueError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(DIGEST_ALGORITHMS)}")
    if isinstance(pool, KVPool) and not pool.host_visible:
        return _xxh3_read_to_host(pool, pages)
    pb = pool if isinstance(pool, PageBytes) else PageBytes(pool)
    return [page_digest(pb, p) for p in pages]


def _xxh3_read_to_host(pool: KVPool, pages: Sequence[int]) -> list[int]:
    """xxh3_64 of a device pool's pages: gathered page-major on the device, read to the host a group at a time."""
    bpp = pool.layout.bytes_per_page
    group = max(1, _HOST_GROUP_BYTES // bpp)
    out: list[int] = []
    for start in range(0, len(pages), group):
        sel = torch.as_tensor(list(pages[start : start + group]), dtype=torch.long, device=pool.device)  # [G]
        rows = pool.gather_pages(sel, torch.empty(sel.numel(), bpp, dtype=torch.uint8, device=pool.device))
        host = rows.cpu().numpy()  # [G, bytes_per_page]
        out.extend(xxhash.xxh3_64_intdigest(row) for row in host)
    return out


def run_digest(pool: KVPool | PageBytes, pages: Sequence[int]) -> int:
    """One xxh3_64 over the bytes of a run of pages, in order (pages concatenated)."""
    pb = pool if isinstance(pool, PageBytes) else PageBytes(pool)
    h = xxhash.xxh3_64()
    for p in pages:
        for s in pb.slices:
            h.update(s[p])
    return h.intdigest()


def bytes_digest(
    data: bytes | bytearray | memoryview, algorithm: str = DIGEST_ALGORITHM, layout: KVLayout | None = None
) -> int:
    """The digest of a page's bytes held outside a pool (same value as `page_digests` for the same bytes); mlh62
    needs the page's `layout` (it hashes slice by slice)."""
    if algorithm == MLH_ALGORITHM:
        if layout is None:
            raise ValueError("an mlh62 digest of raw bytes needs the page's layout")
        return bytes_digest_mlh(data, layout)
    if algorithm != DIGEST_ALGORITHM:
        raise ValueError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(DIGEST_ALGORITHMS)}")
    return xxhash.xxh3_64_intdigest(data)
