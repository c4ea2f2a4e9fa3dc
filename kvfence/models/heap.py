"""Handing the heap's free pages back to the OS (glibc's malloc_trim), for every process of a deployment.

What it knows: where glibc's malloc_trim is (looked up once) and when freed memory stays resident without it:
freed chunks below glibc's mmap threshold stay in the heap, and the threshold rises after the first large free, so
weights freed after loading, a step's activations and a parsed tokenizer.json count as resident until trimmed.
Plain Python (ctypes), so the router and the launcher use it without torch. What it does not know: when to call
it (the loader after the weights have their final layout, the engine when it goes idle, the router once started).

It also fixes glibc's mmap and trim thresholds for an engine process (`bound_step_heap`), so that a prefill's
large activations are mapped and unmapped on their own instead of staying in the heap after the step that freed
them, but only where torch's allocator asks for transparent huge pages (`ask_torch_for_huge_pages`, which the
CLI calls before torch loads): with 4 KiB pages every fresh mapping costs a page fault per page, 13-15% of a
prefill's time on the 100M preset, with huge pages 0-4% (docs/benchmarks.md, "Aggregated peak memory"). A user's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (glibc's own tunables) or THP_MEM_ALLOC_ENABLE win.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# An engine maps every block of at least this many bytes on its own (a prefill's [T, 2I] MLP output, the
# [T, E] residuals, a batch's logits), so freeing one returns its pages at once. glibc's default starts at
# 128 KiB and then follows the largest block freed (up to 32 MiB), after which a step's activations stay in
# the heap: 75-85 MiB of resident memory above the live ~50 MiB after a prefill of 1,024 rows (100M preset).
ENGINE_MMAP_THRESHOLD = 1 << 20
# ... and hands the top of the heap back once this much of it is free (glibc's default follows the threshold
# above to twice the largest block freed: up to 64 MiB kept).
ENGINE_TRIM_THRESHOLD = 2 << 20
_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
# torch's CPU allocator aligns a block of 2 MiB or more to 2 MiB and madvises it for transparent huge pages when
# this is on (c10's alloc_cpu; read once, at torch's first allocation)
TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


class HeapBounds(NamedTuple):
    """What `bound_step_heap` set: glibc's mmap and trim thresholds, in bytes."""

    mmap_threshold: int
    trim_threshold: int


@functools.cache
def _libc() -> Any:
    """glibc through ctypes, or None where the C library is not found (looked up once: find_library runs ldconfig)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def ask_torch_for_huge_pages() -> None:
    """Turn torch's transparent-huge-page allocation on (THP_MEM_ALLOC_ENABLE=1) unless the user set it.

    torch reads it once, at its first CPU allocation: call before torch is imported (the CLI does, for itself and
    every process it starts). A block of 2 MiB or more then faults in 2 MiB at a time where the kernel's
    transparent huge pages are on or on request (madvise); where they are "never" it changes nothing.
    """
    os.environ.setdefault(TORCH_THP_ENV, "1")


def torch_uses_huge_pages() -> bool:
    """Whether torch's allocator was told to ask for huge pages (the environment says so: torch reads it once, so a
    value set after its first allocation is believed too) and the kernel grants them (mode not "never")."""
    if os.environ.get(TORCH_THP_ENV, "").strip().lower() not in ("1", "on", "yes", "true", "y"):
        return False
    try:
        with open(_THP_MODE, encoding="ascii") as f:
            return "[never]" not in f.read()
    except OSError:  # no transparent huge pages in this kernel
        return False


def bound_step_heap(
    mmap_threshold: int = ENGINE_MMAP_THRESHOLD, trim_threshold: int = ENGINE_TRIM_THRESHOLD
) -> HeapBounds | None:
    """Fix glibc's mmap and trim thresholds (mallopt) for this process; None when not applied: not glibc, the
    user set either threshold through glibc's environment tunables (which then stand), or torch's blocks come
    in 4 KiB pages (`torch_uses_huge_pages`: then a fresh mapping per large block costs a prefill 13-15%).

    With both fixed, glibc stops raising them after a large free: a block of `mmap_threshold` bytes or more is
    its own mapping, unmapped when freed, and the heap's free top beyond `trim_threshold` goes back at once.
    """
    if any(os.environ.get(name) for name in _USER_TUNABLES) or not torch_uses_huge_pages():
        return None
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))):
        return None  # glibc refused a value (mallopt returns 0 on error)
    return HeapBounds(int(mmap_threshold), int(trim_threshold))


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where the C library is not glibc."""
    return getattr(_libc(), "malloc_trim", None)


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Weights freed after loading (the [out, in] originals once their panels exist, the file's float32 tensors
    after a bfloat16 cast) are mostly below glibc's mmap threshold, so their pages stay in the heap and
    count as resident until trimmed: about 100 MiB on the 100M preset. So do a step's activations once glibc has
    raised its threshold (it does after the first large free): the engine calls this when it goes idle.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
