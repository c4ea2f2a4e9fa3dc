"""Control-plane messages between the router and the prefill/decode workers.

What it knows: every message the router and the workers exchange (registration, the
per-request orders, progress, verdicts, aborts, streamed tokens), each a small frozen
dataclass with a `kind` tag, and how to turn one into JSON bytes and back. Two
channels carry them: `QueueChannel` (threads in one process, for fast tests) and
`ZmqChannel` (a DEALER socket per worker talking to the router's ROUTER socket over
TCP). Both have the same three verbs: `send`, `recv(timeout)`, `close`. A worker may send
several messages as one `Batch` frame; the hubs unpack it, so the router sees them
one by one.

Log probabilities travel as JSON lists: one position is `[token id, logprob, [[id,
logprob], ...]]` (`logprobs_to_wire` / `logprobs_from_wire`); -inf stays -Infinity.

What it does not know: KV bytes (those travel on the data plane, `kvfence.transfer`),
what a worker does with an order, or how the router schedules.

Message flow of one request (router = R, prefill = P, decode = D):
    R -> D  DecodePrepare(prompt ids, tokens_expected, token_hash, transfer id, params, deadline)
    D -> R  DecodeReserved(handoff address, reserved pages)          (or RequestFailed)
    R -> P  PrefillOrder(prompt ids, transfer id, params, where decode listens, deadline)
    P -> R  FirstToken(first token, its text and logprobs, prompt logprobs)   as soon as the prompt is computed
    P -> R  PrefillSent(pages, manifest summary, first token and its logprobs)
                                                                      (or RequestFailed)
    R -> D  PrefillSent (decode's second source of the first token)
    D -> R  Tokens(...)*, the last one finished with the integrity record; the first repeats prefill's first
            token, which the router drops when it streamed FirstToken already
    D -> R  HandoffSettled(verified | rejected)  ->  R -> P  ReleaseSource
    R -> P|D  Abort(reason)  on client disconnect, a failure on the other side, or a deadline
"""

from __future__ import annotations

import dataclasses
import json
import queue
import socket
import threading
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Union, get_args, get_origin, get_type_hints

from kvfence.auth.curve import CurveKeys, CurveServer
from kvfence.auth.curve import make_client as make_curve_client
from kvfence.auth.events import SecurityEvent, SecurityEvents
from kvfence.engine.sampler import TokenLogprobs
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError

MAX_CONTROL_MESSAGE_BYTES = 256 << 20  # a prompt of ~20M token ids as JSON; larger control messages are dropped


class WireError(KvfenceError, ValueError):
    """A control message that cannot be decoded: not JSON, an unknown kind, a missing/unknown field or a field of
    the wrong type. Raised explicitly (never `assert`, which `python -O` removes)."""


# -- messages ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class Register(Message):
    """Worker -> router, once at start: who it is and what it can hold."""

    kind: ClassVar[str] = "register"
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
    settings: dict[str, Any] = field(default_factory=dict)  # every resolved setting, for server_info
    vocab_size: int = 0  # token ids the model accepts are [0, vocab_size); 0: not known


@dataclass(frozen=True)
class RegisterReply(Message):
    kind: ClassVar[str] = "register_reply"
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class DecodePrepare(Message):
    """Router -> decode: reserve pages for `tokens_expected` tokens and wait for the handoff."""

    kind: ClassVar[str] = "decode_prepare"
    request_id: str
    prompt_token_ids: list[int]
    tokens_expected: int  # computed by the router from the prompt it admitted, never by prefill
    token_hash: str  # likewise
    transfer_id: str  # the router's capability for this handoff (128 random bits): the only transfer decode accepts
    params: dict[str, Any]  # SamplingParams fields
    deadline_s: float  # seconds from receipt until the handoff must have verified


@dataclass(frozen=True)
class DecodeReserved(Message):
    """Decode -> router: pages are reserved; prefill may send to `handoff_address`."""

    kind: ClassVar[str] = "decode_reserved"
    request_id: str
    handoff_address: str
    num_pages: int
    transfer_info: dict[str, Any] = field(default_factory=dict)  # what prefill's sender needs (page ids, ...)


@dataclass(frozen=True)
class PrefillOrder(Message):
    """Router -> prefill: run the prompt, send its KV to decode."""

    kind: ClassVar[str] = "prefill_order"
    request_id: str
    prompt_token_ids: list[int]
    transfer_id: str  # the capability decode expects on the manifest (sent to this prefill and that decode only)
    params: dict[str, Any]
    handoff_address: str
    transfer_info: dict[str, Any]
    deadline_s: float  # seconds until prefill frees its source pages even without a verdict


@dataclass(frozen=True)
class PrefillSent(Message):
    """Prefill -> router: the KV and manifest are on their way (source pages still held)."""

    kind: ClassVar[str] = "prefill_sent"
    request_id: str
    num_pages: int
    num_tokens: int
    first_token: int
    first_logprobs: list[Any] | None = None  # the first token's entry (wire form), when the request asked
    prompt_logprobs: list[Any] | None = None  # the prompt's entries (wire form, first one null), when asked


@dataclass(frozen=True)
class FirstToken(Message):
    """Prefill -> router, the moment the prompt is computed (before the KV is sent): the first token, which the
    router may stream to the client before decode verified the handoff (it comes from prefill's own KV)."""

    kind: ClassVar[str] = "first_token"
    request_id: str
    first_token: int
    text: str | None = None  # its text as decode's detokenizer will give it (LLMEngine.first_token_text)
    first_logprobs: list[Any] | None = None  # the first token's entry (wire form), when the request asked
    prompt_logprobs: list[Any] | None = None  # the prompt's entries (wire form, first one null), when asked


@dataclass(frozen=True)
class HandoffSettled(Message):
    """Decode -> router: the handoff ended; prefill may release its source pages."""

    kind: ClassVar[str] = "handoff_settled"
    request_id: str
    verified: bool
    reason: str = ""


@dataclass(frozen=True)
class ReleaseSource(Message):
    """Router -> prefill: decode no longer needs the source pages of `request_id`."""

    kind: ClassVar[str] = "release_source"
    request_id: str
    verified: bool


@dataclass(frozen=True)
class Tokens(Message):
    """Decode -> router: new output tokens; the last one has finished=True and the integrity record."""

    kind: ClassVar[str] = "tokens"
    request_id: str
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    integrity: dict[str, Any] | None = None
    num_output_tokens: int = 0
    logprobs: list[Any] | None = None  # one wire entry per token in token_ids, when the request asked


WORKER_LOST = "worker_lost"  # the client's error code when a worker of the request's pair is gone


@dataclass(frozen=True)
class RequestFailed(Message):
    """Worker -> router: this request cannot go on on this side (the router aborts the other side)."""

    kind: ClassVar[str] = "request_failed"
    request_id: str
    role: str
    reason: str
    integrity: dict[str, Any] | None = None
    code: str = ""  # the client's error code when it is not the generic one (e.g. "worker_lost")


@dataclass(frozen=True)
class Abort(Message):
    """Router -> worker: drop `request_id` and free (or quarantine) everything it holds."""

    kind: ClassVar[str] = "abort"
    request_id: str
    reason: str


@dataclass(frozen=True)
class WorkerStats(Message):
    """Worker -> router, every few hundred ms: its load (the router routes by it) and live numbers for /metrics.

    Keys the router reads: pages_total/used/free/quarantined, num_running, num_waiting,
    handoffs_in_flight; prefill: queued_prompt_tokens; decode: pages_wanted (pages its
    queued requests wait for); and orders_seen, the orders (PrefillOrder / DecodePrepare)
    the worker had handled since it registered when it made the report.
    """

    kind: ClassVar[str] = "worker_stats"
    role: str
    stats: dict[str, Any]


def logprobs_to_wire(entries: list[TokenLogprobs | None] | None) -> list[Any] | None:
    """Log probability entries as JSON lists (None entries, e.g. the first prompt token, stay null)."""
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
    """Sampling params as the JSON object `DecodePrepare.params` / `PrefillOrder.params` carry."""
    return params.to_dict()


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """The inverse of `params_to_wire`; a payload that does not make valid params raises `WireError`."""
    if not isinstance(data, dict):
        raise WireError(f"sampling params: expected a JSON object, got {type(data).__name__}")
    try:
        return SamplingParams.from_dict(data)
    except (KvfenceError, TypeError, ValueError) as e:
        raise WireError(f"sampling params: {e}") from None


def engine_pool_stats(engine: Any) -> dict[str, Any]:
    """The engine half of a worker's WorkerStats payload: its KV pool and request queues."""
    s = engine.stats()
    return {
        "pages_total": s.num_pages,
        "pages_used": s.num_used_pages,
        "pages_free": s.num_free_pages,
        "pages_quarantined": s.num_quarantined_pages,
        "page_size": engine.resolved.page_size,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
    }


@dataclass(frozen=True)
class Shutdown(Message):
    kind: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Batch(Message):
    """Several messages in one frame (decode's tokens of one step: one send, one router wakeup).

    Hubs unpack it: `recv` hands out the messages inside one by one, in order, so the
    router never sees a Batch. Batches do not nest.
    """

    kind: ClassVar[str] = "batch"
    messages: list[Message]

    def __post_init__(self) -> None:
        if any(isinstance(m, Batch) for m in self.messages):
            raise WireError("batches do not nest")


def batch(messages: list[Message]) -> Message | None:
    """The one message to send for `messages`: None for none, the message itself for one, else a Batch."""
    if not messages:
        return None
    return messages[0] if len(messages) == 1 else Batch(list(messages))


_KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        Register,
        RegisterReply,
        DecodePrepare,
        DecodeReserved,
        PrefillOrder,
        FirstToken,
        PrefillSent,
        HandoffSettled,
        ReleaseSource,
        Tokens,
        RequestFailed,
        Abort,
        WorkerStats,
        Shutdown,
    )
}


_KINDS[Batch.kind] = Batch
_FIELD_NAMES: dict[type[Message], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _KINDS.values()
}


def _body(msg: Message) -> dict[str, Any]:
    # Shallow: every field is already JSON-shaped (ids, strings, dicts and lists of them), so the deep
    # copy `dataclasses.asdict` makes would only cost time (it was most of the encoding time per token).
    if isinstance(msg, Batch):
        return {"kind": Batch.kind, "messages": [_body(m) for m in msg.messages]}
    body = {name: getattr(msg, name) for name in _FIELD_NAMES[type(msg)]}
    body["kind"] = msg.kind
    return body


def _json_types(hint: Any) -> tuple[type, ...] | None:
    """The JSON-level types a field of annotation `hint` may hold (None: anything)."""
    members = get_args(hint) if isinstance(hint, types.UnionType) or get_origin(hint) is Union else (hint,)
    allowed: list[type] = []
    for h in members:
        base = get_origin(h) or h
        if base is Any:
            return None
        if base is float:
            allowed += [float, int]
        elif base in (int, str, bool, list, dict, type(None)):
            allowed.append(base)
        else:
            return None
    return tuple(allowed)


# kind -> (class, required field names, {field name: allowed JSON types})
_SCHEMAS: dict[str, tuple[type[Message], frozenset[str], dict[str, tuple[type, ...] | None]]] = {}
for _cls in _KINDS.values():
    _hints = get_type_hints(_cls)
    _fields = dataclasses.fields(_cls)
    _SCHEMAS[_cls.kind] = (
        _cls,
        frozenset(
            f.name
            for f in _fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        ),
        {f.name: _json_types(_hints[f.name]) for f in _fields},
    )


def _message(body: Any) -> Message:
    if not isinstance(body, dict):
        raise WireError(f"control message: expected a JSON object, got {type(body).__name__}")
    kind = body.pop("kind", None)
    schema = _SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise WireError(f"unknown control message kind {kind!r}")
    cls, required, types = schema
    missing = required - body.keys()
    if missing:
        raise WireError(f"{kind}: missing field(s) {sorted(missing)}")
    for name, value in body.items():
        if name not in types:
            raise WireError(f"{kind}: unknown field {name!r}")
        allowed = types[name]
        if allowed is not None and (
            not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        ):
            raise WireError(
                f"{kind}.{name}: expected {'/'.join(t.__name__ for t in allowed)}, got {type(value).__name__}"
            )
    if cls is Batch:
        return Batch([_message(b) for b in body["messages"]])
    return cls(**body)


def encode(msg: Message) -> bytes:
    return json.dumps(_body(msg), separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    """The message `data` encodes; anything else raises `WireError` naming what is wrong."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"control message is not JSON: {e}") from None
    return _message(body)


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

    def __init__(self, address: str, identity: str, curve: CurveKeys | None) -> None:
        import zmq

        self.identity = identity
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self._monitor = None
        self.handshakes_refused = 0  # CURVE handshakes the router refused (another cluster key)
        if curve is not None:
            make_curve_client(self._sock, curve)
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )  # fmt: skip
        self._sock.connect(address)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self.closed = False

    def send(self, msg: Message) -> None:
        self._sock.send(encode(msg))

    def refused_handshakes(self) -> int:
        """How many times the router refused this link's CURVE handshake so far (it holds another key)."""
        while self._monitor is not None and self._monitor.poll(0, self._zmq.POLLIN):
            self._monitor.recv_multipart()
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
                self._sock.disable_monitor()
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
    A message that does not decode is dropped and counted (`WireError`), never raised.
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
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._curve is not None:
            self._poller.register(self._curve.monitor, zmq.POLLIN)
        self._lock = threading.Lock()
        self._unbatch = _Unbatcher()
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
                self._sock.send_multipart([wid.encode(), data])
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
                self._sock.disable_monitor()
                self._curve.close()
            self._sock.close(linger=1000)  # let queued messages (Shutdown) reach the workers
            self._ctx.term()
            self._wake_r.close()
            self._wake_w.close()
