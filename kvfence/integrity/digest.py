"""Digests of KV pages and of prompt token ids.

What it knows: how to hash the raw bytes of one page in the layout's logical order
(for layer, for buffer: the page's slice), streaming xxh3_64 over the zero-copy
views of `PageBytes` (the same bytes as `KVPool.page_memoryviews`), so every buffer a model keeps (K/V,
MLA latent + rope key, DSA indexer keys, ...) is covered by construction. Also the
one definition of the prompt token hash that the router computes and decode checks.

What it does not know: which pages belong to which request, or what a mismatch
means; `integrity.verify` decides that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvfence.kv.pool import KVPool

DIGEST_ALGORITHM = "xxh3_64"


class PageBytes:
    """Zero-copy byte views of a CPU pool's pages, in the layout's logical order.

    Same bytes and order as `KVPool.page_memoryviews(page)`, but the torch -> numpy
    conversion is done once per (layer, buffer) here instead of once per page and view
    (which costs ~10 us a view): one uint8 array [num_pages, slice_bytes] per slice, and
    a page's views are rows of those arrays.
    """

    def __init__(self, pool: KVPool) -> None:
        assert pool.device.type == "cpu", "raw byte views need a CPU pool; copy pages to host first"
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


def page_digests(pool: KVPool | PageBytes, pages: Sequence[int]) -> list[int]:
    """Digest of each page of `pages`, in the order given (the request's logical order)."""
    pb = pool if isinstance(pool, PageBytes) else PageBytes(pool)
    return [page_digest(pb, p) for p in pages]


def run_digest(pool: KVPool | PageBytes, pages: Sequence[int]) -> int:
    """One xxh3_64 over the bytes of a run of pages, in order (pages concatenated)."""
    pb = pool if isinstance(pool, PageBytes) else PageBytes(pool)
    h = xxhash.xxh3_64()
    for p in pages:
        for s in pb.slices:
            h.update(s[p])
    return h.intdigest()


def bytes_digest(data: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of a page's bytes held outside a pool (same value as `page_digest` for the same bytes)."""
    return xxhash.xxh3_64_intdigest(data)


def token_hash(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """The prompt token hash: xxh3_64 over the ids as little-endian int64, as 16 hex digits.

    Defined once here; the router computes it from its own tokenization and decode compares
    it with the manifest's, so prefill cannot vouch for its own prompt.
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8"))
    assert arr.ndim == 1, f"token ids must be 1-D, got shape {arr.shape}"
    return xxhash.xxh3_64_hexdigest(arr.tobytes())
