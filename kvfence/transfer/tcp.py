"""TCP transport: KV pages between real processes over plain sockets.

What it knows: the wire format and the socket plumbing for the frames of
`transfer.base`. A connection starts with the data plane's handshake (`auth.handshake`:
the sender proves it holds the cluster key, and the receiver proves it back) before the
receiver reads a frame or allocates anything for the peer; a peer that fails it is
dropped and counted as a security event. Every frame after that is

    u32 header_len | u32 payload_len | header (JSON, UTF-8) | tag (16 bytes) | payload (raw bytes)

(little-endian), where the header is a typed frame of `transfer.frames` (`frames.encode`) and
the tag is the frame's MAC over its place in the stream, its prefix and the header's bytes as
sent (`auth.handshake.FrameMac`). A header longer than `MAX_HEADER_BYTES` is refused before
it is read; its tag is checked before it is decoded; a header that does not decode into a
frame of its direction (`frames.decode_to_receiver` / `decode_to_sender`: not JSON, an
unknown kind, a missing or mistyped field), or whose tag fails, drops the connection (a
security event, never a traceback).
A `pages` frame's payload is its pages back to back, page k being
`nb[k]` bytes in the layout's logical order. The sender hands the pool's page
memoryviews straight to `sendmsg` (no copy on the way out); the receiver reads each
page with `recv_into` straight into the destination page's memoryviews (no copy on
the way in), under the slot lock of `ReceiverCore.receive_page`. A device pool goes through
host staging instead (`transfer.staging`): the sender sends each chunk from a host buffer
while the next chunk is copied off the device, the receiver reads a chunk into a host buffer
of its connection and copies it to the pool while it reads the next. A decode worker runs
one `TcpReceiver` (a listening socket, one thread per connection); a prefill worker
runs one `TcpSender` (one connection per decode address, one reader thread for
acks/verdicts, one thread per transfer). Addresses look like "tcp://host:port".

What it does not know: which pages to send or whether they are right; the handoff
state machine and `integrity.verify` decide that.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

from kvfence.auth import handshake
from kvfence.auth.events import SecurityEvent
from kvfence.auth.handshake import FrameMac, HandshakeError
from kvfence.auth.plane import PlaneAuth
from kvfence.faults import FaultInjector
from kvfence.kv.pool import KVPool
from kvfence.transfer import frames
from kvfence.transfer.base import (
    Payload,
    ReceiverBase,
    ReceiverCore,
    SenderBase,
    SenderCore,
    SenderLink,
    SendHandle,
    TransferConfig,
    run_send,
    sender_staging,
)
from kvfence.transfer.frames import ChunkAck, Frame, FrameError, Pages, ToSender
from kvfence.transfer.staging import PageLanding

logger = logging.getLogger(__name__)

_PREFIX = struct.Struct("<II")
_IOV_MAX = 512
_SCRATCH = 1 << 20
MAX_HEADER_BYTES = 16 << 10  # the largest frame header (a pages frame of 64 pages is ~1 KiB); refused before reading
_MAX_CONTROL_PAYLOAD = 256 << 20  # a manifest of ~10M pages; anything larger is a broken peer
_F = TypeVar("_F")  # the frame type a side decodes


class FrameRefused(ConnectionError):
    """A frame this side will not read (too large, MAC wrong, malformed): the connection is dropped and the event
    counted."""

    def __init__(self, event: SecurityEvent, detail: str) -> None:
        super().__init__(detail)
        self.event = event


def parse_address(address: str, scheme: str = "tcp://") -> tuple[str, int]:
    """(host, port) of "<scheme>host:port"."""
    if not address.startswith(scheme):
        raise ValueError(f"not a {scheme.removesuffix('://')} address: {address!r} (want {scheme}host:port)")
    host, _, port = address[len(scheme) :].rpartition(":")
    return host.strip("[]"), int(port)


def _through(io: Callable[[list[memoryview]], int], buffers: list[memoryview]) -> None:
    """Run every byte of `buffers` through `io` (sendmsg or recvmsg_into: at most _IOV_MAX buffers a call,
    returns how many bytes it moved)."""
    bufs = [b for b in buffers if len(b)]
    i = 0
    while i < len(bufs):
        moved = io(bufs[i : i + _IOV_MAX])
        if moved == 0:
            raise ConnectionResetError("peer closed the connection mid-frame")
        while moved > 0:
            n = len(bufs[i])
            if moved >= n:
                moved -= n
                i += 1
            else:
                bufs[i] = bufs[i][moved:]
                moved = 0


def _sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    _through(sock.sendmsg, buffers)


def _recvmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    _through(lambda bufs: sock.recvmsg_into(bufs)[0], buffers)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recvmsg_all(sock, [memoryview(buf)])
    return buf


class _Conn:
    """One authenticated socket; `send` writes one whole frame under a lock (frames of concurrent transfers
    interleave), each with its MAC (`mac`, from the handshake).

    The socket carries a timeout (`io_timeout_s`): a read or write that moves no byte for that long in the
    middle of a frame fails and the connection is dropped. Between frames a connection may idle as long as
    it likes (`read_frame_header` waits through timeouts until a frame starts)."""

    def __init__(self, sock: socket.socket, mac: FrameMac) -> None:
        self.sock = sock
        self.mac = mac
        self._wlock = threading.Lock()
        self.closed = False
        self.severed = False
        self.failure = ""  # why a send on this connection failed (the reader reports it, not "closed")
        self.handles: list[SendHandle] = []

    @property
    def peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return "?"

    def send(self, frame: Frame, payload: Payload = ()) -> None:
        views = [memoryview(p).cast("B") for p in payload]
        hb = frames.encode(frame)
        if len(hb) > MAX_HEADER_BYTES:  # our own bug, not the peer's: the peer would refuse it
            raise ValueError(f"{frame.kind!r} frame header of {len(hb)} bytes is over {MAX_HEADER_BYTES}")
        prefix = _PREFIX.pack(len(hb), sum(len(v) for v in views))
        with self._wlock:
            if self.closed or self.severed:
                raise ConnectionResetError("connection closed")
            tag = self.mac.sign(prefix, hb)
            try:
                _sendmsg_all(self.sock, [memoryview(prefix), memoryview(hb), memoryview(tag), *views])
            except OSError as e:
                self.failure = f"connection to decode failed: {e}"
                self.sever()  # part of a frame may have gone out: nothing after it could be parsed
                raise

    def read_frame_header(self) -> tuple[bytes, int] | None:
        """The next frame's header bytes and payload length, its MAC checked; None when the connection ended
        between frames. Raises FrameRefused for a header over the limit (before allocating it) or a MAC that
        fails. `read_frame` decodes them."""
        prefix = bytearray(_PREFIX.size)
        view = memoryview(prefix)
        while True:
            try:
                n = self.sock.recv_into(view)
            except TimeoutError:  # idle between frames: fine, unless we were told to stop
                if self.closed or self.severed:
                    return None
                continue
            except OSError:
                return None
            break
        if n == 0:
            return None
        if n < len(prefix):  # a frame has started: the rest must come within the timeout
            _recvmsg_all(self.sock, [view[n:]])
        hlen, plen = _PREFIX.unpack(prefix)
        if hlen > MAX_HEADER_BYTES:
            raise FrameRefused(
                SecurityEvent.HEADER_TOO_LARGE, f"frame header of {hlen} bytes (limit {MAX_HEADER_BYTES})"
            )
        hb = bytes(_recv_exact(self.sock, hlen))
        tag = bytes(_recv_exact(self.sock, handshake.FRAME_TAG_BYTES))
        if not self.mac.check(bytes(prefix), hb, tag):
            raise FrameRefused(
                SecurityEvent.FRAME_MAC_INVALID, "frame MAC does not verify (injected, altered or replayed)"
            )
        return hb, plen

    def read_frame(self, decode: Callable[[bytes], _F]) -> tuple[_F, int] | None:
        """The next frame, authenticated and decoded by `decode` (`frames.decode_to_receiver` on the receiver,
        `decode_to_sender` on the sender), and its payload length; None as `read_frame_header`. Raises FrameRefused
        as it does, and for a header that does not decode (a security event)."""
        got = self.read_frame_header()
        if got is None:
            return None
        try:
            return decode(got[0]), got[1]
        except FrameError as e:
            raise FrameRefused(SecurityEvent.FRAME_MALFORMED, str(e)) from None

    def sever(self) -> None:
        """Shut the socket down (from any thread): a read or write blocked on it fails at once. The thread
        that owns the connection closes it when it sees the failure."""
        self.severed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# a broken or closed connection: the connection is dropped (nothing to report)
_LINK_ERRORS = (ConnectionError, OSError)
# a frame an authenticated peer got wrong (missing or mistyped header fields): dropped and counted
_MALFORMED = (ValueError, KeyError, TypeError)


def report_refused(auth: PlaneAuth, conn: _Conn | None, peer: str, error: Exception) -> None:
    """Count and log why a data connection was dropped, when it is a security event (never a traceback)."""
    if isinstance(error, HandshakeError):
        auth.events.record(SecurityEvent.HANDSHAKE_FAILED, f"data connection from {peer}: {error}")
    elif isinstance(error, FrameRefused):
        auth.events.record(error.event, f"data connection {peer}: {error}")
    elif isinstance(error, _MALFORMED):
        auth.events.record(SecurityEvent.FRAME_MALFORMED, f"data connection {peer}: {type(error).__name__}: {error}")


class TcpReceiver(ReceiverBase):
    """Decode's data-plane endpoint: listens, authenticates each connection, lands pages through `ReceiverCore`.

    A subclass (the Mooncake receiver) reuses the listener, the handshake, one thread per connection and
    `close`, and supplies its own `_serve` (the frames of one connection) and `_conn_lost`."""

    _scheme = "tcp://"
    _thread_name = "kvfence-tcp"

    def __init__(
        self,
        pool: KVPool,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultInjector | None = None,
        one_sided: bool = False,
        io_timeout_s: float = 10.0,
        *,
        auth: PlaneAuth,
    ) -> None:
        assert io_timeout_s > 0, io_timeout_s
        self.auth = auth
        self.core = ReceiverCore(pool, auth, faults, one_sided)
        self.io_timeout_s = io_timeout_s
        self._listener = socket.create_server((host, port))
        self.address = f"{self._scheme}{host}:{self._listener.getsockname()[1]}"
        self._conns: list[_Conn] = []
        self._threads: set[threading.Thread] = set()
        self._pending = 0  # connections still in their handshake
        self._lock = threading.Lock()
        self.closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"{self._thread_name}-accept", daemon=True
        )
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                if self._pending >= self.auth.max_pending_handshakes:
                    full = True
                else:
                    full = False
                    self._pending += 1
            if full:  # a flood of connections that never authenticate must not cost a thread each
                self.auth.events.record(SecurityEvent.CONNECTION_LIMIT, f"refused {peer}: too many handshakes")
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.io_timeout_s)  # a sender stalled mid-frame is dropped, never waited on forever
            t = threading.Thread(
                target=self._conn_loop, args=(sock, peer), name=f"{self._thread_name}-recv", daemon=True
            )
            with self._lock:
                self._threads.add(t)
            t.start()

    def _conn_loop(self, sock: socket.socket, peer: str) -> None:
        conn: _Conn | None = None
        try:
            try:
                mac = handshake.accept(sock, self.auth.data_key, self.auth.handshake_timeout_s)
            finally:
                with self._lock:
                    self._pending -= 1
            conn = _Conn(sock, mac)
            with self._lock:
                if self.closed:
                    raise ConnectionAbortedError("receiver closed")
                self._conns.append(conn)
            self._serve(conn)
        except (HandshakeError, FrameRefused, *_MALFORMED) as e:
            report_refused(self.auth, conn, peer, e)
        except _LINK_ERRORS:
            pass
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
            if conn is None:
                try:
                    sock.close()
                except OSError:
                    pass
            else:
                conn.close()
                with self._lock:
                    if conn in self._conns:
                        self._conns.remove(conn)
                self._conn_lost(conn)

    def _conn_lost(self, conn: _Conn) -> None:
        self.core.link_closed(conn)

    def _serve(self, conn: _Conn) -> None:
        """Apply the frames of one connection until it closes (raises on a malformed frame)."""
        landing = self.core.landing()  # a device pool's pages land in host buffers first
        try:
            self._serve_frames(conn, landing)
        finally:
            if landing is not None:
                landing.close()  # every page read is in the pool before the connection counts as closed

    def _serve_frames(self, conn: _Conn, landing: PageLanding | None) -> None:
        scratch = memoryview(bytearray(_SCRATCH))  # per connection: discarded bytes land here
        bpp = self.core.pool.layout.bytes_per_page

        def fill(views: list[memoryview] | None, nbytes: int) -> None:
            # scatter-read straight into the page's views: one syscall fills many of them
            bufs, left = [], nbytes
            for v in views or ():
                k = min(len(v), left)
                if k <= 0:
                    break
                bufs.append(v[:k])
                left -= k
            _recvmsg_all(conn.sock, bufs)
            while left > 0:  # what has no destination
                k = min(left, len(scratch))
                _recvmsg_all(conn.sock, [scratch[:k]])
                left -= k

        while True:
            got = conn.read_frame(frames.decode_to_receiver)
            if got is None:
                return
            frame, plen = got
            if isinstance(frame, Pages):
                if sum(frame.nb) != plen or any(not 0 <= nb <= bpp for nb in frame.nb):
                    raise ValueError(f"malformed pages frame: sizes {frame.nb[:4]}..., payload {plen}")
                for idx, nb in zip(frame.idx, frame.nb, strict=True):
                    self.core.receive_page(frame.rid, frame.xid, idx, nb, fill, conn, landing)
                if landing is not None:
                    landing.commit()  # copied to the pool while the next chunk is read
                conn.send(ChunkAck(frame.rid, frame.xid, frame.seq, plen))
            else:
                payload = _read_control_payload(conn, frame, plen)
                if landing is not None:
                    landing.drain()  # `done` (or any other word) counts only once the pages are in the pool
                self.core.on_frame(conn, frame, payload)

    def close(self) -> None:
        """Stop listening, drop every connection (their slots settle) and wait for the threads to end."""
        if self.closed:
            return
        self.closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the accept thread
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        self._accept_thread.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)


def _read_control_payload(conn: _Conn, frame: Frame, plen: int) -> bytes | bytearray:
    if plen > _MAX_CONTROL_PAYLOAD:
        raise FrameRefused(SecurityEvent.PAYLOAD_TOO_LARGE, f"{frame.kind!r} frame of {plen} bytes is too large")
    return _recv_exact(conn.sock, plen) if plen else b""


class TcpSender(SenderBase):
    """Prefill's data-plane client: one connection per decode address, transfers on threads.

    A subclass (the Mooncake sender) reuses the connections, their reader threads and `close`, and supplies
    `_new_conn`, `_on_reply` and `_transfer`."""

    _scheme = "tcp://"
    _thread_name = "kvfence-tcp-send"
    _reader_name = "kvfence-tcp-acks"

    def __init__(
        self,
        pool: KVPool,
        config: TransferConfig | None = None,
        faults: FaultInjector | None = None,
        *,
        auth: PlaneAuth,
    ) -> None:
        self.pool = pool
        self.config = config or TransferConfig()
        self.faults = faults
        self.auth = auth
        self.core = SenderCore()
        self.staging = sender_staging(pool, self.config)  # host buffers for a device pool, reused across transfers
        self._conns: dict[str, _Conn] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()  # the tables above; never held across the network
        self._connecting: dict[str, threading.Lock] = {}  # one connect at a time per address
        self._failures: dict[str, tuple[int, str]] = {}  # address -> (connects to it that failed, the last one's why)
        self._shut = False  # close() ran: a connect that finishes later is dropped

    def _new_conn(self, sock: socket.socket, mac: FrameMac) -> _Conn:
        return _Conn(sock, mac)

    def _live(self, address: str) -> _Conn | None:
        with self._lock:
            conn = self._conns.get(address)
            return conn if conn is not None and not conn.closed and not conn.severed else None

    def _connect(self, address: str) -> _Conn:
        """The live connection to `address`, made (and authenticated) if there is none. Connecting waits for the
        network only under `address`'s own lock, so a decode host that does not answer (up to connect_timeout_s
        plus handshake_timeout_s) holds up the sends to it, never those to other decodes."""
        if (conn := self._live(address)) is not None:
            return conn
        with self._lock:
            connecting = self._connecting.setdefault(address, threading.Lock())
            failures_seen = self._failures.get(address, (0, ""))[0]
        with connecting:
            if (conn := self._live(address)) is not None:  # another thread connected while we waited
                return conn
            with self._lock:
                if self._shut:
                    raise ConnectionError("this sender is closed")
                failures, why = self._failures.get(address, (0, ""))
                if failures > failures_seen:  # a connect failed while we waited for it: do not wait again
                    raise ConnectionError(f"{why} (the connect just before this one)")
            try:
                conn = self._dial(address)
            except OSError as e:
                with self._lock:
                    self._failures[address] = (self._failures.get(address, (0, ""))[0] + 1, str(e))
                raise
            t = threading.Thread(target=self._reader, args=(conn,), name=self._reader_name, daemon=True)
            with self._lock:
                shut = self._shut
                if not shut:
                    self._conns[address] = conn
                    self._readers.append(t)
                    t.start()  # under the lock: close() never joins a thread not yet started
            if shut:
                conn.close()
                raise ConnectionError("this sender closed while connecting")
            return conn

    def _dial(self, address: str) -> _Conn:
        """A new authenticated connection to `address` (OSError, HandshakeError among them, when there is none)."""
        sock = socket.create_connection(parse_address(address, self._scheme), timeout=self.config.connect_timeout_s)
        try:
            mac = handshake.connect(sock, self.auth.data_key, self.auth.handshake_timeout_s)
        except HandshakeError as e:  # not our deployment's decode (or none at all): send it nothing
            sock.close()
            self.auth.events.record(SecurityEvent.HANDSHAKE_FAILED, f"receiver at {address}: {e}")
            raise
        except OSError:
            sock.close()
            raise
        sock.settimeout(self.config.io_timeout_s)  # a decode that stops reading fails the send, never hangs it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._new_conn(sock, mac)

    def _reader(self, conn: _Conn) -> None:
        try:
            while True:
                got = conn.read_frame(frames.decode_to_sender)
                if got is None:
                    return
                frame, plen = got
                if plen > _MAX_CONTROL_PAYLOAD:
                    raise FrameRefused(SecurityEvent.PAYLOAD_TOO_LARGE, f"reply payload of {plen} bytes")
                if plen:
                    _recv_exact(conn.sock, plen)
                self._on_reply(conn, frame)
        except (FrameRefused, *_MALFORMED) as e:
            report_refused(self.auth, conn, conn.peer, e)
        except _LINK_ERRORS:
            return
        finally:
            conn.close()
            self.core.link_closed(conn.handles, conn.failure)

    def _on_reply(self, conn: _Conn, frame: ToSender) -> None:
        self.core.on_frame(frame)

    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        run_send(
            link, handle, self.pool, src_pages, self.config, self.auth.manifest_key, self.faults, staging=self.staging
        )

    def close(self) -> None:
        with self._lock:
            self._shut = True
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        for t in self._readers:
            t.join(timeout=5)
