"""Handing the heap's free pages back to the OS (glibc's malloc_trim), for every process of a deployment.

What it knows: where glibc's malloc_trim is (looked up once) and when freed memory stays resident without it:
freed chunks below glibc's mmap threshold stay in the heap, and the threshold rises after the first large free, so
weights freed after loading, a step's activations and a parsed tokenizer.json count as resident until trimmed.
Plain Python (ctypes), so the router and the launcher use it without torch. What it does not know: when to call
it (the loader after the weights have their final layout, the engine when it goes idle, the router once started).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where the C library is not glibc (looked up once: find_library runs ldconfig)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


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
