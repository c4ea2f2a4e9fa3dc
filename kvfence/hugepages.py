"""Buffers in transparent huge pages, for the memory a decode step streams (the KV pool, the native panels).

What it knows: with THP in "madvise" mode (as on the CI and bench machines) Linux gives 2 MiB pages only to
private anonymous memory advised (MADV_HUGEPAGE) before its first write, and a buffer from torch's allocator
may reuse heap memory already written with 4 KiB pages. So `huge_empty` maps fresh memory of its own (private,
anonymous), advises the whole 2 MiB pages inside the buffer, and hands it to torch (`torch.frombuffer`, which
keeps the mapping alive as long as the tensor). A partial 2 MiB page at the end stays in small pages, so the
resident size is what a plain buffer's would be. What it does not know: other OSes or devices (a plain
`torch.empty` there), or whether the kernel actually granted huge pages (/proc/self/smaps says).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages are advised as huge pages (where Linux has
    MADV_HUGEPAGE and the buffer holds at least one), else a plain torch.empty."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mm)
    offset = -ctypes.addressof(view) % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
    del view  # the export ends here; the mapping itself lives on in the tensor
    try:
        mm.madvise(advise, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel built without THP: the mapping serves in small pages
        pass
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """huge_empty, zeroed (the first write: this is when the pages are faulted in)."""
    return huge_empty(shape, dtype).zero_()
