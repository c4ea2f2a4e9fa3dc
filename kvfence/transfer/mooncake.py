"""Mooncake transport: page bytes written one-sided by the Mooncake Transfer Engine, control frames over TCP.

What it knows: how to run the protocol of `transfer.base` when the page bytes do not travel in `pages` frames
but are written by prefill's Mooncake engine into memory decode's engine exposes (`transfer.mooncake_engine`).
The control link is a TCP connection of `transfer.tcp`, authenticated by its handshake before anything is said;
on it travel the frames of `transfer.base` plus two (all typed, `transfer.frames`):

    receiver -> sender   Hello   {session}                                   first frame, after the handshake
    receiver -> sender   Dest    {rid, xid, num_pages, bases[[addr, page_nbytes]], region[addr, nbytes]}
                                                  where this transfer may write, once decode accepted its manifest
    sender -> receiver   Pages   {rid, xid, seq, idx[], nb[]}   no payload: these logical pages were written,
                                                                 nb[k] bytes each (a completion notice)

Mooncake has no authentication of its own: any process that can reach an engine's RPC port may read and write
every buffer registered with it (checked here: a READ of a peer's registered memory succeeds; a write to memory
the peer did not register, or unregistered, is refused). So neither side ever registers its KV pool:

- Decode gives each accepted transfer a *landing area* of its own: the transfer's pages, every (layer, buffer)
  slice buffer-major in one block (`_PageArea`), registered only while that transfer may write. The block's
  address goes out in the transfer's `dest` frame, over the authenticated link, never in `hello`. On the
  sender's `done` decode unregisters the block (later writes are refused by the engine), copies it into the
  request's pool pages in its own receiver thread (counted as a page write, so the slot settles only after it),
  and only then lets verification read the pool: what decode verifies and attends over is memory no peer can
  write. A pool page of a verified request can never be written by any peer.
- Prefill copies each chunk's source pages into a staging area of the transfer (`_PageArea`, registered for the
  transfer's life, unregistered when its send thread ends) and writes from there: its pool is not readable
  through Mooncake either.
- A transfer that ends any other way has its pool pages settled at once (peers never write them). When decode
  aborts or fails it, its landing area stays registered until the sender's last frame (the sender stops at its
  next chunk; what it writes meanwhile lands in the area and is never copied), because a write the engine
  refuses can make it fail the next write to the same peer too, an innocent transfer's (seen here). When the
  control link breaks, the area is unregistered at once and its memory kept until the sender's writer has
  provably stopped (a `fenced` frame it sends over a new connection once its send thread has ended), because a
  write the engine accepted before may still be copying into it; a sender that never comes back keeps that
  memory, not pool pages (`landing_bytes_retained`).
- A device pool (CUDA, `KVPool.host_visible` False) changes nothing above: the areas are host memory either way
  (prefill gathers a chunk's pages on the device and copies them into its staging area; decode copies the landing
  area to the device after unregistering it). Which Mooncake build registers GPU memory: the non-CUDA wheel
  (`mooncake-transfer-engine-non-cuda`, `mooncake.engine.SUPPORT_CUDA` False) treats every address as host memory,
  so a GPU pointer must never reach it; the CUDA wheel (`mooncake-transfer-engine`) detects device memory and, over
  TCP, copies it through a host buffer per chunk, over RDMA registers it for GPUDirect. kvfence registers host
  areas only, with either wheel (docs/mooncake.md, "GPU memory").
- A write finished by the engine has landed: Mooncake's TCP protocol v2 acknowledges a WRITE only once the
  destination memory holds it (so `MC_TCP_PROTO=1`, the unacknowledged v1 framing, is refused), and a notice
  is sent only after its writes finished. The receiver marks coverage from notices through
  `ReceiverCore.receive_page`, as the TCP receiver marks it from page frames; the digests and canaries, checked
  on the pool after the copy, catch a notice that lies and anything else that wrote into the landing area.
- Fault hooks sit where `transfer.base.run_send` and `ReceiverCore.receive_page` put them: drop_page,
  reorder_pages, corrupt_byte (a byte of the staged copy flipped), short_write (half a page is written and the
  notice says so) and delayed_write_after_abort on the sender; stale_page on the receiver (the page is not
  copied from the landing area, so the pool page keeps what a previous request left there).

What it does not know: whether the landed pages are right (`integrity.verify`), what to do with an ending
(`disagg.handoff`), RDMA devices (protocol "rdma" is passed through to the engine untested).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvfence.auth.handshake import FrameMac
from kvfence.auth.plane import PlaneAuth
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.manifest import HandoffManifest
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer import frames, tcp
from kvfence.transfer.base import (
    Link,
    Payload,
    ReceiveSlot,
    SenderLink,
    SendHandle,
    SendStatus,
    SlotStatus,
    TransferConfig,
    run_send,
)
from kvfence.transfer.frames import Abort, Aborted, ChunkAck, Dest, Done, Fenced, Hello, Pages, ToSender
from kvfence.transfer.mooncake_engine import (
    BufferBase,
    MooncakeEndpoint,
    Peer,
    Region,
    default_max_batch,
    lane_queue_limit,
    mooncake_available,
    package_missing_reason,
)
from kvfence.transfer.tcp import TcpReceiver, TcpSender, _Conn, _read_control_payload

logger = logging.getLogger(__name__)

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


# -- a transfer's own pages ------------------------------------------------------------------------------------


class _PageArea:
    """One transfer's pages in one block registered with the local engine: slice k ((layer, buffer) in the
    layout's logical order) of page i is at `bases[k].addr + i * bases[k].page_nbytes`, so the block is laid out
    buffer-major and a chunk of consecutive pages is one range per slice. Peers reach this block, never a pool."""

    def __init__(self, layout: KVLayout, num_pages: int, endpoint: MooncakeEndpoint) -> None:
        assert num_pages > 0, num_pages
        self.num_pages = num_pages
        specs = [(layer, spec) for layer in range(layout.num_layers) for spec in layout.buffers]
        sizes = [layout.buffer_bytes_per_page(spec) for _, spec in specs]
        self.tensor = torch.empty(num_pages * sum(sizes), dtype=torch.uint8)
        base, off = self.tensor.data_ptr(), 0
        self.bases: list[BufferBase] = []
        self.views: list[tuple[int, str, torch.Tensor]] = []  # (layer, buffer, [num_pages, page_size, *shape])
        for (layer, spec), nb in zip(specs, sizes, strict=True):
            raw = self.tensor[off : off + num_pages * nb]
            self.views.append(
                (layer, spec.name, raw.view(layout.dtype).view(num_pages, layout.page_size, *spec.token_shape))
            )
            self.bases.append(BufferBase(base + off, nb))
            off += num_pages * nb
        self.nbytes = off
        self.endpoint = endpoint
        self.region: Region | None = endpoint.register(self.tensor)

    def unregister(self) -> None:
        """From now on the engine refuses every peer's write into (and read of) this block."""
        if self.region is not None:
            region, self.region = self.region, None
            try:
                self.endpoint.unregister(region)
            except KvfenceError:  # the endpoint closed first: it unregistered everything itself
                pass

    def fill_from(self, pool: KVPool, area_pages: Sequence[int], pool_pages: Sequence[int]) -> None:
        """Copy pool pages into this block: pool_pages[j] -> area page area_pages[j] (from a device pool: gathered
        on the device, one copy to the host per slice)."""
        dst = torch.as_tensor(list(area_pages), dtype=torch.long)
        src = torch.as_tensor(list(pool_pages), dtype=torch.long).to(pool.device)
        for layer, name, view in self.views:
            view[dst] = pool.tensors[layer][name].index_select(0, src).cpu()

    def copy_to(self, pool: KVPool, pool_pages: Sequence[int], skip: set[int]) -> None:
        """Copy area page i into pool page pool_pages[i], for every i not in `skip` (into a device pool: one copy
        to the device per slice; the block is host memory, unregistered before this runs)."""
        keep = [i for i in range(min(len(pool_pages), self.num_pages)) if i not in skip]
        if not keep:
            return
        src = torch.as_tensor(keep, dtype=torch.long)
        dst = torch.as_tensor([pool_pages[i] for i in keep], dtype=torch.long).to(pool.device)
        for layer, name, view in self.views:
            pool.tensors[layer][name].index_copy_(0, dst, view[src].to(pool.device))

    def flip_byte(self, page: int, offset: int) -> None:
        """Flip one byte of page `page` at `offset` in the page's logical byte order (the corrupt_byte fault)."""
        for base in self.bases:
            if offset < base.page_nbytes:
                i = base.addr - self.tensor.data_ptr() + page * base.page_nbytes + offset
                self.tensor[i] ^= 0x5A
                return
            offset -= base.page_nbytes
        raise ValueError("offset beyond the page")


class _Landing:
    """Decode's landing area for one transfer, and the control connection of the sender that may write into it."""

    def __init__(self, xid: str, area: _PageArea, conn: _Conn) -> None:
        self.xid, self.area, self.conn = xid, area, conn


# -- receiver (decode) ----------------------------------------------------------------------------------------


class MooncakeReceiver(TcpReceiver):
    """Decode's endpoint: a Mooncake engine with nothing registered but the landing areas of transfers in progress,
    a control listener, coverage from prefill's notices. The listener, its handshake, its connections and `close`
    are the TCP receiver's; the frames of a connection differ."""

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
        *,
        auth: PlaneAuth,
    ) -> None:
        """`host`/`port`: the control listener; `hostname`: the address prefill's engine writes to (default host)."""
        self.endpoint = _open_endpoint(hostname or host, protocol)
        self._landings: dict[str, _Landing] = {}  # rid -> the landing area of its transfer in progress
        self._retained: dict[tuple[str, str], _PageArea] = {}  # unregistered, a write may still be copying in
        self._stale: dict[tuple[str, str], set[int]] = {}  # stale_page fault: pages not copied into the pool
        self._hello = Hello(self.endpoint.session_id)
        try:
            # Two-sided as far as the pool goes: only this process writes pool pages (the landing copy).
            super().__init__(pool, host, port, faults, one_sided=False, io_timeout_s=io_timeout_s, auth=auth)
        except BaseException:
            self.endpoint.close()
            raise
        self.core.accepted = self._accepted

    @property
    def landing_bytes(self) -> int:
        """Landing memory held: transfers whose sender has not yet said its writer stopped."""
        with self._lock:
            return sum(x.area.nbytes for x in self._landings.values()) + sum(a.nbytes for a in self._retained.values())

    @property
    def landing_bytes_retained(self) -> int:
        """Landing memory kept after its control link broke, until its sender fences."""
        with self._lock:
            return sum(a.nbytes for a in self._retained.values())

    # -- decode-side verbs ---------------------------------------------------------------------------------------
    # Decode's abort, verdict and forget leave a live landing area registered: the sender may be writing into it
    # this moment, and a write the engine refuses can make the engine fail the next write to this peer too (seen
    # here), an innocent transfer's. Its bytes never reach the pool once the slot is closed; the area goes with
    # the sender's last frame, or its control link.
    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        with self._lock:
            for key in [k for k in self._stale if k[0] == request_id]:
                del self._stale[key]

    def _retire(self, rid: str) -> None:
        """No more writes into `rid`'s landing area; keep its memory until the sender's writer has stopped."""
        with self._lock:
            landing = self._landings.pop(rid, None)
            if landing is not None:
                self._retained[(rid, landing.xid)] = landing.area
        if landing is not None:
            landing.area.unregister()

    def _release(self, rid: str, xid: str) -> None:
        """The sender's writer for (rid, xid) has stopped: its landing memory can go."""
        with self._lock:
            landing = self._landings.get(rid)
            if landing is not None and landing.xid == xid:
                del self._landings[rid]
                landing.area.unregister()
            self._retained.pop((rid, xid), None)

    # -- control connections -----------------------------------------------------------------------------------
    def _serve(self, conn: _Conn) -> None:
        conn.send(self._hello)
        while True:
            got = conn.read_frame(frames.decode_to_receiver)
            if got is None:
                return
            frame, plen = got
            payload = _read_control_payload(conn, frame, plen)
            if isinstance(frame, Pages):
                self._on_pages(conn, frame, plen)
            elif isinstance(frame, Done):
                self._land(conn, frame.rid, frame.xid)
                self.core.on_frame(conn, frame, payload)
            else:
                self.core.on_frame(conn, frame, payload)
                if isinstance(frame, Abort | Aborted | Fenced):  # the sender's last word: its writer has stopped
                    self._release(frame.rid, frame.xid)

    def _accepted(self, link: Link, slot: ReceiveSlot) -> None:
        """The core accepted a manifest (when it came, or when decode reserved its request after a parked one): give
        the transfer a landing area of its own and tell the sender where it is."""
        conn = link
        assert isinstance(conn, _Conn), conn
        rid, xid, n = slot.request_id, slot.transfer_id, len(slot.dest_pages)
        area = _PageArea(self.core.pool.layout, n, self.endpoint)
        with self._lock:
            self._landings[rid] = _Landing(xid, area, conn)
        faults = self.core.faults
        p = faults.point("stale_page", rid) if faults is not None else None
        if p is not None and p.page < n and faults is not None and faults.hit("stale_page", rid) is not None:
            self._stale[(rid, xid)] = {p.page}  # what a previous request left in that pool page stays there
        assert area.region is not None
        conn.send(
            Dest(
                rid,
                xid,
                num_pages=n,
                bases=[(b.addr, b.page_nbytes) for b in area.bases],
                region=(area.region.addr, area.region.nbytes),
            )
        )

    def _on_pages(self, conn: _Conn, frame: Pages, plen: int) -> None:
        rid, xid, idx, sizes = frame.rid, frame.xid, frame.idx, frame.nb
        bpp = self.core.pool.layout.bytes_per_page
        if plen or any(not 0 <= nb <= bpp for nb in sizes):  # (idx and nb agree in length: `Pages` checks it)
            raise ValueError(f"malformed pages notice: {len(idx)} pages, sizes {sizes[:4]}..., payload {plen}")
        for i, nb in zip(idx, sizes, strict=True):
            self.core.receive_page(rid, xid, i, nb, _landed, conn, notice=True)  # the bytes are in the landing area
        conn.send(ChunkAck(rid, xid, frame.seq, sum(sizes)))

    def _land(self, conn: _Conn, rid: str, xid: str) -> None:
        """The sender's `done`: close the landing area to writers, then copy it into the request's pool pages
        before the slot may complete (verification reads the pool, which no peer can reach)."""
        with self._lock:
            landing = self._landings.get(rid)
            if landing is None or landing.xid != xid or landing.conn is not conn:
                return
            del self._landings[rid]
            skip = self._stale.pop((rid, xid), set())
        landing.area.unregister()
        slot = self.core.slot(rid)
        if slot is None:
            return
        with slot.lock:
            copying = slot.link is conn and slot.status == SlotStatus.RECEIVING and not slot.closed
            if copying:
                slot.writing += 1  # decode cannot settle (or verify) the slot while the copy runs
            dest = slot.dest_pages
        if not copying:
            return
        try:
            landing.area.copy_to(self.core.pool, dest, skip)
        finally:
            with slot.lock:
                slot.writing -= 1

    def _conn_lost(self, conn: _Conn) -> None:
        """A control connection closed: its transfers' landing areas close to writers and are kept until their
        senders fence (a write may still be copying in); the pool pages settle at once, as over TCP."""
        with self._lock:
            rids = [rid for rid, landing in self._landings.items() if landing.conn is conn]
        for rid in rids:
            self._retire(rid)
        retained = self.landing_bytes_retained
        if rids and retained:
            logger.warning(
                "decode: the control link of %d Mooncake transfer(s) broke; %d bytes of landing memory are kept "
                "until their senders say their writers stopped",
                len(rids),
                retained,
            )
        super()._conn_lost(conn)

    def close(self) -> None:
        """Stop listening, drop every connection, wait for the threads, then drop the engine."""
        if self.closed:
            return
        super().close()
        self.endpoint.close()


def _landed(views: list[memoryview] | None, nbytes: int) -> None:
    """The `fill` of a Mooncake notice: the bytes were written one-sided into the landing area already."""


# -- sender (prefill) -----------------------------------------------------------------------------------------


class _Dest(NamedTuple):
    """Where one transfer may write on decode (its `dest` frame)."""

    num_pages: int
    bases: list[BufferBase]
    region: Region


class MooncakeSendHandle(SendHandle):
    """A `SendHandle` that also receives where to write and counts Mooncake entries and batches."""

    def __init__(self, manifest: HandoffManifest) -> None:
        super().__init__(manifest)
        self.dest: _Dest | None = None  # decode's landing area for this transfer, from its `dest` frame
        self.entries = 0  # Mooncake batch entries after merging adjacent ranges
        self.batches = 0
        self.write_seconds = 0.0

    def on_frame(self, frame: ToSender) -> None:
        if isinstance(frame, Dest):
            dest = _Dest(frame.num_pages, [BufferBase(a, n) for a, n in frame.bases], Region(*frame.region))
            with self._cond:
                self.dest = dest
                self._cond.notify_all()
            return
        super().on_frame(frame)


class _SenderConn(_Conn):
    """The control connection to one decode receiver, with its engine's session id (from hello)."""

    def __init__(self, sock: socket.socket, mac: FrameMac, writers: int) -> None:
        super().__init__(sock, mac)
        self.hello = threading.Event()
        self.session = ""
        self.writers = threading.BoundedSemaphore(writers)  # concurrent write_pages calls to this peer

    def on_hello(self, hello: Hello) -> None:
        self.session = hello.session
        self.hello.set()


class _OneSidedWrites:
    """The byte-moving step of one Mooncake transfer (`transfer.base.PageMover`): wait for decode's hello and
    landing area, stage each chunk's pages in this transfer's own registered block, write them into the landing
    area; its `pages` frame is a notice without payload."""

    def __init__(self, sender: MooncakeSender, conn: _SenderConn, handle: MooncakeSendHandle) -> None:
        self.sender, self.conn, self.handle = sender, conn, handle
        self.staging: _PageArea | None = None

    def prepare(self, deadline: float) -> None:
        cfg, conn, h = self.sender.config, self.conn, self.handle
        if not conn.hello.wait(timeout=min(cfg.connect_timeout_s, max(0.0, deadline - time.monotonic()))):
            raise KvfenceError(f"decode's Mooncake receiver did not say hello within {cfg.connect_timeout_s}s")
        with h._cond:
            got = h._cond.wait_for(
                lambda: (
                    h.dest is not None or h.local_abort is not None or h.remote_abort is not None
                    or h.status == SendStatus.ERROR
                ),
                timeout=max(0.0, deadline - time.monotonic()),
            )  # fmt: skip
            if not got:
                h.status, h.reason = SendStatus.ERROR, "no landing area from decode before the deadline"
        if h.dest is None:
            return
        layout = self.sender.pool.layout
        ours = [layout.buffer_bytes_per_page(spec) for _ in range(layout.num_layers) for spec in layout.buffers]
        if [b.page_nbytes for b in h.dest.bases] != ours:
            raise KvfenceError("decode's landing area has different buffers than prefill's pool; the layouts differ")
        self.staging = _PageArea(layout, h.manifest.num_pages, self.sender.endpoint)

    def can_move(self) -> bool:
        return self.handle.dest is not None and self.staging is not None  # nothing is written before decode said where

    def lookahead(self, chunk: list[int], srcs: list[int]) -> None:
        pass  # each chunk is staged and written in `move` (one synchronous write per chunk)

    def move(self, chunk: list[int], srcs: list[int], damage: dict[int, str]) -> Payload:
        dest, staging = self.handle.dest, self.staging
        assert dest is not None and staging is not None
        staging.fill_from(self.sender.pool, chunk, srcs)
        ranges: list[tuple[int, int, int]] = []
        bpp = self.sender.pool.layout.bytes_per_page
        for i in chunk:
            if i >= dest.num_pages:  # beyond decode's allocation: not written (the notice reports it)
                continue
            left = bpp // 2 if damage.get(i) == "short_write" else bpp  # short_write: the first half, logical order
            if damage.get(i) == "corrupt_byte":
                staging.flip_byte(i, bpp // 2)
            for sb, db in zip(staging.bases, dest.bases, strict=True):
                n = min(sb.page_nbytes, left)
                if n <= 0:
                    break
                ranges.append((sb.addr + i * sb.page_nbytes, db.addr + i * db.page_nbytes, n))
                left -= n
        if ranges:
            peer = Peer(self.conn.session, (dest.region,))
            with self.conn.writers:
                self.sender._account(self.handle, self.sender.endpoint.write_pages(peer, ranges))
        return ()

    def close(self) -> None:
        """The send thread has ended: the staged copy is no longer readable by anyone."""
        if self.staging is not None:
            self.staging.unregister()
            self.staging = None


class MooncakeSender(TcpSender):
    """Prefill's endpoint: a Mooncake engine with nothing registered but the staging areas of transfers in
    progress, one control connection per decode, a thread per transfer. The control connections, their handshake
    and their readers are the TCP sender's; the pages are written one-sided."""

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
        *,
        auth: PlaneAuth,
    ) -> None:
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise KvfenceError(
                "Mooncake backend not available: MC_TCP_PROTO=1 selects Mooncake's unacknowledged TCP framing, "
                "where a finished write may not have landed yet; unset it"
            )
        super().__init__(pool, config, faults, auth=auth)
        self.endpoint = _open_endpoint(hostname, protocol)
        self._writers = max(1, lane_queue_limit() // default_max_batch())
        self.closed = False

    def _new_conn(self, sock: socket.socket, mac: FrameMac) -> _SenderConn:
        return _SenderConn(sock, mac, self._writers)

    def _new_handle(self, manifest: HandoffManifest) -> SendHandle:
        return MooncakeSendHandle(manifest)

    def _connect(self, address: str) -> _Conn:
        if self.closed:
            raise ConnectionError("this Mooncake sender is closed")
        return super()._connect(address)

    def _on_reply(self, conn: _Conn, frame: ToSender) -> None:
        if isinstance(frame, Hello):
            assert isinstance(conn, _SenderConn)
            conn.on_hello(frame)
        else:
            self.core.on_frame(frame)

    # -- one transfer ------------------------------------------------------------------------------------------
    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        """`transfer.base.run_send` (same bounds, fault hooks and last frames) with one-sided page writes; when
        the last frame could not reach decode after it gave us a landing area, `_fence` tells it another way."""
        assert isinstance(link, _SenderConn) and isinstance(handle, MooncakeSendHandle)
        mover = _OneSidedWrites(self, link, handle)
        try:
            run_send(link, handle, self.pool, src_pages, self.config, self.auth.manifest_key, self.faults, mover)
        finally:
            mover.close()
        if not handle.final_sent and handle.dest is not None:
            self._fence(handle)

    def _fence(self, handle: MooncakeSendHandle) -> None:
        """Decode keeps a landing area it gave us until our last frame: a one-sided write may still be copying
        in. Our send thread has ended, so no write of ours can come any more; say so with a `fenced` frame over a
        new control connection, retrying until it goes out or we close."""
        frame = Fenced(handle.request_id, handle.transfer_id)
        wait = 0.2
        while not self.closed:
            try:
                self._connect(handle.address).send(frame)
                handle.final_sent = True
                return
            except (OSError, ValueError):
                time.sleep(wait)
                wait = min(wait * 2, 5.0)

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
