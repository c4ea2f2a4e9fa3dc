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
  quarantined until `disagg.handoff`'s quarantine deadline. Closing a `MooncakeSender` aborts its transfers
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
from kvfence.faults import FaultInjector, FaultPoint
from kvfence.integrity.digest import PageBytes
from kvfence.integrity.manifest import HandoffManifest
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import (
    Header,
    ReceiverCore,
    ReceiveSlot,
    SenderCore,
    SendHandle,
    SendStatus,
    SlotStatus,
    TransferConfig,
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
from kvfence.transfer.tcp import _Conn, _recv_exact

_SCHEME = "mooncake://"
_MAX_CONTROL_PAYLOAD = 256 << 20  # a manifest of ~10M pages; anything larger is a broken peer
_CLOSE_WAIT_S = 5.0  # MooncakeSender.close: how long aborted transfers get to send their last frame


def mooncake_unavailable_reason(hostname: str = "127.0.0.1", protocol: str = "tcp") -> str | None:
    """None when a Mooncake engine can run here; else why not (`mooncake_available`, cached per process)."""
    ok, reason = mooncake_available(hostname, protocol)
    return None if ok else reason


def parse_address(address: str) -> tuple[str, int]:
    """The (host, port) of the receiver's control listener in "mooncake://host:port"."""
    if not address.startswith(_SCHEME):
        raise ValueError(f"not a mooncake address: {address!r} (want mooncake://host:port)")
    host, _, port = address[len(_SCHEME) :].rpartition(":")
    return host.strip("[]"), int(port)


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


class MooncakeReceiver:
    """Decode's endpoint: its pool registered with Mooncake, a control listener, coverage from prefill's notices."""

    def __init__(
        self,
        pool: KVPool,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultInjector | None = None,
        hostname: str | None = None,
        protocol: str = "tcp",
    ) -> None:
        """`host`/`port`: the control listener; `hostname`: the address prefill's engine writes to (default host)."""
        self.endpoint = _open_endpoint(hostname or host, protocol)
        try:
            regions = self.endpoint.register_pool(pool)
            self._listener = socket.create_server((host, port))
        except BaseException:
            self.endpoint.close()
            raise
        self.core = ReceiverCore(pool, faults, one_sided=True)
        self.address = f"{_SCHEME}{host}:{self._listener.getsockname()[1]}"
        self._hello: Header = {
            "t": "hello",
            "session": self.endpoint.session_id,
            "bases": [[b.addr, b.page_nbytes] for b in pool_buffer_bases(pool)],
            "regions": [[r.addr, r.nbytes] for r in regions],
        }
        self._dest_sent: dict[_Conn, dict[str, bool]] = {}  # per connection: rid -> page table sent
        self._stale: dict[tuple[str, str, int], bytes] = {}  # stale_page fault: the bytes to put back
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self.closed = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvfence-mc-accept", daemon=True)
        self._accept_thread.start()

    # -- decode-side API (the `Receiver` protocol) -------------------------------------------------------------
    def expect(self, request_id: str, dest_pages: Sequence[int], transfer_id: str | None = None) -> ReceiveSlot:
        return self.core.expect(request_id, dest_pages, transfer_id)

    def abort(self, request_id: str, reason: str) -> None:
        self.core.abort(request_id, reason)

    def verdict(self, request_id: str, ok: bool, reason: str = "") -> None:
        self.core.verdict(request_id, ok, reason)

    def forget(self, request_id: str) -> None:
        self.core.forget(request_id)
        with self._lock:
            for key in [k for k in self._stale if k[0] == request_id]:
                del self._stale[key]

    # -- control connections -----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            with self._lock:
                self._conns.append(conn)
                self._dest_sent[conn] = {}
            t = threading.Thread(target=self._conn_loop, args=(conn,), name="kvfence-mc-recv", daemon=True)
            self._threads.append(t)
            t.start()

    def _conn_loop(self, conn: _Conn) -> None:
        try:
            conn.send(self._hello)
            while True:
                got = conn.read_frame_header()
                if got is None:
                    return
                header, plen = got
                if plen > _MAX_CONTROL_PAYLOAD:
                    raise ValueError(f"{header.get('t')!r} frame of {plen} bytes is too large")
                payload = _recv_exact(conn.sock, plen) if plen else b""
                kind = header.get("t")
                if kind == "pages":
                    self._on_pages(conn, header, plen)
                elif kind == "manifest":
                    self._on_manifest(conn, header, payload)
                else:
                    self.core.on_frame(conn, header, payload)
        except (ConnectionError, OSError, ValueError, KeyError, TypeError):
            return
        finally:
            conn.close()
            self._link_lost(conn)

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
            self.core.receive_page(rid, xid, i, nb, self._fill(rid, xid, i))
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

    def _link_lost(self, conn: _Conn) -> None:
        """A control connection closed. Slots whose page table it carried fail but stay unsettled (a write may
        still land); the others are settled like a closed TCP connection."""
        with self._lock:
            rids = self._dest_sent.pop(conn, {})
            if conn in self._conns:
                self._conns.remove(conn)
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

    def close(self) -> None:
        """Stop listening, drop every connection, wait for the threads, then unregister the pool."""
        if self.closed:
            return
        self.closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        self._accept_thread.join(timeout=5)
        for t in list(self._threads):
            t.join(timeout=5)
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


def _plan_faults(
    num_pages: int, rid: str, faults: FaultInjector | None
) -> tuple[list[int], list[int], dict[int, str], FaultPoint | None]:
    """(logical indices to send, whose bytes go under each index, damaged pages, late-write fault), as run_send."""
    order, source = list(range(num_pages)), list(range(num_pages))
    damage: dict[int, str] = {}
    if faults is None:
        return order, source, damage, None
    if (p := faults.point("drop_page", rid)) and p.page < num_pages and faults.hit("drop_page", rid):
        order.remove(p.page)
    if (p := faults.point("reorder_pages", rid)) and num_pages >= 2 and faults.hit("reorder_pages", rid):
        a = min(p.page, num_pages - 2)
        source[a], source[a + 1] = source[a + 1], source[a]
    for name in ("corrupt_byte", "short_write"):
        if (p := faults.point(name, rid)) and p.page < num_pages and faults.hit(name, rid):
            damage[p.page] = name
    return order, source, damage, faults.point("delayed_write_after_abort", rid)


class MooncakeSender:
    """Prefill's endpoint: its pool registered with Mooncake, one control connection per decode, a thread per
    transfer."""

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
        self.pool = pool
        self.config = config or TransferConfig()
        self.faults = faults
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
        self.core = SenderCore()
        self._conns: dict[str, _SenderConn] = {}
        self._readers: list[threading.Thread] = []
        self._live: list[MooncakeSendHandle] = []
        self._lock = threading.Lock()
        self.closed = False

    def _connect(self, address: str) -> _SenderConn:
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed:
                return conn
            sock = socket.create_connection(parse_address(address), timeout=self.config.connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _SenderConn(sock, self._writers)
            self._conns[address] = conn
            t = threading.Thread(target=self._reader, args=(conn,), name="kvfence-mc-acks", daemon=True)
            self._readers.append(t)
            t.start()
            return conn

    def _reader(self, conn: _SenderConn) -> None:
        try:
            while True:
                got = conn.read_frame_header()
                if got is None:
                    return
                header, plen = got
                if plen:
                    _recv_exact(conn.sock, plen)
                if header.get("t") == "hello":
                    conn.on_hello(header)
                else:
                    self.core.on_frame(header)
        except (ConnectionError, OSError, ValueError, KeyError, TypeError):
            return
        finally:
            conn.close()
            self.core.link_closed(conn.handles)

    def send(self, address: str, manifest: HandoffManifest, src_pages: Sequence[int]) -> SendHandle:
        handle = MooncakeSendHandle(manifest)
        self.core.add(handle)
        try:
            if self.closed:
                raise ConnectionError("this Mooncake sender is closed")
            conn = self._connect(address)
        except (OSError, ValueError) as e:
            handle._set(SendStatus.ERROR, f"cannot connect to decode at {address}: {e}")
            handle.sender_done = True
            return handle
        conn.handles = [h for h in conn.handles if not (h.finished and h.sender_done)] + [handle]
        with self._lock:
            self._live = [h for h in self._live if not h.sender_done] + [handle]
        threading.Thread(
            target=self._run_send,
            args=(conn, handle, list(src_pages)),
            name=f"kvfence-mc-send-{manifest.request_id}",
            daemon=True,
        ).start()
        return handle

    # -- one transfer ------------------------------------------------------------------------------------------
    def _run_send(self, conn: _SenderConn, handle: MooncakeSendHandle, src_pages: list[int]) -> None:
        """Manifest, wait for decode's page table, write chunk by chunk (each followed by its notice), last frame.
        Mirrors `transfer.base.run_send`: same bounds, same fault hooks, same last frames."""
        m, cfg, faults = handle.manifest, self.config, self.faults
        rid, xid = m.request_id, m.transfer_id
        bpp = self.pool.layout.bytes_per_page
        deadline = handle.started_at + cfg.send_timeout_s
        assert len(src_pages) >= m.num_pages, (len(src_pages), m.num_pages)
        order, source, damage, late = _plan_faults(m.num_pages, rid, faults)

        def stopping() -> bool:
            return (
                handle.local_abort is not None
                or (handle.remote_abort is not None and late is None)
                or handle.status == SendStatus.ERROR
            )

        try:
            conn.send({"t": "manifest", "rid": rid, "xid": xid}, [m.to_bytes()])
            if not conn.hello.wait(timeout=min(cfg.connect_timeout_s, max(0.0, deadline - time.monotonic()))):
                raise KvfenceError(f"decode's Mooncake receiver did not say hello within {cfg.connect_timeout_s}s")
            assert conn.peer is not None
            if [b.page_nbytes for b in conn.dst_bases] != [b.page_nbytes for b in self._src_bases]:
                raise KvfenceError("decode's pool has different buffers than prefill's; the layouts differ")
            with handle._cond:
                got = handle._cond.wait_for(
                    lambda: handle.dest_pages is not None or stopping() or handle.remote_abort is not None,
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if not got:
                    handle.status, handle.reason = SendStatus.ERROR, "no page table from decode before the deadline"
            if late is not None:  # the fault: hold the page writes until decode has aborted, then write anyway
                with handle._cond:
                    handle._cond.wait_for(lambda: handle.remote_abort is not None, timeout=cfg.send_timeout_s / 2)
            dest = handle.dest_pages or ()
            seq = 0
            for start in range(0, len(order), cfg.max_transfer_pages):
                if handle.dest_pages is None:
                    break  # stopped before decode sent its page table: nothing may be written
                chunk = order[start : start + cfg.max_transfer_pages]
                sizes = [bpp // 2 if damage.get(i) == "short_write" else bpp for i in chunk]
                nbytes = sum(sizes)
                with handle._cond:
                    ok = handle._cond.wait_for(
                        lambda nbytes=nbytes: (
                            stopping()
                            or handle.inflight_bytes == 0
                            or handle.inflight_bytes + nbytes <= cfg.max_inflight_bytes
                        ),
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                    if not ok:
                        handle.status, handle.reason = SendStatus.ERROR, f"send timed out after {cfg.send_timeout_s}s"
                    if stopping():
                        break
                    handle.inflight_bytes += nbytes
                    handle.max_inflight_seen = max(handle.max_inflight_seen, handle.inflight_bytes)
                if handle.remote_abort is not None and late is not None:
                    faults.hit("delayed_write_after_abort", rid)  # type: ignore[union-attr]
                    time.sleep(late.delay_s)  # keep writing after the abort, slowly
                self._write_chunk(conn, handle, chunk, [src_pages[source[i]] for i in chunk], dest, damage)
                conn.send({"t": "pages", "rid": rid, "xid": xid, "seq": seq, "idx": chunk, "nb": sizes})
                seq += 1
                handle.chunks_sent += 1
                handle.max_chunk_pages = max(handle.max_chunk_pages, len(chunk))
                handle.pages_sent += len(chunk)
                handle.bytes_sent += nbytes
            self._finish(conn, handle)
        except KvfenceError as e:  # a refused or failed Mooncake batch, or a peer we cannot write to
            handle._set(SendStatus.ERROR, str(e))
            try:
                conn.send({"t": "abort", "rid": rid, "xid": xid, "reason": str(e)})
            except OSError:
                pass
        except OSError as e:
            handle._set(SendStatus.ERROR, f"connection to decode failed: {e}")
        finally:
            with handle._cond:
                handle.sender_done = True
                handle.done_at = time.monotonic()
                handle._cond.notify_all()

    def _finish(self, conn: _SenderConn, handle: MooncakeSendHandle) -> None:
        rid, xid = handle.request_id, handle.transfer_id
        if handle.local_abort is not None:
            final: Header = {"t": "abort", "rid": rid, "xid": xid, "reason": handle.local_abort}
            handle._set(SendStatus.ABORTED, handle.local_abort)
        elif handle.remote_abort is not None:
            final = {"t": "aborted", "rid": rid, "xid": xid}
        elif handle.status == SendStatus.ERROR:
            final = {"t": "abort", "rid": rid, "xid": xid, "reason": handle.reason}
        else:
            final = {"t": "done", "rid": rid, "xid": xid, "pages": handle.pages_sent}
            with handle._cond:
                if handle.status == SendStatus.SENDING:
                    handle.status = SendStatus.AWAITING_VERDICT
                handle._cond.notify_all()
        conn.send(final)

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
        with self._lock:
            live = [h for h in self._live if not h.sender_done]
        for h in live:
            h.abort("prefill's Mooncake sender closed")
        end = time.monotonic() + _CLOSE_WAIT_S
        for h in live:
            h.wait_sender_done(timeout=max(0.0, end - time.monotonic()))
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        for t in self._readers:
            t.join(timeout=5)
        self.endpoint.close()
