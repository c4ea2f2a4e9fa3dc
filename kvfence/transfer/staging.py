"""Host staging of a device pool's pages: how the bytes of a pool that is not host-visible reach a socket and back.

What it knows: how page bytes of a device pool (`KVPool.host_visible` False: CUDA, or a CPU pool standing in for a
device in tests) move between the pool and host buffers in the wire's order (pages back to back, each in the
layout's logical order), asynchronously, so a transport overlaps those copies with its socket I/O:

* `StagedPages` (prefill, a `transfer.base.PageMover`): a chunk's pages are gathered on the device and copied to a
  host buffer, and the frame is sent from there; the copy of chunk k+1 is started (`lookahead`) before chunk k is
  sent, into the other of two buffers, so the device-to-host copy of k+1 runs while k is on the wire.
* `PageLanding` (decode, one per connection): the pages of a chunk are read from the socket into a host buffer;
  `commit` starts one host-to-device copy of the chunk into its pool pages and the next chunk is read into the
  other buffer meanwhile. A page whose copy is in flight counts as a page write in progress (`ReceiveSlot.writing`)
  until the copy has finished, so its slot cannot settle, and `drain` (run before any other frame of the
  connection is applied: `done`, `abort`, ... and when the connection ends) waits for every copy, so decode never
  verifies or releases a page whose bytes are still on their way.
* `HostStaging`: the buffers, kept for reuse (pinned host memory and a device scratch when the pool is on CUDA and
  CUDA is available; plain host memory otherwise).

On CUDA a copy runs on a side stream that first waits for the work queued on the device's current stream (the
pages' KV), and is awaited through an event. Elsewhere a copy is deferred and runs when it is awaited, so the CPU
stand-in exercises the same rule as the GPU: bytes are in the destination only after `wait`.

What it does not know: frames, coverage or verification (`transfer.base`, `integrity.verify`); Mooncake (its
landing and staging areas are host memory registered with the engine, `transfer.mooncake`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from kvfence.kv.pool import KVPool

Payload = Sequence[bytes | bytearray | memoryview]  # the pieces of one frame's payload (as transfer.base)


class PageWriter(Protocol):
    """What a landing needs of a receive slot (`transfer.base.ReceiveSlot`): its lock and its count of page
    writes in progress."""

    lock: threading.Lock
    writing: int


LANDING_BYTES = 16 << 20  # a receiver's host buffer (and device scratch) per connection: at most this many bytes
_IDLE_SETS = 4  # buffer sets an idle `HostStaging` keeps for the next transfer


class CopyTicket:
    """One asynchronous copy; `wait` returns when its bytes are in the destination."""

    def __init__(self, event: torch.cuda.Event | None = None, run: Callable[[], None] | None = None) -> None:
        self._event, self._run = event, run

    def wait(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        if self._event is not None:
            self._event.synchronize()


class _BufferSet(NamedTuple):
    host: torch.Tensor  # [rows, bytes_per_page] uint8, pinned when the pool is on CUDA
    scratch: torch.Tensor | None  # [rows, bytes_per_page] uint8 on the pool's device (None: the pool is on the CPU)


class HostStaging:
    """Buffer sets of `rows` pages each for one pool, and the copies between them and the pool."""

    def __init__(self, pool: KVPool, rows: int) -> None:
        assert rows > 0, rows
        self.pool = pool
        self.rows = rows
        self.bpp = pool.layout.bytes_per_page
        self.device = pool.tensors[0][pool.layout.buffers[0].name].device
        self.cuda = self.device.type == "cuda"
        self.pinned = self.cuda and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._idle: list[_BufferSet] = []
        self._lock = threading.Lock()
        self.sets_made = 0  # buffer sets allocated so far (reuse keeps this low)

    def acquire(self) -> _BufferSet:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.sets_made += 1
        host = torch.empty(self.rows, self.bpp, dtype=torch.uint8, pin_memory=self.pinned)
        scratch = None
        if self.cuda:
            with torch.cuda.stream(self._stream):  # allocated for the side stream that uses it
                scratch = torch.empty(self.rows, self.bpp, dtype=torch.uint8, device=self.device)
        return _BufferSet(host, scratch)

    def release(self, buffers: _BufferSet) -> None:
        with self._lock:
            if len(self._idle) < _IDLE_SETS:
                self._idle.append(buffers)

    def to_host(self, pages: Sequence[int], buffers: _BufferSet) -> CopyTicket:
        """Start copying pool pages `pages` into rows 0.. of `buffers.host` (page-major, logical order)."""
        assert 0 < len(pages) <= self.rows, (len(pages), self.rows)
        n = len(pages)
        if self._stream is None:
            idx = torch.as_tensor(list(pages), dtype=torch.long)

            def run() -> None:
                self.pool.gather_pages(idx, buffers.host)

            return CopyTicket(run=run)
        assert buffers.scratch is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages' KV is written first
        with torch.cuda.stream(self._stream):
            idx = torch.as_tensor(list(pages), dtype=torch.long).to(self.device, non_blocking=True)  # [n]
            rows = self.pool.gather_pages(idx, buffers.scratch)  # [n, bpp] on the device
            buffers.host[:n].copy_(rows, non_blocking=self.pinned)
            event = torch.cuda.Event()
            event.record(self._stream)
        return CopyTicket(event=event)

    def to_device(self, rows: Sequence[int], pages: Sequence[int], buffers: _BufferSet) -> CopyTicket:
        """Start copying host rows `rows` of `buffers.host` into pool pages `pages` (row rows[i] -> pages[i])."""
        assert len(rows) == len(pages) > 0, (len(rows), len(pages))
        dest = torch.as_tensor(list(pages), dtype=torch.long)  # [n]
        dense = list(rows) == list(range(len(rows)))  # the usual case: every row of the chunk landed
        src_rows = torch.as_tensor(list(rows), dtype=torch.long)
        if self._stream is None:

            def run() -> None:
                data = buffers.host[: len(rows)] if dense else buffers.host.index_select(0, src_rows)
                self.pool.scatter_pages(dest, data)

            return CopyTicket(run=run)
        assert buffers.scratch is not None
        top = max(rows) + 1
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after anything queued on those pages
        with torch.cuda.stream(self._stream):
            buffers.scratch[:top].copy_(buffers.host[:top], non_blocking=self.pinned)  # [top, bpp]
            data = buffers.scratch[:top] if dense else buffers.scratch.index_select(0, src_rows.to(self.device))
            self.pool.scatter_pages(dest.to(self.device, non_blocking=True), data)
            event = torch.cuda.Event()
            event.record(self._stream)
        return CopyTicket(event=event)


# -- prefill -------------------------------------------------------------------------------------------------


class StagedPages:
    """The two-sided step (local, TCP) for a device pool: each chunk is sent from a host buffer it was copied into,
    and the copy of the next chunk runs while this one is sent (`transfer.base.PageMover`)."""

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging
        self.bpp = staging.bpp
        self._sets: list[_BufferSet] = []
        self._current = -1  # the set the chunk being sent was staged in
        self._ahead: tuple[tuple[int, ...], int, CopyTicket] | None = None  # (source pages, set, copy)
        self.lookaheads_used = 0  # chunks whose copy had started before they were asked for

    def prepare(self, deadline: float) -> None:
        pass

    def can_move(self) -> bool:
        return True

    def _free_set(self) -> int:
        while len(self._sets) < 2:
            self._sets.append(self.staging.acquire())
        return 1 - self._current if self._current >= 0 else 0

    def lookahead(self, chunk: list[int], srcs: list[int]) -> None:
        """Start copying the next chunk (sent after the current one) into the set not being sent from."""
        if self._ahead is not None or not srcs:
            return
        b = self._free_set()
        self._ahead = (tuple(srcs), b, self.staging.to_host(srcs, self._sets[b]))

    def move(self, chunk: list[int], srcs: list[int], damage: dict[int, str]) -> Payload:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == tuple(srcs):
            _, b, ticket = ahead
            self.lookaheads_used += 1
        else:
            if ahead is not None:
                ahead[2].wait()  # a lookahead for another chunk (the plan changed): let it finish, unused
            b = self._free_set()
            ticket = self.staging.to_host(srcs, self._sets[b])
        ticket.wait()
        self._current = b
        host = self._sets[b].host.numpy()  # [rows, bpp]; the frame is sent from here
        pieces: list[bytes | bytearray | memoryview] = []
        for k, i in enumerate(chunk):
            row = memoryview(host[k])
            if i not in damage:
                pieces.append(row)
            elif damage[i] == "corrupt_byte":
                raw = bytearray(row)
                raw[len(raw) // 2] ^= 0x5A
                pieces.append(raw)
            else:  # short_write
                pieces.append(bytearray(row[: self.bpp // 2]))
        return pieces

    def close(self) -> None:
        """The send thread has ended: wait for a copy still running, give the buffers back."""
        if self._ahead is not None:
            self._ahead[2].wait()
            self._ahead = None
        for s in self._sets:
            self.staging.release(s)
        self._sets = []


# -- decode --------------------------------------------------------------------------------------------------


class _Held(NamedTuple):
    row: int
    slot: PageWriter
    page: int


class PageLanding:
    """Where one connection's pages land on decode before they go to a device pool (see the module docstring).

    Used by one thread (the connection's reader). `reserve` hands out the next row of the current buffer (a chunk
    bigger than a buffer is split: the full buffer is committed and reading goes on in the other one); `hold`
    keeps a full page for the buffer's copy, holding its slot's page write open until the copy has finished."""

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging
        self._sets: list[_BufferSet] = []
        self._cur = 0
        self._next_row = 0
        self._held: list[_Held] = []
        self._inflight: list[tuple[CopyTicket, list[_Held]] | None] = [None, None]
        self.commits = 0

    def reserve(self) -> tuple[int, list[memoryview]]:
        """The next free row of the current buffer: its index and a view of its bytes (one page)."""
        if not self._sets:
            self._sets = [self.staging.acquire(), self.staging.acquire()]
        if self._next_row == self.staging.rows:
            self.commit()
        row = self._next_row
        self._next_row += 1
        return row, [self._sets[self._cur].host[row].numpy().data]

    def hold(self, row: int, slot: PageWriter, page: int) -> None:
        """Row `row` holds a whole page for pool page `page` of `slot`; its copy goes with the next commit. The
        caller counted the page write (`slot.writing`); it is released when the copy has finished."""
        self._held.append(_Held(row, slot, page))

    def write_prefix(self, row: int, page: int, nbytes: int) -> None:
        """A page that landed only in part: its first `nbytes` go to the pool page now (synchronously)."""
        self.staging.pool.write_page_prefix(page, self._sets[self._cur].host[row, :nbytes].numpy().tobytes())

    def commit(self) -> None:
        """Start the copy of the current buffer's held pages and continue in the other buffer (after waiting for
        the copy still running from it)."""
        if self._sets and self._held:
            held, self._held = self._held, []
            ticket = self.staging.to_device([h.row for h in held], [h.page for h in held], self._sets[self._cur])
            self._inflight[self._cur] = (ticket, held)
            self.commits += 1
        self._cur = 1 - self._cur
        self._next_row = 0
        self._finish(self._cur)

    def _finish(self, b: int) -> None:
        done, self._inflight[b] = self._inflight[b], None
        if done is None:
            return
        ticket, held = done
        try:
            ticket.wait()
        finally:
            for h in held:
                with h.slot.lock:
                    h.slot.writing -= 1

    def drain(self) -> None:
        """Every page read so far is in its pool page, and no copy of this connection is in flight."""
        if self._held:
            self.commit()
        for b in (0, 1):
            self._finish(b)

    def close(self) -> None:
        """The connection ended: drain, give the buffers back."""
        self.drain()
        for s in self._sets:
            self.staging.release(s)
        self._sets = []


def landing_rows(bytes_per_page: int) -> int:
    """Pages per landing buffer: as many as fit in `LANDING_BYTES`, 1 to 64."""
    return max(1, min(64, LANDING_BYTES // bytes_per_page))
