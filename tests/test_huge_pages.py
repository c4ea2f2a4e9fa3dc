"""Transparent huge pages for the buffers a decode step streams (kvfence.hugepages): the KV pool is mapped
fresh and advised before its first write, so Linux backs it with 2 MiB pages where THP is "always" or
"madvise", even in a process whose heap already holds freed, written memory; the bytes are torch.zeros'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.hugepages import HUGE_PAGE, huge_empty
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool

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


def test_a_buffer_below_one_huge_page_is_a_plain_tensor() -> None:
    t = huge_empty((HUGE_PAGE // 4 - 1,), torch.float32)
    assert t.shape == (HUGE_PAGE // 4 - 1,) and t.dtype == torch.float32
    assert t.untyped_storage().nbytes() == t.numel() * 4


@pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages on this kernel"
)
def test_the_kv_pool_lives_in_huge_pages_and_is_zero() -> None:
    layout = KVLayout(
        "LlamaForCausalLM", 1, (KVBufferSpec("k", (4, 64)), KVBufferSpec("v", (4, 64))), 16, torch.float32
    )
    junk = [torch.ones(4 << 20) for _ in range(8)]  # 16 MiB each, written, then freed: reusable heap memory
    del junk
    pool = KVPool(layout, 1024)  # 16 MiB a buffer
    k = pool.tensors[0]["k"]
    assert k.numel() * k.element_size() == 16 << 20
    assert _anon_huge_kib(k.data_ptr(), 16 << 20) >= 14 << 10  # its whole 2 MiB pages (7 or 8 of them)
    assert not k.any() and not pool.tensors[0]["v"].any()
