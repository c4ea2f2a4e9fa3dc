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


def windows(f: BinaryIO, chunk: int | None = None) -> Iterator[tuple[bytes, int]]:
    """(buffer, end): buffer[:end] is whole lines (the last may lack its newline at the end of the file)."""
    size = chunk or CHUNK_BYTES
    carry = b""
    while True:
        data = f.read(size)
        if not data:
            if carry:
                yield carry, len(carry)
            return
        buf = carry + data if carry else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            carry = buf
            continue
        yield buf, cut + 1
        carry = buf[cut + 1 :]


class LineCursor:
    """Line numbers of lines found, in file order, in successive windows of one file."""

    def __init__(self) -> None:
        self.buf = b""
        self.end = 0
        self.pos = 0  # where the next search starts in buf
        self.line = 0  # lines before buf[pos] (0-based line index of buf[pos])
        self.lines_before = 0  # lines before this window

    def window(self, buf: bytes, end: int) -> None:
        """Move to the next window (after the previous one was finished)."""
        self.lines_before = self.line + self.buf.count(b"\n", self.pos, self.end)
        self.buf, self.end, self.pos, self.line = buf, end, 0, self.lines_before

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
        self.line += buf.count(b"\n", self.pos, hit)
        self.pos = hit
        return self.line + 1
