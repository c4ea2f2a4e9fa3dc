"""Unmapping the shared libraries' start-up pages once an engine is built (madvise MADV_DONTNEED), so that an
engine process's resident set holds the code it runs, not the code it ran once while starting.

`import torch` runs libtorch's static initializers (the operator registry: ~45 MiB of libtorch_cpu.so's text read
once), and loading a model runs the loader's, safetensors' and the tokenizer's code once; those pages stay mapped,
and count in the process's RSS and PSS, for as long as it lives (docs/benchmarks.md, "The libraries' start-up
pages"). Dropping a private, read-only mapping of a file that holds no page of its own (no copy-on-write page:
smaps' `Anonymous: 0`) loses nothing: the pages stay in the page cache, and the few that run again come back on
their first touch as minor faults (no disk read while the page cache keeps them).

What it knows: /proc/self/smaps (each mapping's range, permissions, path, resident and anonymous kB) and
madvise through ctypes; plain Python, no torch. Only shared libraries (a path whose name holds `.so`) are
touched: never a writable mapping, never one with a copy-on-write page (a relocated page would revert to the
file's bytes), never a shared (`s`) mapping such as a worker's mapped weight panels, never anonymous memory.
Python's import lock is held while it runs, so no extension module is being dlopen-ed and relocated by another
thread's import meanwhile. What it does not know: which pages will run again (it drops them all; the hot ones
fault back at the first step), or anything but Linux (elsewhere it does nothing).
"""

from __future__ import annotations

import _imp
import functools
import os
from typing import Any, NamedTuple

MADV_DONTNEED = 4  # <sys/mman.h>, Linux
SMAPS = "/proc/self/smaps"
ENV = "KVFENCE_KEEP_STARTUP_PAGES"  # "1": keep them (for comparison)


class Mapping(NamedTuple):
    """One /proc/PID/smaps entry: its range, permissions (`r-xp`), path ('' when anonymous), Rss and Anonymous kB."""

    start: int
    end: int
    perms: str
    path: str
    rss_kib: int
    anonymous_kib: int


def read_smaps(path: str = SMAPS) -> list[Mapping]:
    """Every mapping of `path` (a /proc/PID/smaps file) with its resident and anonymous kB."""
    out: list[Mapping] = []
    head: list[str] | None = None
    fields: dict[str, int] = {}

    def close() -> None:
        if head is not None:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name = head[5] if len(head) > 5 else ""
            out.append(Mapping(lo, hi, head[1], name, fields.get("Rss", 0), fields.get("Anonymous", 0)))

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if parts[0].endswith(":"):
                if len(parts) >= 2 and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1])
                continue
            close()
            head, fields = parts, {}
    close()
    return out


def droppable(m: Mapping) -> bool:
    """A private, read-only mapping of a shared library, resident, with no page of its own (nothing to lose)."""
    name = os.path.basename(m.path)
    return (
        m.path.startswith("/")
        and ".so" in name
        and len(m.perms) == 4
        and m.perms[1] == "-"
        and m.perms[3] == "p"
        and m.anonymous_kib == 0
        and m.rss_kib > 0
    )


@functools.cache
def _madvise() -> Any:
    """libc's madvise through ctypes, or None where there is none (not Linux, or no C library found)."""
    import ctypes
    import sys

    from kvfence.models.heap import _libc  # the C library, looked up once for both modules

    libc = _libc() if sys.platform.startswith("linux") else None
    fn = None if libc is None else getattr(libc, "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def release_startup_pages() -> int:
    """Unmap the resident pages of every droppable library mapping; returns the kB that were resident in them
    (0 when nothing was done: KVFENCE_KEEP_STARTUP_PAGES=1, no madvise, or no /proc/self/smaps)."""
    if os.environ.get(ENV, "").strip() == "1":
        return 0
    madvise = _madvise()
    if madvise is None or not os.path.exists(SMAPS):
        return 0
    dropped = 0
    _imp.acquire_lock()  # no import (and so no dlopen and relocation of an extension) starts meanwhile
    try:
        for m in read_smaps():
            if droppable(m) and madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
                dropped += m.rss_kib
    finally:
        _imp.release_lock()
    return dropped
