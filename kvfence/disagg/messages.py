"""Control-plane messages between the router and the prefill/decode workers.

What it knows: every message the router and the workers exchange, each a small frozen
`msgspec.Struct` whose class is its `kind` tag, and how to turn one into bytes and back:
MessagePack with the tag in `kind`, decoded into the typed struct (a message that is not
one of these, misses a field, names an unknown one or has one of the wrong type raises
`WireError`; MessagePack, unlike JSON, carries -inf log probabilities as they are). Two
channels carry them: `QueueChannel` (threads in one process, for fast tests) and
`ZmqChannel` (a DEALER socket per worker talking to the router's ROUTER socket over
TCP, CURVE-encrypted). Both have the same three verbs: `send`, `recv(timeout)`, `close`.
A worker may send several messages as one `Batch` frame; the hubs unpack it, so the
router sees them one by one.

One request takes four kinds of message, whatever its fate (docs/handoff.md, "One request"):

    R -> P, R -> D   Order(prompt ids, transfer id, params; prefill: decode's data-plane address;
                           decode: tokens_expected and token_hash, the router's own count and hash)
    P -> R           Tokens(the first token, its text and logprobs, the prompt's logprobs)   once computed
    D -> R           Tokens(...)*, the last one finished and carrying the integrity record; the first repeats
                           prefill's first token (the router checks they agree and drops the repeat)
    P|D -> R         Failed(reason, code, record)     this side cannot go on (the router aborts the other)
    R -> P|D         Abort(reason)                    the client went away, the other side failed, a deadline

The KV itself, its verdict and the release of prefill's source pages are the data plane's
(`kvfence.transfer`): prefill sends to the address in its order, decode answers with its verdict
on the same connection, and prefill frees its pages on that verdict (or its deadline).

Log probabilities travel as lists: one position is `[token id, logprob, [[id, logprob], ...]]`
(`logprobs_to_wire` / `logprobs_from_wire`).

What it does not know: KV bytes (those travel on the data plane, `kvfence.transfer`),
what a worker does with an order, or how the router schedules.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from kvfence.auth.curve import CurveKeys, CurveServer, open_monitor, stop_monitor
from kvfence.auth.curve import make_client as make_curve_client
from kvfence.auth.events import SecurityEvent, SecurityEvents
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.errors import KvfenceError

if TYPE_CHECKING:  # the router imports this module and never loads torch
    from kvfence.disagg.worker_engine import WorkerEngine

logger = logging.getLogger(__name__)

MAX_CONTROL_MESSAGE_BYTES = 256 << 20  # a prompt of ~20M token ids; a peer sending more is disconnected
_ENVELOPE_BYTES = 64 << 10  # what a first token's message holds besides its prompt logprobs (ids, text, record)


def prompt_logprobs_wire_bytes(num_prompt_tokens: int, num_top: int) -> int:
    """At most how many bytes prefill's first-token message takes with `num_top` prompt logprobs per prompt token
    (MessagePack: per entry a 3-list, a token id < 2**32 in 5 bytes, a float64 in 9, a list of `num_top` pairs)."""
    return _ENVELOPE_BYTES + num_prompt_tokens * (1 + 5 + 9 + 3 + num_top * (1 + 5 + 9))


CONTROL_SEND_TIMEOUT_S = 60.0  # a worker's send that the link takes no message for this long raises


class ControlLinkDown(KvfenceError):
    """A worker's control-plane link accepted no message within its send timeout: no router answered the
    connection (its queue is full), or the router refused the link for good (it speaks another security
    mechanism, e.g. a worker under --insecure-no-auth against a router with a cluster key)."""


class WireError(KvfenceError, ValueError):
    """A control message that cannot be decoded: not MessagePack, an unknown kind, a missing/unknown field or a field
    of the wrong type. Raised explicitly (never `assert`, which `python -O` removes)."""


# -- messages ---------------------------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """Every control message; its class name's tag is its `kind` on the wire."""

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class Register(Message, frozen=True, tag="register"):
    """Worker -> router, once at start: who it is and what it can hold."""

    role: str  # "prefill" | "decode"
    worker_id: str
    model_name: str
    model_fingerprint: str
    context_length: int
    pool_tokens: int
    page_size: int
    dtype: str
    layout_fingerprint: str
    layout: dict[str, Any]  # KVLayout.describe()
    handoff_address: str = ""  # decode: where its data plane listens ("tcp://host:port" or "local:<name>")
    settings: dict[str, Any] = {}  # every resolved setting, for server_info
    vocab_size: int = 0  # token ids the model accepts are [0, vocab_size); 0: not known
    instance: str = ""  # random per process start: tells a worker that comes back from one that replaced it


class RegisterReply(Message, frozen=True, tag="register_reply"):
    accepted: bool
    reason: str = ""


class Order(Message, frozen=True, tag="order"):
    """Router -> prefill and decode: one request, the same capability to both (and nobody else)."""

    request_id: str
    prompt_token_ids: list[int]
    transfer_id: str  # the router's capability for this handoff (128 random bits): the only transfer decode accepts
    params: dict[str, Any]  # SamplingParams fields
    decode_address: str = ""  # prefill: where the chosen decode's data plane listens (from its registration)
    tokens_expected: int = 0  # decode: the prompt's length as the router admitted it, never prefill's word
    token_hash: str = ""  # decode: likewise, the hash of the admitted ids
    expected_cached_tokens: int = 0  # prefill: what the router counted its cache to serve (its queue reports the rest)


class Tokens(Message, frozen=True, tag="tokens"):
    """Worker -> router: new output tokens. From prefill: the first token (and the prompt's logprobs), the moment
    the prompt is computed. From decode: the rest; the last one is finished and carries the integrity record."""

    request_id: str
    token_ids: list[int]
    text: str | None = ""  # None: this worker could not say the text (no tokenizer)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    integrity: dict[str, Any] | None = None
    num_output_tokens: int = 0
    logprobs: list[Any] | None = None  # one wire entry per token in token_ids, when the request asked
    prompt_logprobs: list[Any] | None = None  # prefill's first token only: the prompt's entries (first one null)


WORKER_LOST = "worker_lost"  # the client's error code when a worker of the request's pair is gone


class RequestFailed(Message, frozen=True, tag="request_failed"):
    """Worker -> router: this request cannot go on on this side (the router aborts the other side)."""

    request_id: str
    role: str
    reason: str
    integrity: dict[str, Any] | None = None
    code: str = ""  # the client's error code when it is not the generic one (e.g. "worker_lost")


class Abort(Message, frozen=True, tag="abort"):
    """Router -> worker: drop `request_id` and free (or quarantine) everything it holds."""

    request_id: str
    reason: str


class WorkerStats(Message, frozen=True, tag="worker_stats"):
    """Worker -> router, every few hundred ms: its load (the router routes by it) and live numbers for /metrics.

    Keys the router reads: pages_total/used/free/quarantined, num_running, num_waiting, prefix_cache,
    handoffs_in_flight; prefill: queued_prompt_tokens, prefix_caching (whether prefix affinity may send it
    prompts for its cache); decode: pages_wanted (pages its
    queued requests wait for); and orders_seen, the orders the worker had handled since it
    registered when it made the report.
    """

    role: str
    stats: dict[str, Any]
    instance: str = ""  # the sender's process (Register.instance)


class Shutdown(Message, frozen=True, tag="shutdown"):
    pass


Single = Register | RegisterReply | Order | Tokens | RequestFailed | Abort | WorkerStats | Shutdown


class Batch(Message, frozen=True, tag="batch"):
    """Several messages in one frame (decode's tokens of one step: one send, one router wakeup).

    Hubs unpack it: `recv` hands out the messages inside one by one, in order, so the
    router never sees a Batch. Batches do not nest (the type says so).
    """

    messages: list[Single]


AnyMessage = Single | Batch


def batch(messages: list[Message]) -> Message | None:
    """The one message to send for `messages`: None for none, the message itself for one, else a Batch."""
    if not messages:
        return None
    return messages[0] if len(messages) == 1 else Batch(list(messages))  # type: ignore[arg-type]


_M = TypeVar("_M", bound=msgspec.Struct)


def replace(msg: _M, **changes: Any) -> _M:
    """A copy of `msg` with `changes` (messages are frozen)."""
    return msgspec.structs.replace(msg, **changes)


def logprobs_to_wire(entries: Sequence[TokenLogprobs | None] | None) -> list[Any] | None:
    """Log probability entries as lists (None entries, e.g. the first prompt token, stay null)."""
    if entries is None:
        return None
    return [None if e is None else [e.token_id, e.logprob, [list(t) for t in e.top]] for e in entries]


def logprobs_from_wire(data: list[Any] | None) -> list[TokenLogprobs | None] | None:
    """The inverse of `logprobs_to_wire`."""
    if data is None:
        return None
    return [
        None if d is None else TokenLogprobs(int(d[0]), float(d[1]), tuple((int(i), float(lp)) for i, lp in d[2]))
        for d in data
    ]


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Sampling params as the map `Order.params` carries."""
    return params.to_dict()


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """The inverse of `params_to_wire`; a payload that does not make valid params raises `WireError`."""
    if not isinstance(data, dict):
        raise WireError(f"sampling params: expected a map, got {type(data).__name__}")
    try:
        return SamplingParams.from_dict(data)
    except (KvfenceError, TypeError, ValueError) as e:
        raise WireError(f"sampling params: {e}") from None


PREFIX_CACHE_COUNTERS = ("queries", "hits", "corrupt_pages")  # counters of a worker's "prefix_cache" stats


def engine_pool_stats(engine: WorkerEngine) -> dict[str, Any]:
    """The engine half of a worker's WorkerStats payload: its KV pool and request queues."""
    s = engine.stats()
    return {
        "pages_total": s.num_pages,
        "pages_used": s.num_used_pages - s.num_evictable_pages,  # evictable cached pages count free (as vLLM)
        "pages_free": s.num_free_pages + s.num_evictable_pages,
        "pages_quarantined": s.num_quarantined_pages,
        "page_size": engine.resolved.page_size,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "prefix_caching": getattr(engine, "prefix_cache", None) is not None,  # the router's prefix affinity
        # the prefix cache's numbers (prefill workers; zeros without one): the router sums them for /metrics
        "prefix_cache": {
            "queries": s.prefix_cache_queries,
            "hits": s.prefix_cache_hits,
            "corrupt_pages": s.prefix_cache_corrupt,
            "pages": s.num_cached_pages,
        },
    }


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes) -> Message:
    """The message `data` encodes; anything else raises `WireError` naming what is wrong."""
    try:
        msg: Message = _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise WireError(f"control message: {e}") from None
    return msg


class _Unbatcher:
    """Hub-side: hands out the messages inside a Batch one `recv` at a time."""

    def __init__(self) -> None:
        self._ready: deque[tuple[str, Message]] = deque()

    def push(self, worker_id: str, msg: Message) -> tuple[str, Message] | None:
        if isinstance(msg, Batch):
            self._ready.extend((worker_id, m) for m in msg.messages)
            return self.pop()
        return worker_id, msg

    def pop(self) -> tuple[str, Message] | None:
        return self._ready.popleft() if self._ready else None


# -- channels ---------------------------------------------------------------------------------------------
# Worker end: `send(msg)`, `recv(timeout) -> msg | None`, `close()`; used by one thread (the worker loop).
# Router end ("hub"): `send(worker_id, msg)` from any thread, `recv(timeout) -> (worker_id, msg) | None`
# from one thread (the router's receiver), `close()`.


class Hub(Protocol):
    """The router end of the channels to every worker (`QueueHub`, `ZmqHub`)."""

    def send(self, worker_id: str, msg: Message) -> None: ...
    def recv(self, timeout: float | None = 0.0) -> tuple[str, Message] | None: ...
    def close(self) -> None: ...


_WAKE = b""  # a QueueChannel inbox entry that is no message: `wake()` was called


class QueueChannel:
    """Worker end of an in-process link; messages still go through encode/decode."""

    def __init__(self, identity: str, inbox: queue.Queue[bytes], outbox: queue.Queue[tuple[str, bytes]]) -> None:
        self.identity = identity
        self._inbox = inbox
        self._outbox = outbox
        self.closed = False

    def send(self, msg: Message) -> None:
        self._outbox.put((self.identity, encode(msg)))

    def recv(self, timeout: float | None = 0.0) -> Message | None:
        """Next message, or None after `timeout` seconds (0 -> do not wait, None -> wait forever) or a `wake`."""
        try:
            if timeout is not None and timeout <= 0:
                raw = self._inbox.get_nowait()
            else:
                raw = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        return None if raw is _WAKE else decode(raw)

    def wake(self) -> None:
        """From any thread: end a `recv` waiting now (or the next one) early, with no message."""
        self._inbox.put(_WAKE)

    def close(self) -> None:
        self.closed = True


class QueueHub:
    """Router end of in-process links to workers running in threads of this process."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._workers: dict[str, queue.Queue[bytes]] = {}
        self._unbatch = _Unbatcher()

    def connect(self, identity: str, replace: bool = False) -> QueueChannel:
        """A new worker end named `identity` (`replace`: a worker coming back under its old name)."""
        assert replace or identity not in self._workers, identity
        self._workers[identity] = queue.Queue()
        return QueueChannel(identity, self._workers[identity], self._inbox)

    def send(self, worker_id: str, msg: Message) -> None:
        self._workers[worker_id].put(encode(msg))

    def recv(self, timeout: float | None = 0.0) -> tuple[str, Message] | None:
        if (ready := self._unbatch.pop()) is not None:
            return ready
        try:
            if timeout is not None and timeout <= 0:
                wid, data = self._inbox.get_nowait()
            else:
                wid, data = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._unbatch.push(wid, decode(data))

    def close(self) -> None:
        pass


class ZmqChannel:
    """Worker end over TCP: a DEALER socket (identity = worker id) connected to the router's ROUTER socket.

    With `curve` (every deployment but --insecure-no-auth) the link is a CURVE client of the router: encrypted,
    and admitted only because the worker holds the cluster key (`kvfence.auth.curve`)."""

    def __init__(
        self,
        address: str,
        identity: str,
        curve: CurveKeys | None,
        send_timeout_s: float = CONTROL_SEND_TIMEOUT_S,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`: the worker's stop event (SIGTERM); a send the link cannot take gives up when it is set."""
        import zmq

        self.identity = identity
        self.address = address
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        # A DEALER send waits while the link has no room: its queue is full, or libzmq dropped the link after a
        # refused handshake and will not reconnect. Unbounded, that wait froze a worker (and CI) for good; in one
        # blocking call it also kept a SIGTERM waiting for the whole timeout. `send` waits in short polls instead.
        self._send_timeout_s = send_timeout_s
        self._stop = stop
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self._monitor = None
        self.handshakes_refused = 0  # CURVE handshakes the router refused (another cluster key)
        if curve is not None:
            make_curve_client(self._sock, curve)
            self._monitor = open_monitor(
                self._sock,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            )  # fmt: skip
        self._sock.connect(address)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._monitor is not None:  # drained as we poll, so a router that keeps refusing us costs no memory
            self._poller.register(self._monitor, zmq.POLLIN)
        self.closed = False

    def send(self, msg: Message) -> None:
        """Queue `msg` for the router. A link with no room for `send_timeout_s` raises ControlLinkDown; while the
        worker is stopping, the message is dropped instead (nothing would read it), at most ~0.25 s later."""
        data = encode(msg)
        deadline = time.monotonic() + self._send_timeout_s
        while True:
            try:
                self._sock.send(data, self._zmq.NOBLOCK)
                return
            except self._zmq.Again:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlLinkDown(
                    f"{self.identity}: the control-plane link to the router at {self.address} took no message for "
                    f"{self._send_timeout_s:g}s: no router answers there, or it refused this link for good (another "
                    "cluster key, or a router with a key against a worker under --insecure-no-auth)"
                )
            if self._stop is not None and self._stop.is_set():
                logger.warning("%s: stopping; dropped a %s the router's link had no room for", self.identity,
                               type(msg).__name__)  # fmt: skip
                return
            self._sock.poll(max(1, int(min(left, 0.25) * 1000)), self._zmq.POLLOUT)

    def refused_handshakes(self) -> int:
        """How many times the router refused this link's CURVE handshake so far (it holds another key)."""
        while self._monitor is not None and self._monitor.poll(0, self._zmq.POLLIN):
            self._monitor.recv_multipart(self._zmq.NOBLOCK)
            self.handshakes_refused += 1
        return self.handshakes_refused

    def recv(self, timeout: float | None = 0.0) -> Message | None:
        """Next message, or None after `timeout` seconds or when `wake` was called."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        ready = dict(self._poller.poll(ms))
        if self._wake_r.fileno() in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        if self._monitor is not None and self._monitor in ready:
            self.refused_handshakes()
        if self._sock not in ready:
            return None
        return decode(self._sock.recv())

    def wake(self) -> None:
        """From any thread (a transport thread whose transfer moved on): end a waiting `recv` early."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is already pending, or we are closing

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._monitor is not None:
                stop_monitor(self._sock, self.refused_handshakes)
                self._monitor.close(0)
            self._sock.close(0)
            self._ctx.term()
            self._wake_r.close()
            self._wake_w.close()


class ZmqHub:
    """Router end over TCP: a ROUTER socket bound on `host` (port 0 -> the OS picks one; see `address`).

    The socket is touched only by the thread calling `recv`; `send` from other threads
    queues the message and wakes that thread through a socket pair, so sends never wait
    for a poll timeout. With `curve` the socket is a CURVE server that admits only holders
    of the cluster key (`kvfence.auth.curve`); refused handshakes are counted in `events`.
    A message that does not decode is dropped and counted (`WireError`), never raised. A message to a
    worker whose queue is full (it stopped reading) is dropped and counted in `dropped_sends`, never waited
    on: one stuck worker must not stop the router's only receiving thread.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        curve: CurveKeys | None = None,
        events: SecurityEvents | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.events = events if events is not None else SecurityEvents("router")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker id raises instead of dropping
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker reconnecting under its id takes the id over
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self._curve = CurveServer(self._ctx, self._sock, curve, self.events) if curve is not None else None
        self.secure = curve is not None
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._outgoing: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # one pending byte wakes the receiver; a full pipe must never block `send`
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._curve is not None:
            self._poller.register(self._curve.monitor, zmq.POLLIN)
        self._lock = threading.Lock()
        self._unbatch = _Unbatcher()
        self.dropped_sends = 0
        self.closed = False

    def send(self, worker_id: str, msg: Message) -> None:
        self._outgoing.put((worker_id, encode(msg)))
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # the receiver is already awake (buffer full) or closing

    def _flush(self) -> None:
        while True:
            try:
                wid, data = self._outgoing.get_nowait()
            except queue.Empty:
                return
            try:
                self._sock.send_multipart([wid.encode(), data], self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.dropped_sends += 1  # its queue is full: the worker stopped reading; its requests time out
                logger.warning("control message to %s dropped: its link's queue is full (%d so far)", wid,
                               self.dropped_sends)  # fmt: skip
            except self._zmq.ZMQError:
                pass  # the worker is gone; its requests time out on the router

    def recv(self, timeout: float | None = 0.0) -> tuple[str, Message] | None:
        deadline_ms = -1 if timeout is None else max(0, int(timeout * 1000))
        with self._lock:
            self._flush()
            if (ready := self._unbatch.pop()) is not None:
                return ready
            events = dict(self._poller.poll(deadline_ms))
            if self._wake_r.fileno() in events:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if self._curve is not None and self._curve.monitor in events:
                self._curve.drain_monitor()
            self._flush()
            if self._sock in events or self._sock.poll(0, self._zmq.POLLIN):
                frames = self._sock.recv_multipart()
                if len(frames) != 2:
                    self.events.record(SecurityEvent.FRAME_MALFORMED, f"control message of {len(frames)} parts")
                    return None
                wid, data = frames
                try:
                    return self._unbatch.push(wid.decode(errors="replace"), decode(data))
                except WireError as e:  # an admitted peer that speaks nonsense: drop it, never the router
                    self.events.record(SecurityEvent.FRAME_MALFORMED, f"undecodable control message from {wid!r}: {e}")
                    return None
            return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._lock:
            self._flush()
            if self._curve is not None:
                stop_monitor(self._sock, self._curve.drain_monitor)
                self._curve.close()
            self._sock.close(linger=1000)  # let queued messages (Shutdown) reach the workers
            self._ctx.term()
            self._wake_r.close()
            self._wake_w.close()
