"""Transparent huge pages for the buffers a decode step streams (models/heap.advise_huge_pages): the KV pool
is advised before its first write, so Linux backs it with 2 MiB pages where THP is "always" or "madvise"; the
bytes and the resident size are what torch.zeros gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.models.heap import advise_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(addr: int, nbytes: int) -> int:
    """AnonHugePages of this process's mappings that overlap [addr, addr + nbytes) (/proc/self/smaps; madvise
    splits a mapping at the advised range), in KiB."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_a_range_without_a_whole_aligned_huge_page_is_not_advised() -> None:
    assert not advise_huge_pages(4096, 4096)
    assert not advise_huge_pages((2 << 20) + 64, (2 << 20) - 128)


@pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages on this kernel"
)
def test_the_kv_pool_lives_in_huge_pages_and_is_zero() -> None:
    layout = KVLayout(
        "LlamaForCausalLM", 1, (KVBufferSpec("k", (4, 64)), KVBufferSpec("v", (4, 64))), 16, torch.float32
    )
    pool = KVPool(layout, 1024)  # 16 MiB a buffer
    k = pool.tensors[0]["k"]
    assert k.numel() * k.element_size() == 16 << 20
    assert _anon_huge_kib(k.data_ptr(), 16 << 20) >= 8 << 10  # at least half of it in 2 MiB pages
    assert not k.any() and not pool.tensors[0]["v"].any()
