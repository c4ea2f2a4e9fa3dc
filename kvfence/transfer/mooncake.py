"""Mooncake transport: page bytes written one-sided by the Mooncake Transfer Engine, control frames over TCP.

What it knows: how to run the protocol of `transfer.base` when the page bytes do not travel in `pages` frames
but are written by prefill straight into decode's registered pool (`transfer.mooncake_engine`). The control
link is a TCP connection with the framing of `transfer.tcp`; on it travel the frames of `transfer.base` plus two:

    receiver -> sender   hello   {session, bases[[addr, page_nbytes]], regions[[addr, nbytes]]}  first frame
    receiver -> sender   dest    {rid, xid, pages[]}   decode's page table, sent once decode accepted the manifest
    sender -> receiver   pages   {rid, xid, seq, idx[], nb[]}   no payload: these logical pages were written,
                                                                 nb[k] bytes each (a completion notice)

- Decode's `MooncakeReceiver` registers every (layer, buffer) tensor of its pool with its own Mooncake endpoint
  and says hello (its session id "host:rpc_port", the first byte and bytes per page of each tensor, the
  regions) to each prefill that connects. Addresses look like "mooncake://host:port" (the control listener).
- Prefill learns decode's page numbers for a request only in `dest`, after decode accepted that request's
  manifest, and only for the pages decode allocated. For each chunk of at most `max_transfer_pages` logical
  pages it writes every (layer, buffer) slice, merged and cut into batches below the engine's lane queue by
  `MooncakeEndpoint.write_pages` (entries, not pages, are counted), then sends the chunk's `pages` notice.
  `max_inflight_bytes` bounds the bytes written but not yet acknowledged, as over TCP.
- A write finished by the engine has landed: Mooncake's TCP protocol v2 acknowledges a WRITE only once the
  destination memory holds it (so `MC_TCP_PROTO=1`, the unacknowledged v1 framing, is refused), and a notice
  is sent only after its writes finished. The receiver marks coverage from notices through
  `ReceiverCore.receive_page`, exactly as the TCP receiver marks it from page frames.
- The receiver core is `one_sided=True`: once decode closed a slot, writes may still land until the sender's
  last frame (`done`/`abort`/`aborted`) arrives. A control connection that closes after `dest` went out does
  not settle the slot either (the sender may still be inside a write): the request fails and its pages stay
  quarantined, past any deadline, until the sender's writer is provably gone. The sender proves it: when its
  send thread ended without its last frame reaching decode, it reconnects and sends

      sender -> receiver   fenced  {rid, xid}   this transfer's writer has stopped: nothing more will land

  which settles the slot whatever connection it comes on. Closing a `MooncakeSender` aborts its transfers
  and waits for their last frames first, so a clean shutdown settles at once.
- Fault hooks sit where `transfer.base.run_send` and `ReceiverCore.receive_page` put them: drop_page,
  reorder_pages, corrupt_byte (the flipped page is written from a registered staging buffer), short_write
  (half a page is written and the notice says so) and delayed_write_after_abort on the sender; stale_page on
  the receiver (the page's previous bytes are put back when its notice arrives, then it is marked).

What it does not know: whether the landed pages are right (`integrity.verify`), what to do with an ending
(`disagg.handoff`), RDMA devices (protocol "rdma" is passed through to the engine untested).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.digest import PageBytes
from kvfence.integrity.manifest import HandoffManifest
from kvfence.kv.pool import KVPool
from kvfence.transfer import tcp
from kvfence.transfer.base import (
    Header,
    Payload,
    SenderLink,
    SendHandle,
    SendStatus,
    SlotStatus,
    TransferConfig,
    run_send,
)
from kvfence.transfer.mooncake_engine import (
    BufferBase,
    MooncakeEndpoint,
    Peer,
    Region,
    default_max_batch,
    lane_queue_limit,
    mooncake_available,
    package_missing_reason,
    page_ranges,
    pool_buffer_bases,
)
from kvfence.transfer.tcp import TcpReceiver, TcpSender, _Conn, _read_control_payload

_SCHEME = "mooncake://"
_CLOSE_WAIT_S = 5.0  # MooncakeSender.close: how long aborted transfers get to send their last frame


def mooncake_unavailable_reason(hostname: str = "127.0.0.1", protocol: str = "tcp") -> str | None:
    """None when a Mooncake engine can run here; else why not (`mooncake_available`, cached per process)."""
    ok, reason = mooncake_available(hostname, protocol)
    return None if ok else reason


def parse_address(address: str) -> tuple[str, int]:
    """The (host, port) of the receiver's control listener in "mooncake://host:port"."""
    return tcp.parse_address(address, _SCHEME)


def _open_endpoint(hostname: str, protocol: str) -> MooncakeEndpoint:
    """An engine on `hostname`, or a KvfenceError with the reason `mooncake_available` would give."""
    missing = package_missing_reason()
    if missing is not None:
        raise KvfenceError(f"Mooncake backend not available: {missing}")
    try:
        return MooncakeEndpoint(hostname, protocol)
    except KvfenceError as e:
        raise KvfenceError(f"Mooncake backend not available: {e}") from e


# -- receiver (decode) ----------------------------------------------------------------------------------------


class MooncakeReceiver(TcpReceiver):
    """Decode's endpoint: its pool registered with Mooncake, a control listener, coverage from prefill's notices.
    The listener, its connections and `close` are the TCP receiver's; the frames of a connection differ."""

    _scheme = _SCHEME
    _thread_name = "kvfence-mc"

    def __init__(
        self,
        pool: KVPool,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultInjector | None = None,
        hostname: str | None = None,
        protocol: str = "tcp",
        io_timeout_s: float = 10.0,
    ) -> None:
        """`host`/`port`: the control listener; `hostname`: the address prefill's engine writes to (default host)."""
        self.endpoint = _open_endpoint(hostname or host, protocol)
        self._dest_sent: dict[_Conn, dict[str, bool]] = {}  # per connection: rid -> page table sent
        self._stale: dict[tuple[str, str, int], bytes] = {}  # stale_page fault: the bytes to put back
        try:
            regions = self.endpoint.register_pool(pool)
            self._hello: Header = {
                "t": "hello",
                "session": self.endpoint.session_id,
                "bases": [[b.addr, b.page_nbytes] for b in pool_buffer_bases(pool)],
                "regions": [[r.addr, r.nbytes] for r in regions],
            }
            super().__init__(pool, host, port, faults, one_sided=True, io_timeout_s=io_timeout_s)  # starts accepting
        except BaseException:
            self.endpoint.close()
            raise

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        with self._lock:
            for key in [k for k in self._stale if k[0] == request_id]:
                del self._stale[key]

    # -- control connections -----------------------------------------------------------------------------------
    def _serve(self, conn: _Conn) -> None:
        conn.send(self._hello)
        while True:
            got = conn.read_frame_header()
            if got is None:
                return
            header, plen = got
            payload = _read_control_payload(conn, header, plen)
            kind = header.get("t")
            if kind == "pages":
                self._on_pages(conn, header, plen)
            elif kind == "manifest":
                self._on_manifest(conn, header, payload)
            else:
                self.core.on_frame(conn, header, payload)

    def _on_manifest(self, conn: _Conn, header: Header, payload: bytes | bytearray) -> None:
        rid, xid = str(header.get("rid")), str(header.get("xid"))
        slot = self.core.slot(rid)
        fresh = slot is not None and slot.manifest is None
        self.core.on_frame(conn, header, payload)  # replies error/abort itself when it refuses
        if slot is None or not fresh:
            return
        with slot.lock:
            if slot.link is not conn or slot.transfer_id != xid:
                return
            # a slot decode closed meanwhile still gets its table: its pages stay quarantined until our last frame
            accepted = slot.manifest is not None and slot.status == SlotStatus.RECEIVING
            dest = list(slot.dest_pages)
        with self._lock:
            self._dest_sent.setdefault(conn, {})[rid] = accepted
        if not accepted:
            return
        faults = self.core.faults
        p = faults.point("stale_page", rid) if faults is not None else None
        if p is not None and p.page < len(dest):  # what a previous request left there, put back on the notice
            self._stale[(rid, xid, p.page)] = self.core.pool.read_page(dest[p.page])
        conn.send({"t": "dest", "rid": rid, "xid": xid, "pages": dest})

    def _on_pages(self, conn: _Conn, header: Header, plen: int) -> None:
        rid, xid = str(header["rid"]), str(header["xid"])
        idx = [int(i) for i in header["idx"]]
        sizes = [int(nb) for nb in header["nb"]]
        bpp = self.core.pool.layout.bytes_per_page
        if plen or len(idx) != len(sizes) or any(not 0 <= nb <= bpp for nb in sizes):
            raise ValueError(f"malformed pages notice: {len(idx)} pages, sizes {sizes[:4]}..., payload {plen}")
        for i, nb in zip(idx, sizes, strict=True):
            self.core.receive_page(rid, xid, i, nb, self._fill(rid, xid, i), conn)
        conn.send({"t": "chunk_ack", "rid": rid, "xid": xid, "seq": header["seq"], "n": sum(sizes)})

    def _fill(self, rid: str, xid: str, index: int) -> Callable[[list[memoryview] | None, int], None]:
        def fill(views: list[memoryview] | None, nbytes: int) -> None:
            # The bytes already landed (one-sided). `views is None` means the receiver would not have written
            # them; only the stale_page fault can undo a landed write, by putting the old bytes back.
            if views is None:
                old = self._stale.pop((rid, xid, index), None)
                slot = self.core.slot(rid)
                if old is not None and slot is not None and 0 <= index < len(slot.dest_pages):
                    self.core.pool.write_page(slot.dest_pages[index], old)

        return fill

    def _conn_lost(self, conn: _Conn) -> None:
        """A control connection closed. Slots whose page table it carried fail but stay unsettled (a write may
        still land); the others are settled like a closed TCP connection."""
        with self._lock:
            rids = self._dest_sent.pop(conn, {})
        for rid, dest_sent in rids.items():
            slot = self.core.slot(rid)
            if slot is None or slot.link is not conn:
                continue
            with slot.lock:
                if not dest_sent:
                    slot.link_closed = True
                if slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                    slot.status = SlotStatus.ERROR
                    slot.error = "control connection to prefill closed before the transfer completed"
        self.core.changed()

    def close(self) -> None:
        """Stop listening, drop every connection, wait for the threads, then unregister the pool."""
        if self.closed:
            return
        super().close()
        self.endpoint.close()


# -- sender (prefill) -----------------------------------------------------------------------------------------


class MooncakeSendHandle(SendHandle):
    """A `SendHandle` that also receives decode's page table and counts Mooncake entries and batches."""

    def __init__(self, manifest: HandoffManifest) -> None:
        super().__init__(manifest)
        self.dest_pages: tuple[int, ...] | None = None  # decode's page table, from its `dest` frame
        self.entries = 0  # Mooncake batch entries after merging adjacent ranges
        self.batches = 0
        self.write_seconds = 0.0

    def on_frame(self, header: Header) -> None:
        if header.get("t") == "dest":
            with self._cond:
                self.dest_pages = tuple(int(p) for p in header.get("pages", ()))
                self._cond.notify_all()
            return
        super().on_frame(header)


class _SenderConn(_Conn):
    """The control connection to one decode receiver, with what its hello said."""

    def __init__(self, sock: socket.socket, writers: int) -> None:
        super().__init__(sock)
        self.hello = threading.Event()
        self.peer: Peer | None = None
        self.dst_bases: list[BufferBase] = []
        self.writers = threading.BoundedSemaphore(writers)  # concurrent write_pages calls to this peer

    def on_hello(self, header: Header) -> None:
        self.dst_bases = [BufferBase(int(a), int(n)) for a, n in header["bases"]]
        self.peer = Peer(str(header["session"]), tuple(Region(int(a), int(n)) for a, n in header["regions"]))
        self.hello.set()


class _OneSidedWrites:
    """The byte-moving step of one Mooncake transfer (`transfer.base.PageMover`): wait for decode's hello and page
    table, then write each chunk into decode's pages; its `pages` frame is a notice without payload."""

    def __init__(self, sender: MooncakeSender, conn: _SenderConn, handle: MooncakeSendHandle) -> None:
        self.sender, self.conn, self.handle = sender, conn, handle

    def prepare(self, deadline: float) -> None:
        cfg, conn, h = self.sender.config, self.conn, self.handle
        if not conn.hello.wait(timeout=min(cfg.connect_timeout_s, max(0.0, deadline - time.monotonic()))):
            raise KvfenceError(f"decode's Mooncake receiver did not say hello within {cfg.connect_timeout_s}s")
        assert conn.peer is not None
        if [b.page_nbytes for b in conn.dst_bases] != [b.page_nbytes for b in self.sender._src_bases]:
            raise KvfenceError("decode's pool has different buffers than prefill's; the layouts differ")
        with h._cond:
            got = h._cond.wait_for(
                lambda: (
                    h.dest_pages is not None
                    or h.local_abort is not None
                    or h.remote_abort is not None
                    or h.status == SendStatus.ERROR
                ),
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not got:
                h.status, h.reason = SendStatus.ERROR, "no page table from decode before the deadline"

    def can_move(self) -> bool:
        return self.handle.dest_pages is not None  # nothing may be written before decode sent its page table

    def move(self, chunk: list[int], srcs: list[int], damage: dict[int, str]) -> Payload:
        assert self.handle.dest_pages is not None
        self.sender._write_chunk(self.conn, self.handle, chunk, srcs, self.handle.dest_pages, damage)
        return ()


class MooncakeSender(TcpSender):
    """Prefill's endpoint: its pool registered with Mooncake, one control connection per decode, a thread per
    transfer. The control connections and their readers are the TCP sender's; the pages are written one-sided."""

    _scheme = _SCHEME
    _thread_name = "kvfence-mc-send"
    _reader_name = "kvfence-mc-acks"

    def __init__(
        self,
        pool: KVPool,
        config: TransferConfig | None = None,
        faults: FaultInjector | None = None,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> None:
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise KvfenceError(
                "Mooncake backend not available: MC_TCP_PROTO=1 selects Mooncake's unacknowledged TCP framing, "
                "where a finished write may not have landed yet; unset it"
            )
        super().__init__(pool, config, faults)
        self.endpoint = _open_endpoint(hostname, protocol)
        try:
            self.endpoint.register_pool(pool)
            self._staging = torch.zeros(pool.layout.bytes_per_page, dtype=torch.uint8)  # corrupt_byte's page
            self._staging_region = self.endpoint.register(self._staging)
        except BaseException:
            self.endpoint.close()
            raise
        self._staging_lock = threading.Lock()
        self._src_bases = pool_buffer_bases(pool)
        self._page_bytes = PageBytes(pool)
        self._writers = max(1, lane_queue_limit() // default_max_batch())
        self.closed = False

    def _new_conn(self, sock: socket.socket) -> _SenderConn:
        return _SenderConn(sock, self._writers)

    def _new_handle(self, manifest: HandoffManifest) -> SendHandle:
        return MooncakeSendHandle(manifest)

    def _connect(self, address: str) -> _Conn:
        if self.closed:
            raise ConnectionError("this Mooncake sender is closed")
        return super()._connect(address)

    def _on_reply(self, conn: _Conn, header: Header) -> None:
        if header.get("t") == "hello":
            assert isinstance(conn, _SenderConn)
            conn.on_hello(header)
        else:
            self.core.on_frame(header)

    # -- one transfer ------------------------------------------------------------------------------------------
    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        """`transfer.base.run_send` (same bounds, fault hooks and last frames) with one-sided page writes; when
        the last frame could not reach decode after it sent its page table, `_fence` tells it another way."""
        assert isinstance(link, _SenderConn) and isinstance(handle, MooncakeSendHandle)
        run_send(link, handle, self.pool, src_pages, self.config, self.faults, _OneSidedWrites(self, link, handle))
        if not handle.final_sent and handle.dest_pages is not None:
            self._fence(handle)

    def _fence(self, handle: MooncakeSendHandle) -> None:
        """Decode keeps the pages of a transfer it gave us a page table for quarantined until our last frame: a
        one-sided write may still land. Our send thread has ended, so no write of ours can come any more; say
        so with a `fenced` frame over a new control connection, retrying until it goes out or we close."""
        frame = {"t": "fenced", "rid": handle.request_id, "xid": handle.transfer_id}
        wait = 0.2
        while not self.closed:
            try:
                self._connect(handle.address).send(frame)
                handle.final_sent = True
                return
            except (OSError, ValueError):
                time.sleep(wait)
                wait = min(wait * 2, 5.0)

    def _write_chunk(
        self,
        conn: _SenderConn,
        handle: MooncakeSendHandle,
        chunk: list[int],
        srcs: list[int],
        dest: Sequence[int],
        damage: dict[int, str],
    ) -> None:
        """Write the chunk's pages into decode's pages (all (layer, buffer) slices); pages beyond decode's page
        table are not written (the notice reports them and the receiver counts them outside)."""
        assert conn.peer is not None
        plain_src, plain_dst, corrupt = [], [], []
        ranges: list[tuple[int, int, int]] = []
        for i, s in zip(chunk, srcs, strict=True):
            if i >= len(dest):
                continue
            kind = damage.get(i)
            if kind is None:
                plain_src.append(s)
                plain_dst.append(dest[i])
            elif kind == "short_write":  # the first half of the page, in logical (layer, buffer) order
                left = self.pool.layout.bytes_per_page // 2
                for sb, db in zip(self._src_bases, conn.dst_bases, strict=True):
                    n = min(sb.page_nbytes, left)
                    if n <= 0:
                        break
                    ranges.append((sb.addr + s * sb.page_nbytes, db.addr + dest[i] * db.page_nbytes, n))
                    left -= n
            else:
                corrupt.append((s, dest[i]))
        ranges += page_ranges(self._src_bases, conn.dst_bases, plain_src, plain_dst)
        with conn.writers:
            if ranges:
                self._account(handle, self.endpoint.write_pages(conn.peer, ranges))
            for s, d in corrupt:  # corrupt_byte: the page with one byte flipped, written from the staging page
                with self._staging_lock:
                    raw = np.frombuffer(b"".join(self._page_bytes.views(s)), dtype=np.uint8).copy()
                    raw[len(raw) // 2] ^= 0x5A
                    self._staging.numpy()[:] = raw
                    off, staged = self._staging_region.addr, []
                    for db in conn.dst_bases:
                        staged.append((off, db.addr + d * db.page_nbytes, db.page_nbytes))
                        off += db.page_nbytes
                    self._account(handle, self.endpoint.write_pages(conn.peer, staged))

    @staticmethod
    def _account(handle: MooncakeSendHandle, result: Any) -> None:
        handle.entries += result.entries
        handle.batches += result.batches
        handle.write_seconds += result.seconds

    def close(self) -> None:
        """Abort unfinished transfers and wait for their last frames (so decode's slots settle), then drop the
        connections and the engine."""
        if self.closed:
            return
        self.closed = True
        live = self.core.sending()
        for h in live:
            h.abort("prefill's Mooncake sender closed")
        end = time.monotonic() + _CLOSE_WAIT_S
        for h in live:
            h.wait_sender_done(timeout=max(0.0, end - time.monotonic()))
        super().close()
        self.endpoint.close()
