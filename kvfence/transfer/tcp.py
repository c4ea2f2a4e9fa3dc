"""TCP transport: KV pages between real processes over plain sockets.

What it knows: the wire format and the socket plumbing for the frames of
`transfer.base`. Every frame is

    u32 header_len | u32 payload_len | header (JSON, UTF-8) | payload (raw bytes)

(little-endian). A `pages` frame's payload is its pages back to back, page k being
`nb[k]` bytes in the layout's logical order. The sender hands the pool's page
memoryviews straight to `sendmsg` (no copy on the way out); the receiver reads each
page with `recv_into` straight into the destination page's memoryviews (no copy on
the way in), under the slot lock of `ReceiverCore.receive_page`. A decode worker runs
one `TcpReceiver` (a listening socket, one thread per connection); a prefill worker
runs one `TcpSender` (one connection per decode address, one reader thread for
acks/verdicts, one thread per transfer). Addresses look like "tcp://host:port".

What it does not know: which pages to send or whether they are right; the handoff
state machine and `integrity.verify` decide that.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable

from kvfence.faults import FaultInjector
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import (
    Header,
    Payload,
    ReceiverBase,
    ReceiverCore,
    SenderBase,
    SenderCore,
    SenderLink,
    SendHandle,
    TransferConfig,
    run_send,
)

_PREFIX = struct.Struct("<II")
_IOV_MAX = 512
_SCRATCH = 1 << 20
_MAX_CONTROL_PAYLOAD = 256 << 20  # a manifest of ~10M pages; anything larger is a broken peer


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
    """One socket; `send` writes one whole frame under a lock (frames of concurrent transfers interleave).

    The socket carries a timeout (`io_timeout_s`): a read or write that moves no byte for that long in the
    middle of a frame fails and the connection is dropped. Between frames a connection may idle as long as
    it likes (`read_frame_header` waits through timeouts until a frame starts)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._wlock = threading.Lock()
        self.closed = False
        self.severed = False
        self.failure = ""  # why a send on this connection failed (the reader reports it, not "closed")
        self.handles: list[SendHandle] = []

    def send(self, header: Header, payload: Payload = ()) -> None:
        views = [memoryview(p).cast("B") for p in payload]
        hb = json.dumps(header, separators=(",", ":")).encode()
        prefix = _PREFIX.pack(len(hb), sum(len(v) for v in views))
        with self._wlock:
            if self.closed or self.severed:
                raise ConnectionResetError("connection closed")
            try:
                _sendmsg_all(self.sock, [memoryview(prefix), memoryview(hb), *views])
            except OSError as e:
                self.failure = f"connection to decode failed: {e}"
                self.sever()  # part of a frame may have gone out: nothing after it could be parsed
                raise

    def read_frame_header(self) -> tuple[Header, int] | None:
        """The next frame's header and payload length; None when the connection ended between frames."""
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
        return json.loads(bytes(_recv_exact(self.sock, hlen))), plen

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


# a broken or closed connection (or a peer sending malformed frames): the connection is dropped
_LINK_ERRORS = (ConnectionError, OSError, ValueError, KeyError, TypeError)


class TcpReceiver(ReceiverBase):
    """Decode's data-plane endpoint: listens, lands pages through `ReceiverCore`.

    A subclass (the Mooncake receiver) reuses the listener, one thread per connection and `close`, and
    supplies its own `_serve` (the frames of one connection) and `_conn_lost`."""

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
    ) -> None:
        assert io_timeout_s > 0, io_timeout_s
        self.core = ReceiverCore(pool, faults, one_sided)
        self.io_timeout_s = io_timeout_s
        self._listener = socket.create_server((host, port))
        self.address = f"{self._scheme}{host}:{self._listener.getsockname()[1]}"
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"{self._thread_name}-accept", daemon=True
        )
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.io_timeout_s)  # a sender stalled mid-frame is dropped, never waited on forever
            conn = _Conn(sock)
            with self._lock:
                self._conns.append(conn)
            t = threading.Thread(target=self._conn_loop, args=(conn,), name=f"{self._thread_name}-recv", daemon=True)
            self._threads.append(t)
            t.start()

    def _conn_loop(self, conn: _Conn) -> None:
        try:
            self._serve(conn)
        except _LINK_ERRORS:
            return
        finally:
            conn.close()
            with self._lock:
                self._conns.remove(conn)
            self._conn_lost(conn)

    def _conn_lost(self, conn: _Conn) -> None:
        self.core.link_closed(conn)

    def _serve(self, conn: _Conn) -> None:
        """Apply the frames of one connection until it closes (raises on a malformed frame)."""
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
            got = conn.read_frame_header()
            if got is None:
                return
            header, plen = got
            if header.get("t") == "pages":
                rid, xid = str(header["rid"]), str(header["xid"])
                sizes = [int(nb) for nb in header["nb"]]
                if sum(sizes) != plen or any(not 0 <= nb <= bpp for nb in sizes):
                    raise ValueError(f"malformed pages frame: sizes {sizes[:4]}..., payload {plen}")
                for idx, nb in zip(header["idx"], sizes, strict=True):
                    self.core.receive_page(rid, xid, int(idx), int(nb), fill, conn)
                conn.send({"t": "chunk_ack", "rid": rid, "xid": xid, "seq": header["seq"], "n": plen})
            else:
                self.core.on_frame(conn, header, _read_control_payload(conn, header, plen))

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
        for t in list(self._threads):
            t.join(timeout=5)


def _read_control_payload(conn: _Conn, header: Header, plen: int) -> bytes | bytearray:
    if plen > _MAX_CONTROL_PAYLOAD:
        raise ValueError(f"{header.get('t')!r} frame of {plen} bytes is too large")
    return _recv_exact(conn.sock, plen) if plen else b""


class TcpSender(SenderBase):
    """Prefill's data-plane client: one connection per decode address, transfers on threads.

    A subclass (the Mooncake sender) reuses the connections, their reader threads and `close`, and supplies
    `_new_conn`, `_on_reply` and `_transfer`."""

    _scheme = "tcp://"
    _thread_name = "kvfence-tcp-send"
    _reader_name = "kvfence-tcp-acks"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, faults: FaultInjector | None = None) -> None:
        self.pool = pool
        self.config = config or TransferConfig()
        self.faults = faults
        self.core = SenderCore()
        self._conns: dict[str, _Conn] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _new_conn(self, sock: socket.socket) -> _Conn:
        return _Conn(sock)

    def _connect(self, address: str) -> _Conn:
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed and not conn.severed:
                return conn
            sock = socket.create_connection(parse_address(address, self._scheme), timeout=self.config.connect_timeout_s)
            sock.settimeout(self.config.io_timeout_s)  # a decode that stops reading fails the send, never hangs it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._new_conn(sock)
            self._conns[address] = conn
            t = threading.Thread(target=self._reader, args=(conn,), name=self._reader_name, daemon=True)
            self._readers.append(t)
            t.start()
            return conn

    def _reader(self, conn: _Conn) -> None:
        try:
            while True:
                got = conn.read_frame_header()
                if got is None:
                    return
                header, plen = got
                if plen:
                    _recv_exact(conn.sock, plen)
                self._on_reply(conn, header)
        except _LINK_ERRORS:
            return
        finally:
            conn.close()
            self.core.link_closed(conn.handles, conn.failure)

    def _on_reply(self, conn: _Conn, header: Header) -> None:
        self.core.on_frame(header)

    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        run_send(link, handle, self.pool, src_pages, self.config, self.faults)

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        for t in self._readers:
            t.join(timeout=5)
