"""Reading a log file in bounded windows of whole lines, and telling the line number of what was found in one.

What it knows: how to open a log (plain, or gzip when the name ends in .gz, as rotated logs are kept), read it in
windows of about CHUNK_BYTES that end on a line boundary (a line longer than that is carried into the next read
until it ends), so memory stays at a few windows whatever the file's size; and `LineCursor`, which gives the
1-based line number of a line found in a window by moving forward only: each window's newlines are counted once,
at memchr speed, between the lines asked for.
What it does not know: what the lines say (kvfence.audit.logs.formats).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import BinaryIO

from kvfence.errors import KvfenceError

CHUNK_BYTES = 4 << 20  # 4 MiB: the same throughput as larger windows (docs/benchmarks.md), a smaller peak


def open_log(path: str) -> BinaryIO:
    """The file, opened for reading; KvfenceError (one line) when it cannot be read."""
    try:
        if path.endswith(".gz"):
            gz = gzip.open(path, "rb")
            gz.peek(1)  # fail here, not mid-scan, on a file that is not gzip
            return gz  # type: ignore[return-value]
        return open(path, "rb")  # noqa: SIM115
    except (OSError, EOFError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise KvfenceError(f"cannot read log {path}: {why}") from e


def windows(f: BinaryIO, chunk: int | None = None) -> Iterator[tuple[bytearray, int]]:
    """(buffer, end): buffer[:end] is whole lines (the last may lack its newline at the end of the file).

    One buffer is reused for every window (read into with readinto: no allocation per window), so the caller must
    be done with a window before asking for the next; the rest of a line cut by a window moves to the front."""
    size = chunk or CHUNK_BYTES
    buf = bytearray(2 * size)
    fill = 0  # bytes of a cut line carried at the front of buf
    while True:
        if len(buf) - fill < size:  # a line longer than a window: grow until it ends
            buf.extend(bytes(size))
        n = f.readinto(memoryview(buf)[fill : fill + size])  # type: ignore[attr-defined]
        if not n:
            if fill:
                yield buf, fill
            return
        total = fill + n
        cut = buf.rfind(b"\n", fill, total)
        if cut < 0:
            fill = total
            continue
        yield buf, cut + 1
        fill = total - cut - 1
        buf[:fill] = buf[cut + 1 : total]


def count_newlines(buf: bytes | bytearray, start: int, end: int) -> int:
    """Newlines in buf[start:end]; numpy for long spans (about 4x bytes.count, which compares byte by byte)."""
    if end - start < 1 << 16:
        return buf.count(b"\n", start, end)
    import numpy as np  # here: its import (0.1 s) is paid only by logs with windows to count

    return int(np.count_nonzero(np.frombuffer(buf, np.uint8, count=end - start, offset=start) == 10))


class LineCursor:
    """Line numbers of lines found, in file order, in successive windows of one file."""

    def __init__(self) -> None:
        self.buf: bytes | bytearray = b""
        self.end = 0
        self.pos = 0  # where the next search starts in buf
        self.line = 0  # lines before buf[pos] (0-based line index of buf[pos])
        self.lines_before = 0  # lines before this window

    def window(self, buf: bytes | bytearray, end: int) -> None:
        """Start a window: buf[:end] holds the next lines of the file."""
        self.buf, self.end, self.pos, self.line = buf, end, 0, self.lines_before

    def finish(self) -> None:
        """End the window (before its buffer is reused): count the lines it held."""
        self.lines_before = self.line + count_newlines(self.buf, self.pos, self.end)
        self.buf, self.end, self.pos = b"", 0, 0

    def locate(self, needle: bytes) -> int | None:
        """1-based line of the next message that starts with `needle` (after a "] " prefix), from the cursor on."""
        buf, at = self.buf, self.pos
        while True:
            hit = buf.find(needle, at, self.end)
            if hit < 0:
                return None
            if hit >= 2 and buf[hit - 2 : hit] == b"] ":
                break
            at = hit + 1
        self.line += count_newlines(buf, self.pos, hit)
        self.pos = hit
        return self.line + 1
