"""In-process transport: prefill and decode in threads of one process, frames on queues.

What it knows: a `LocalFabric` (a name -> receiver table that the test or the process
owns; addresses look like "local:<name>"), a receiver with one worker thread that
applies frames through `ReceiverCore` exactly as the TCP receiver does, and a sender
that runs each transfer on its own thread through `run_send`. Page bytes are copied
once when a frame is sent (they are "in flight" from then on) and once into the
destination page.

There is no handshake (the threads share one process), but manifests are sealed and
checked with the cluster key exactly as over TCP, so every test of the protocol runs
the manifest authentication and the transfer-id capability; and every frame header goes
through the frames' codec (`transfer.frames`: encoded, then decoded for its direction), as
over TCP, so every test of the protocol runs the codec too.

What it does not know: sockets. It exists for fast tests of the protocol, the state
machine and every fault; `transfer.tcp` is the one for real processes.
"""

from __future__ import annotations

import queue
import threading

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
    fill_from_bytes,
    run_send,
    sender_staging,
)
from kvfence.transfer.frames import ChunkAck, Frame, Pages, ToReceiver
from kvfence.transfer.staging import PageLanding


class LocalFabric:
    """Where local receivers are found by address; one per test or process, never global."""

    def __init__(self) -> None:
        self._receivers: dict[str, LocalReceiver] = {}

    def register(self, name: str, receiver: LocalReceiver) -> str:
        assert name not in self._receivers, f"local receiver {name!r} exists"
        self._receivers[name] = receiver
        return f"local:{name}"

    def unregister(self, name: str) -> None:
        self._receivers.pop(name, None)

    def lookup(self, address: str) -> LocalReceiver:
        if not address.startswith("local:") or address[6:] not in self._receivers:
            raise ConnectionRefusedError(f"no local receiver at {address!r}")
        return self._receivers[address[6:]]


class _ReplyLink:
    """Receiver -> sender: hands the frame to the sender's handles on the caller's thread."""

    def __init__(self, core: SenderCore) -> None:
        self.core = core
        self.closed = False

    def send(self, frame: Frame, payload: Payload = ()) -> None:
        if self.closed:
            raise ConnectionResetError("local link closed")
        self.core.on_frame(frames.decode_to_sender(frames.encode(frame)))


class _Connection:
    """Sender -> receiver: frames go on the receiver's queue with a copy of their payload."""

    def __init__(self, receiver: LocalReceiver, sender_core: SenderCore) -> None:
        self.receiver = receiver
        self.reply = _ReplyLink(sender_core)
        self.closed = False
        self.handles: list[SendHandle] = []

    def send(self, frame: Frame, payload: Payload = ()) -> None:
        if self.closed or self.receiver.closed:
            raise ConnectionResetError("local link closed")
        data = b"".join(payload)  # the bytes are in flight from here on
        self.receiver._queue.put((self.reply, frames.decode_to_receiver(frames.encode(frame)), data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.receiver._queue.put((self.reply, None, b""))  # no frame: the link closed


class LocalReceiver(ReceiverBase):
    def __init__(
        self,
        fabric: LocalFabric,
        name: str,
        pool: KVPool,
        faults: FaultInjector | None = None,
        one_sided: bool = False,
        *,
        auth: PlaneAuth,
    ) -> None:
        self.core = ReceiverCore(pool, auth, faults, one_sided)
        self.closed = False
        # (the reply link, the frame or None when the link closed, its payload); None stops the thread
        self._queue: queue.Queue[tuple[_ReplyLink, ToReceiver | None, bytes] | None] = queue.Queue()
        self._fabric, self._name = fabric, name
        self.address = fabric.register(name, self)
        self._thread = threading.Thread(target=self._loop, name=f"kvfence-local-recv-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        landing = self.core.landing()  # a device pool's pages land in host buffers first (one thread: one landing)
        try:
            self._apply(landing)
        finally:
            if landing is not None:
                landing.close()

    def _apply(self, landing: PageLanding | None) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            reply, frame, data = item
            if isinstance(frame, Pages):
                off = 0
                for idx, nb in zip(frame.idx, frame.nb, strict=True):
                    self.core.receive_page(
                        frame.rid, frame.xid, idx, nb, fill_from_bytes(memoryview(data)[off : off + nb]), reply, landing
                    )
                    off += nb
                if landing is not None:
                    landing.commit()
                if not reply.closed:
                    reply.send(ChunkAck(frame.rid, frame.xid, frame.seq, len(data)))
                continue
            if landing is not None:
                landing.drain()  # any other frame counts only once every page read is in the pool
            if frame is None:
                reply.closed = True
                self.core.link_closed(reply)
            else:
                self.core.on_frame(reply, frame, data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._fabric.unregister(self._name)
            self._queue.put(None)
            self._thread.join(timeout=5)


class LocalSender(SenderBase):
    _thread_name = "kvfence-local-send"

    def __init__(
        self,
        fabric: LocalFabric,
        pool: KVPool,
        config: TransferConfig | None = None,
        faults: FaultInjector | None = None,
        *,
        auth: PlaneAuth,
    ) -> None:
        self.fabric = fabric
        self.pool = pool
        self.config = config or TransferConfig()
        self.faults = faults
        self.auth = auth
        self.core = SenderCore()
        self.staging = sender_staging(pool, self.config)  # host buffers for a device pool, reused across transfers
        self._connections: dict[str, _Connection] = {}
        self._lock = threading.Lock()

    def _connect(self, address: str) -> _Connection:
        with self._lock:
            conn = self._connections.get(address)
            if conn is None or conn.closed:
                conn = _Connection(self.fabric.lookup(address), self.core)
                self._connections[address] = conn
            return conn

    def _connect_failed(self, address: str, error: Exception) -> str:
        return str(error)

    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        run_send(
            link, handle, self.pool, src_pages, self.config, self.auth.manifest_key, self.faults, staging=self.staging
        )

    def close(self) -> None:
        """Close every connection: receivers see the link go, live handles fail."""
        with self._lock:
            conns, self._connections = list(self._connections.values()), {}
        for conn in conns:
            conn.close()
            self.core.link_closed(conn.handles)
