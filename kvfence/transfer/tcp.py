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
from collections.abc import Sequence

from kvfence.faults import FaultInjector
from kvfence.integrity.manifest import HandoffManifest
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import (
    Header,
    Payload,
    ReceiverCore,
    ReceiveSlot,
    SenderCore,
    SendHandle,
    SendStatus,
    TransferConfig,
    run_send,
)

_PREFIX = struct.Struct("<II")
_IOV_MAX = 512
_SCRATCH = 1 << 20
_MAX_CONTROL_PAYLOAD = 256 << 20  # a manifest of ~10M pages; anything larger is a broken peer


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"not a tcp address: {address!r} (want tcp://host:port)")
    host, _, port = address[6:].rpartition(":")
    return host.strip("[]"), int(port)


def _sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    bufs = [b for b in buffers if len(b)]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i : i + _IOV_MAX])
        while sent > 0:
            n = len(bufs[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("peer closed the connection mid-frame")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return buf


class _Conn:
    """One socket; `send` writes one whole frame under a lock (frames of concurrent transfers interleave)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._wlock = threading.Lock()
        self.closed = False
        self.handles: list[SendHandle] = []

    def send(self, header: Header, payload: Payload = ()) -> None:
        views = [memoryview(p).cast("B") for p in payload]
        hb = json.dumps(header, separators=(",", ":")).encode()
        prefix = _PREFIX.pack(len(hb), sum(len(v) for v in views))
        with self._wlock:
            if self.closed:
                raise ConnectionResetError("connection closed")
            _sendmsg_all(self.sock, [memoryview(prefix), memoryview(hb), *views])

    def read_frame_header(self) -> tuple[Header, int] | None:
        try:
            prefix = _recv_exact(self.sock, _PREFIX.size)
        except (ConnectionError, OSError):
            return None
        hlen, plen = _PREFIX.unpack(prefix)
        return json.loads(bytes(_recv_exact(self.sock, hlen))), plen

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpReceiver:
    """Decode's data-plane endpoint: listens, lands pages through `ReceiverCore`."""

    def __init__(
        self,
        pool: KVPool,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultInjector | None = None,
        one_sided: bool = False,
    ) -> None:
        self.core = ReceiverCore(pool, faults, one_sided)
        self._listener = socket.create_server((host, port))
        self.address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self.closed = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvfence-tcp-accept", daemon=True)
        self._accept_thread.start()

    def expect(self, request_id: str, dest_pages: Sequence[int], transfer_id: str | None = None) -> ReceiveSlot:
        return self.core.expect(request_id, dest_pages, transfer_id)

    def abort(self, request_id: str, reason: str) -> None:
        self.core.abort(request_id, reason)

    def verdict(self, request_id: str, ok: bool, reason: str = "") -> None:
        self.core.verdict(request_id, ok, reason)

    def forget(self, request_id: str) -> None:
        self.core.forget(request_id)

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.append(conn)
            t = threading.Thread(target=self._conn_loop, args=(conn,), name="kvfence-tcp-recv", daemon=True)
            self._threads.append(t)
            t.start()

    def _conn_loop(self, conn: _Conn) -> None:
        scratch = memoryview(bytearray(_SCRATCH))  # per connection: discarded bytes land here
        bpp = self.core.pool.layout.bytes_per_page

        def discard(n: int) -> None:
            while n > 0:
                k = min(n, len(scratch))
                _recv_exact_into(conn.sock, scratch[:k])
                n -= k

        def fill(views: list[memoryview] | None, nbytes: int) -> None:
            # scatter-read straight into the page's views: one syscall fills many of them
            bufs, left = [], nbytes
            for v in views or ():
                k = min(len(v), left)
                if k <= 0:
                    break
                bufs.append(v[:k])
                left -= k
            i = 0
            while i < len(bufs):
                got = conn.sock.recvmsg_into(bufs[i : i + _IOV_MAX])[0]
                if got == 0:
                    raise ConnectionResetError("peer closed the connection mid-frame")
                while got > 0:
                    n = len(bufs[i])
                    if got >= n:
                        got -= n
                        i += 1
                    else:
                        bufs[i] = bufs[i][got:]
                        got = 0
            discard(left)

        try:
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
                        self.core.receive_page(rid, xid, int(idx), int(nb), fill)
                    conn.send({"t": "chunk_ack", "rid": rid, "xid": xid, "seq": header["seq"], "n": plen})
                else:
                    if plen > _MAX_CONTROL_PAYLOAD:
                        raise ValueError(f"{header.get('t')!r} frame of {plen} bytes is too large")
                    payload = _recv_exact(conn.sock, plen) if plen else b""
                    self.core.on_frame(conn, header, payload)
        except (ConnectionError, OSError, ValueError):
            return
        finally:
            conn.close()
            self.core.link_closed(conn)

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
        for conn in list(self._conns):
            conn.close()
        self._accept_thread.join(timeout=5)
        for t in list(self._threads):
            t.join(timeout=5)


class TcpSender:
    """Prefill's data-plane client: one connection per decode address, transfers on threads."""

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, faults: FaultInjector | None = None) -> None:
        self.pool = pool
        self.config = config or TransferConfig()
        self.faults = faults
        self.core = SenderCore()
        self._conns: dict[str, _Conn] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _connect(self, address: str) -> _Conn:
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed:
                return conn
            sock = socket.create_connection(parse_address(address), timeout=self.config.connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns[address] = conn
            t = threading.Thread(target=self._reader, args=(conn,), name="kvfence-tcp-acks", daemon=True)
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
                self.core.on_frame(header)
        except (ConnectionError, OSError, ValueError):
            return
        finally:
            conn.close()
            self.core.link_closed(conn.handles)

    def send(self, address: str, manifest: HandoffManifest, src_pages: Sequence[int]) -> SendHandle:
        handle = SendHandle(manifest)
        self.core.add(handle)
        try:
            conn = self._connect(address)
        except (OSError, ValueError) as e:
            handle._set(SendStatus.ERROR, f"cannot connect to decode at {address}: {e}")
            handle.sender_done = True
            return handle
        conn.handles = [h for h in conn.handles if not (h.finished and h.sender_done)] + [handle]
        threading.Thread(
            target=run_send,
            args=(conn, handle, self.pool, list(src_pages), self.config, self.faults),
            name=f"kvfence-tcp-send-{manifest.request_id}",
            daemon=True,
        ).start()
        return handle

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        for t in self._readers:
            t.join(timeout=5)
