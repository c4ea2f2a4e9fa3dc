"""Handing the heap's free pages back to the OS (glibc's malloc_trim), for every process of a deployment.

What it knows: where glibc's malloc_trim is (looked up once) and when freed memory stays resident without it:
freed chunks below glibc's mmap threshold stay in the heap, and the threshold rises after the first large free, so
weights freed after loading, a step's activations and a parsed tokenizer.json count as resident until trimmed.
Plain Python (ctypes), so the router and the launcher use it without torch. What it does not know: when to call
it (the loader after the weights have their final layout, the engine when it goes idle, the router once started).

On request (KVFENCE_BOUND_HEAP=1) it also fixes glibc's mmap and trim thresholds for an engine process
(`bound_step_heap`), so that a prefill's large activations are mapped and unmapped on their own instead of
staying in the heap after the step that freed them: the aggregated 100M preset's peak goes from 1.31-1.35x
llama-server's to 1.30-1.32x, but every fresh mapping is page faults, 14-17% of a prefill's time here, so it is
not the default (docs/benchmarks.md, "Aggregated peak memory"). A user's MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ (glibc's own tunables) win.
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
BOUND_ENV = "KVFENCE_BOUND_HEAP"  # "1": an engine fixes the thresholds above (off by default: see the docstring)


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


def bound_step_heap(
    mmap_threshold: int = ENGINE_MMAP_THRESHOLD, trim_threshold: int = ENGINE_TRIM_THRESHOLD
) -> HeapBounds | None:
    """Fix glibc's mmap and trim thresholds (mallopt) for this process when KVFENCE_BOUND_HEAP=1; None when not
    applied: not asked, not glibc, or the user set either threshold through glibc's environment tunables (which
    then stand).

    With both fixed, glibc stops raising them after a large free: a block of `mmap_threshold` bytes or more is
    its own mapping, unmapped when freed, and the heap's free top beyond `trim_threshold` goes back at once.
    """
    if os.environ.get(BOUND_ENV, "").strip() != "1" or any(os.environ.get(name) for name in _USER_TUNABLES):
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
