"""The router: the front end's engine in disaggregated mode, routing each request to a prefill and a decode worker.

What it knows: the workers that registered (a `WorkerTable`: the deployment's identity,
each worker's health and reported load, the routing policy; registration and keepalives
are `disagg.registration`), each request in flight as one `_Flight` record whose
`FlightState` moves only along `FLIGHT_TRANSITIONS` (prefilling while decode reserves,
decoding, failing, finished; docs/handoff.md, "Lifecycles") and which pair of workers
serves it; the expected prompt length and token hash, which it computes itself
from the ids the API layer admitted, so prefill never vouches for its own prompt. It
implements `EngineClient`, so the HTTP app serves it exactly as it serves one engine. It
admits a request only if some up worker of each role can hold it (the largest pool per
role is the front end's capacity: 400 before any handoff otherwise), then picks the decode
worker (at admission) and the prefill worker (once decode reserved pages) by load. Log
probabilities of the prompt come from prefill (in `PrefillSent`) and ride on the request's
first chunk; those of the output come with decode's tokens. It ends every request with one
integrity record (JSON log line + the final chunk + the counters in
`stats()`), and relays aborts and failures to the other worker of the pair.

Worker health: every worker sends `WorkerStats` a few times a second and the router
sends each up worker a keepalive (`RegisterReply(accepted=True, reason=HEARTBEAT)`,
sent by `disagg.registration.Registrar`). A worker silent for `worker_timeout_s` (on the
router's clock: monotonic time, or one a test moves) is declared dead: the requests that
still need it fail at once with an error naming it (the other worker of each pair is told
to drop them and free their pages), and new requests go to the others; a role with no worker up gets
HTTP 503 with an OpenAI-style error body until one registers. A worker may register at
any time (a replacement, a new one, or the same one again after it lost its router); one
that does not match the deployment is refused naming the difference. A message from a
worker the router does not know (the router restarted, or declared that worker dead) is
answered `RegisterReply(accepted=False, reason=REREGISTER ...)`: the worker drops what it
holds and registers afresh.

What it does not know: tokens' text (decode detokenizes), KV bytes (they go straight
from prefill to decode on the data plane) or the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from kvfence.auth.events import SecurityEvents, SecurityEventsCollector
from kvfence.disagg import messages as P
from kvfence.disagg.config_checks import require_positive
from kvfence.disagg.lifecycle import Lifecycle
from kvfence.disagg.registration import Registrar
from kvfence.disagg.workers import ROLES, WorkerTable
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError, InvalidRequestError, KvfenceError
from kvfence.integrity.digest import DIGEST_ALGORITHM, token_hash
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import Reason
from kvfence.server.admission import admit
from kvfence.server.engine_client import Capacity, GenerationChunk
from kvfence.transfer.base import new_transfer_id

logger = logging.getLogger(__name__)
integrity_logger = logging.getLogger("kvfence.integrity")

WORKER_LOST = P.WORKER_LOST
MAX_BACKLOG = 1024  # messages handled per pass before deadlines and worker health are checked


@dataclass(frozen=True)
class RouterConfig:
    handoff_deadline_s: float = 60.0  # decode must have verified the KV this long after the order (flag)
    request_timeout_s: float = 300.0  # a request with no news from any worker for this long is failed (flag)
    register_timeout_s: float = 300.0  # how long to wait at start for the workers below
    worker_timeout_s: float = 10.0  # a worker silent this long is declared dead (flag)
    heartbeat_interval_s: float = 0.5  # router -> worker keepalive period
    suspect_after_s: float = 1.0  # a worker silent this long is routed to only when no other can take the request
    wait_prefill_workers: int = 1  # start serving once this many prefill workers registered (later ones join)
    wait_decode_workers: int = 1  # ... and this many decode workers
    allow_context_above_pool: bool = False
    model_name: str | None = None  # name served to clients; default: the workers' model name
    first_token_before_verdict: bool = True  # stream prefill's first token before decode's verdict (flag)

    def __post_init__(self) -> None:
        for name in ("handoff_deadline_s", "request_timeout_s", "register_timeout_s", "suspect_after_s"):
            require_positive(self, name)
        if not self.worker_timeout_s > self.heartbeat_interval_s > 0:
            raise KvfenceError(
                f"router: need worker_timeout_s ({self.worker_timeout_s}) > heartbeat_interval_s "
                f"({self.heartbeat_interval_s}) > 0"
            )
        if self.wait_prefill_workers < 1 or self.wait_decode_workers < 1:
            raise KvfenceError(
                f"router: wait for at least one worker of each role (prefill {self.wait_prefill_workers}, "
                f"decode {self.wait_decode_workers})"
            )


class FlightState(str, Enum):
    """Where one request stands in the router (docs/handoff.md, "Lifecycles")."""

    PREFILLING = "prefilling"  # ordered to both workers: decode reserves while prefill computes
    DECODING = "decoding"  # prefill sent the KV (PrefillSent): decode verifies, then streams tokens
    FAILING = "failing"  # failed by the router (deadline, worker lost, shutdown): the error is on its way to the
    # client; no more worker news matters
    FINISHED = "finished"  # its one integrity record is written (the final chunk, an error, or an abort)


_F = FlightState
FLIGHT_TRANSITIONS: dict[FlightState, frozenset[FlightState]] = {
    # Tokens may finish a flight still PREFILLING: decode can start decoding on the manifest's first token before the
    # router relays PrefillSent.
    _F.PREFILLING: frozenset({_F.DECODING, _F.FAILING, _F.FINISHED}),
    _F.DECODING: frozenset({_F.FAILING, _F.FINISHED}),
    _F.FAILING: frozenset({_F.FINISHED}),
    _F.FINISHED: frozenset(),
}


@dataclass
class _Flight:
    """One request on its way through the router: its state, the pair serving it and, at the end, its record."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tokens_expected: int
    token_hash: str
    transfer_id: str  # the capability this request's handoff must carry; sent to its two workers only
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[P.Message]
    started: float = field(default_factory=time.monotonic)
    decode_id: str = ""  # the workers serving this request: decode chosen at admission,
    prefill_id: str = ""  # prefill once decode reserved its pages
    num_output_tokens: int = 0
    prefill_sent: P.PrefillSent | None = None
    first: P.FirstToken | None = None  # prefill's first token, once it came (set by the receiver thread)
    streamed_first: P.FirstToken | None = None  # that token, if it went to the client before decode's first chunk
    first_dropped: bool = False  # decode's first chunk came, minus the token streamed already
    prompt_logprobs: list[Any] | None = None  # prefill's scores of the prompt (wire form), for the first chunk
    record: IntegrityRecord | None = None  # the integrity record, once FINISHED
    decode_record: IntegrityRecord | None = None  # decode's record of the handoff, once it sent one
    lifecycle: Lifecycle[FlightState] = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(f"flight {self.request_id}", _F.PREFILLING, FLIGHT_TRANSITIONS)

    @property
    def state(self) -> FlightState:
        return self.lifecycle.state

    def advance(self, new: FlightState) -> None:
        self.lifecycle.advance(new)

    @property
    def live(self) -> bool:
        """Still waiting on its workers (neither failed by the router nor finished)."""
        return self.state in (_F.PREFILLING, _F.DECODING)

    @property
    def finished(self) -> bool:
        return self.state is _F.FINISHED

    @property
    def pair(self) -> str:
        return f"prefill {self.prefill_id or '-'} -> decode {self.decode_id}"


class _Source(NamedTuple):
    """Prefill's source pages of a request, held until decode's HandoffSettled (may outlive the flight)."""

    prefill_id: str
    decode_id: str
    since: float


@dataclass(frozen=True)
class _Failure(P.Message):
    """Router-internal: a request failed because of `worker` (queued to the request's generator, never sent)."""

    kind = "router_failure"
    request_id: str
    role: str
    reason: str
    code: str = "generation_failed"


def _without_first(msg: P.Tokens, first: P.FirstToken) -> P.Tokens | None:
    """Decode's first chunk less the first token the router streamed already; None when it does not start with
    that token and its text (decode's detokenizer continues from the same text: a finishing first token may add
    what it held back)."""
    assert first.text is not None
    if not msg.token_ids or msg.token_ids[0] != first.first_token or not msg.text.startswith(first.text):
        return None
    logprobs = msg.logprobs[1:] if msg.logprobs is not None else None
    return dataclasses.replace(msg, token_ids=msg.token_ids[1:], text=msg.text[len(first.text) :], logprobs=logprobs)


class Router:
    """EngineClient over N prefill and M decode workers, reached through a `Hub`."""

    def __init__(
        self,
        hub: P.Hub,
        config: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth: dict[str, Any] | None = None,
    ) -> None:
        """`auth`: what /server_info says of the deployment's authentication (`ClusterKey.describe()`; None: an
        in-process deployment, no key)."""
        self.hub = hub
        self.config = config or RouterConfig()
        self.auth = auth or {"enabled": False, "key_id": None}
        hub_events = getattr(hub, "events", None)
        self.security_events = hub_events if isinstance(hub_events, SecurityEvents) else SecurityEvents("router")
        # What the router judges by (worker silence, handoff deadlines, orders in transit). Blocking waits
        # (registration at start, a request's own timeout, inbox polls) stay on real time. Tests pass a
        # clock they move, so a healthy worker starved under load is never judged silent.
        self._clock = clock
        self.workers = WorkerTable(
            suspect_after_s=self.config.suspect_after_s, transit_timeout_s=self.config.worker_timeout_s
        )
        self._flights: dict[str, _Flight] = {}
        self._sources: dict[str, _Source] = {}  # rid -> prefill's held source pages, until the handoff settles
        self._lock = threading.RLock()  # flights, sources and the worker table
        self.integrity_counts: Counter[str] = Counter()
        self.transfer_counts: Counter[str] = Counter()
        self.records: list[IntegrityRecord] = []  # last records (bounded), for tests
        self.integrity_metrics = IntegrityMetrics()  # Prometheus counters, in a registry of this router
        self.integrity_metrics.registry.register(SecurityEventsCollector(self.security_event_counts))
        self._receiver: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = False
        self.registrar = Registrar(
            hub,
            self.workers,
            self._lock,
            self.config.allow_context_above_pool,
            self.config.heartbeat_interval_s,
            self.config.worker_timeout_s,
            clock=clock,
        )
        self.worker_deaths: Counter[str] = Counter()  # role -> workers declared dead

    # -- start-up -------------------------------------------------------------------------------------------
    def wait_for_workers(self, timeout: float | None = None) -> None:
        """Block until `wait_prefill_workers` prefill and `wait_decode_workers` decode workers registered.

        A worker that does not match the deployment is refused (it is told why) and the wait goes on. At the
        deadline the router starts with what it has if it has a worker of each role, else raises naming what
        is missing and why workers were refused.
        """
        timeout = timeout if timeout is not None else self.config.register_timeout_s
        deadline = time.monotonic() + timeout
        want = {"prefill": self.config.wait_prefill_workers, "decode": self.config.wait_decode_workers}
        while any(self.workers.count(r) < n for r, n in want.items()):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ROLES if self.workers.count(r) == 0]
                if missing:
                    refusals = self.registrar.refusals
                    refused = f" (refused: {' | '.join(refusals[-4:])})" if refusals else ""
                    raise CapacityConfigError(
                        f"router: no {' and no '.join(missing)} worker registered within {timeout:g}s{refused}"
                    )
                logger.warning(
                    "router: starting with %s after %.0fs (asked for %s)",
                    {r: self.workers.count(r) for r in ROLES},
                    timeout,
                    want,
                )
                break
            got = self.hub.recv(timeout=min(left, 0.2))
            if got is not None:  # registrations, and the stats of workers accepted already
                self._dispatch(*got)
            self._check_workers()  # accepted workers hear keepalives while the others start
        identity = self.workers.identity
        assert identity is not None
        cap = self.capacity()
        logger.info(
            "router: serving with %s; context %d, page %d, pools %s, layout %s, model %s",
            ", ".join(f"{e.role} {e.worker_id}" for e in self.workers.up()),
            cap.context_length,
            cap.page_size,
            {e.worker_id: e.reg.pool_tokens for e in self.workers.up()},
            identity.layout_fingerprint,
            identity.model_fingerprint,
        )

    def start(self) -> None:
        """Start the receiver thread (after `wait_for_workers`)."""
        assert self.workers.capacity() is not None, "call wait_for_workers() first"
        if self._receiver is None:
            self._started = True
            self._receiver = threading.Thread(target=self._receive_loop, name="kvfence-router-recv", daemon=True)
            self._receiver.start()

    def close(self, notify_workers: bool = True) -> None:
        """Stop receiving; fail the requests still in flight; tell the workers to stop (unless `notify_workers`
        is False: then they see their router vanish, as after a crash, and register with the next one)."""
        if self._stop.is_set():
            return
        if notify_workers:
            with self._lock:
                ids = [e.worker_id for e in self.workers.up()]
            for wid in ids:
                self.hub.send(wid, P.Shutdown())
        self._stop.set()
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        with self._lock:
            flights = [f for f in self._flights.values() if f.live]
        for flight in flights:
            self._fail_flight(flight, "router", "router shutting down")
        self.hub.close()

    # -- EngineClient ---------------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        identity = self.workers.identity
        return identity.model_name if identity is not None else "unknown"

    def capacity(self) -> Capacity:
        with self._lock:
            cap = self.workers.capacity()
        assert cap is not None, "router has no workers yet"
        return cap

    @property
    def vocab_size(self) -> int | None:
        """Token ids every worker accepts are [0, vocab_size); None until a worker registered one."""
        identity = self.workers.identity
        return (identity.vocab_size or None) if identity is not None else None

    def check_token_ids(self, prompt: list[int]) -> None:
        """Refuse (HTTP 400) a prompt with an id outside the vocabulary, before any worker sees it."""
        vocab = self.vocab_size
        bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            limit = f"[0, {vocab})" if vocab is not None else "[0, ...)"
            raise InvalidRequestError(f"prompt: token id {bad} is outside the vocabulary {limit}", param="prompt")

    def healthy(self) -> dict[str, bool]:
        """Role -> whether at least one worker of that role is up."""
        with self._lock:
            return {role: self.workers.count(role) > 0 for role in ROLES}

    def _down_reason(self, role: str) -> str:
        with self._lock:
            down = [e for e in self.workers.entries.values() if e.role == role and not e.up]
        return "; ".join(f"{e.worker_id}: {e.down_reason}" for e in down[-3:]) or "none registered"

    def check_health(self) -> None:
        """Raise (HTTP 503 on /health and on new requests) when a role has no worker up."""
        for role, ok in self.healthy().items():
            if not ok:
                self._unavailable(f"no healthy {role} worker ({self._down_reason(role)})")

    @staticmethod
    def _unavailable(message: str) -> None:
        from kvfence.server.http import ApiError

        raise ApiError(503, message, type="server_error", code="no_healthy_worker")

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.check_health()  # HTTP 503 while a role has no live worker
        prompt = [int(t) for t in prompt_token_ids]
        self.check_token_ids(prompt)  # raises InvalidRequestError (HTTP 400)
        max_tokens = admit(len(prompt), params.max_tokens, self.capacity())  # ContextLengthExceededError (400)
        self.start()
        flight = _Flight(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            tokens_expected=len(prompt),  # the router's own count of what it admitted (invariant 2, docs/handoff.md)
            token_hash=token_hash(prompt),  # likewise, from the ids it admitted
            transfer_id=new_transfer_id(),  # a fresh capability: only this prefill may hand this decode the KV
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            started=self._clock(),
        )
        need = len(prompt) + max_tokens
        with self._lock:
            if request_id in self._flights:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            now = self._clock()
            decode = self.workers.pick_decode(need, now)
            prefill = self.workers.pick_prefill(len(prompt), now)
            if decode is None or prefill is None:  # the worker that could hold it went down since admission
                role, n = ("decode", need) if decode is None else ("prefill", len(prompt))
                self._unavailable(f"no healthy {role} worker can hold {n} tokens")
            assert decode is not None and prefill is not None
            self.workers.order(decode, now, pages=self.workers.pages_for(need))
            self.workers.order(prefill, now, tokens=len(prompt))
            flight.decode_id, flight.prefill_id = decode.worker_id, prefill.worker_id  # PREFILLING from here
            self._flights[request_id] = flight
            self._sources[request_id] = _Source(prefill.worker_id, decode.worker_id, now)
        # Both at once: decode reserves pages for the router's expectation while prefill computes the prompt.
        # Prefill sends nothing before decode's DecodeReserved reaches it (relayed in _dispatch), so decode
        # never sees a transfer it has not reserved for. The order goes out first: the hub delivers each
        # worker's messages in the order they were sent, so the relay can never overtake it.
        self.hub.send(
            flight.prefill_id,
            P.PrefillOrder(
                request_id=request_id,
                prompt_token_ids=prompt,
                transfer_id=flight.transfer_id,
                params=P.params_to_wire(params),
                handoff_address="",  # decode's DecodeReserved follows with it
                transfer_info={},
                deadline_s=self.config.handoff_deadline_s,
            ),
        )
        self.hub.send(
            flight.decode_id,
            P.DecodePrepare(
                request_id=request_id,
                prompt_token_ids=prompt,
                tokens_expected=flight.tokens_expected,
                token_hash=flight.token_hash,
                transfer_id=flight.transfer_id,
                params=P.params_to_wire(params),
                deadline_s=self.config.handoff_deadline_s,
            ),
        )
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(flight.queue.get(), timeout=self.config.request_timeout_s)
                except asyncio.TimeoutError:
                    detail = (
                        f"no progress from the workers for {self.config.request_timeout_s:.0f}s ({flight.state.value})"
                    )
                    self._abort_both(flight, detail)
                    yield self._error_chunk(flight, detail, self._router_record(flight, Reason.TIMEOUT, detail))
                    return
                if isinstance(msg, P.FirstToken):
                    if flight.num_output_tokens == 0 and flight.live:
                        if msg.prompt_logprobs is not None:
                            flight.prompt_logprobs = msg.prompt_logprobs
                        if self._streams_first(flight, msg):
                            yield self._first_chunk(flight, msg)
                    continue
                if isinstance(msg, P.Tokens):
                    if flight.streamed_first is not None and not flight.first_dropped and msg.token_ids:
                        flight.first_dropped = True
                        rest = _without_first(msg, flight.streamed_first)
                        if rest is None:
                            detail = (
                                f"decode's first token {msg.token_ids[0]} ({msg.text!r}) is not the "
                                f"{flight.streamed_first.first_token} ({flight.streamed_first.text!r}) streamed from "
                                "prefill"
                            )
                            if msg.integrity is not None:
                                record = self._wire_record(flight, msg.integrity)
                            else:
                                record = self._router_record(flight, Reason.TRANSFER_ERROR, detail)
                            self._abort_both(flight, detail)
                            yield self._error_chunk(flight, f"{detail} ({flight.pair})", record)
                            return
                        msg = rest
                        if not (msg.token_ids or msg.text or msg.finished or msg.error):
                            if msg.integrity is not None:
                                flight.decode_record = self._wire_record(flight, msg.integrity)
                            continue  # it only repeated the token streamed already (its record is kept)
                    if msg.integrity is not None:
                        flight.decode_record = self._wire_record(flight, msg.integrity)
                    flight.num_output_tokens += len(msg.token_ids)
                    chunk = GenerationChunk(
                        token_ids=list(msg.token_ids),
                        text=msg.text,
                        finished=msg.finished,
                        finish_reason=msg.finish_reason,
                        num_prompt_tokens=flight.tokens_expected,
                        num_output_tokens=flight.num_output_tokens,
                        logprobs=P.logprobs_from_wire(msg.logprobs),  # type: ignore[arg-type]
                        prompt_logprobs=P.logprobs_from_wire(flight.prompt_logprobs),
                        error=msg.error,
                    )
                    flight.prompt_logprobs = None  # they ride on the first chunk only
                    if msg.finished:
                        record = flight.decode_record or self._router_record(
                            flight, Reason.ABORTED, msg.error or f"finished ({msg.finish_reason}) without a record"
                        )
                        chunk.integrity = self._finish(flight, record)
                        yield chunk
                        return
                    yield chunk
                elif isinstance(msg, P.RequestFailed):
                    if msg.integrity is not None:
                        record = self._wire_record(flight, msg.integrity)
                    else:
                        reason = Reason.TIMEOUT if msg.reason.startswith("timeout") else Reason.TRANSFER_ERROR
                        record = self._router_record(flight, reason, f"{msg.role}: {msg.reason}")
                    wid = flight.decode_id if msg.role == "decode" else flight.prefill_id
                    message = f"{msg.role} worker {wid}: {msg.reason} ({flight.pair})"
                    yield self._error_chunk(flight, message, record, msg.code or "generation_failed")
                    return
                elif isinstance(msg, _Failure):
                    reason = Reason.TIMEOUT if msg.code == "timeout" else Reason.TRANSFER_ERROR
                    record = self._router_record(flight, reason, f"{msg.role}: {msg.reason}")
                    yield self._error_chunk(flight, f"{msg.reason} ({flight.pair})", record, msg.code)
                    return
        finally:
            if not flight.finished:  # the client went away (generator closed or cancelled)
                self._abort_both(flight, "client disconnected")
                self._finish(flight, self._router_record(flight, Reason.ABORTED, "client disconnected"))
            with self._lock:
                self._flights.pop(request_id, None)

    def _streams_first(self, flight: _Flight, msg: P.FirstToken) -> bool:
        """Whether prefill's first token goes to the client before decode's verdict.

        Not when prefill could not say its text, nor with stop strings: their text may be held back or cut, which
        only decode's detokenizer decides. A first token that ends the request (max_tokens=1, eos, a stop token id)
        still streams; decode's first chunk then only adds the finish reason and the record.
        """
        return self.config.first_token_before_verdict and msg.text is not None and not flight.params.stop

    def _first_chunk(self, flight: _Flight, msg: P.FirstToken) -> GenerationChunk:
        """Prefill's first token, streamed while the KV travels; decode's first chunk repeats it (dropped then)."""
        assert msg.text is not None  # _streams_first
        flight.streamed_first = msg
        flight.num_output_tokens = 1
        chunk = GenerationChunk(
            token_ids=[msg.first_token],
            text=msg.text,
            finished=False,
            finish_reason=None,
            num_prompt_tokens=flight.tokens_expected,
            num_output_tokens=1,
            logprobs=P.logprobs_from_wire([msg.first_logprobs]) if msg.first_logprobs is not None else None,
            prompt_logprobs=P.logprobs_from_wire(flight.prompt_logprobs),
        )
        flight.prompt_logprobs = None  # they ride on the first chunk only
        return chunk

    async def abort(self, request_id: str) -> None:
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None or flight.finished:
            return
        self._abort_both(flight, "aborted by client")
        self._finish(flight, self._router_record(flight, Reason.ABORTED, "aborted by client"))
        chunk = P.Tokens(request_id, [], finished=True, finish_reason="abort")  # the stream ends with that record
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, chunk)

    def server_info(self) -> dict[str, Any]:
        with self._lock:
            cap = self.workers.capacity()
            identity = self.workers.identity
            entries = list(self.workers.entries.values())
        roles: dict[str, Any] = {}
        for role in ROLES:
            up = [e for e in entries if e.role == role and e.up]
            if not up:
                continue
            largest = max(up, key=lambda e: e.reg.pool_tokens).reg
            roles[role] = {
                "workers": [e.worker_id for e in up],
                "context_length": largest.context_length,
                "max_total_tokens": largest.pool_tokens,
                "page_size": largest.page_size,
                "dtype": largest.dtype,
                "model_fingerprint": largest.model_fingerprint,
                "layout_fingerprint": largest.layout_fingerprint,
                "layout": largest.layout,
                **{k: v for k, v in largest.settings.items() if k not in ("pid", "host", "num_pages")},
            }
        workers = {
            e.worker_id: {
                "role": e.role,
                "up": e.up,
                "max_total_tokens": e.reg.pool_tokens,
                "num_pages": e.pool_pages,
                "handoff_address": e.reg.handoff_address,
                "pid": e.reg.settings.get("pid"),
                "host": e.reg.settings.get("host"),
            }
            for e in entries
        }
        return {
            "mode": "disaggregated",
            "model_name": self.model_name,
            "vocab_size": self.vocab_size,
            "context_length": cap.context_length if cap else None,
            "page_size": cap.page_size if cap else None,
            "max_total_tokens": dict(cap.max_total_tokens) if cap else {},
            "digest_algorithm": DIGEST_ALGORITHM,
            "router": dataclasses.asdict(self.config),
            "auth": {
                **self.auth,
                "control_plane": "zeromq-curve" if self.auth.get("enabled") else "off",
                "data_plane": "hmac-sha256 handshake + frame macs" if self.auth.get("enabled") else "off",
                "manifests": "hmac-sha256" if self.auth.get("enabled") else "off",
                "transfer_ids": "router-issued, 128-bit",
                "encrypted": "control plane only" if self.auth.get("enabled") else "nothing",
            },
            "roles": roles,
            "workers": workers,
            "model_fingerprint": identity.model_fingerprint if identity else None,
        }

    def security_event_counts(self) -> dict[str, dict[str, int]]:
        """Source -> kind -> count: this router's security events and the last counts each worker reported."""
        with self._lock:
            workers = {wid: dict(e.stats.get("security_events") or {}) for wid, e in self.workers.entries.items()}
        return {"router": self.security_events.counts(), **{w: c for w, c in workers.items() if c}}

    def stats(self) -> dict[str, Any]:
        """Per role (summed over its up workers that reported) and per worker: pages, requests, load."""
        now = self._clock()
        with self._lock:
            workers = self.workers.describe(now)
            in_flight = len(self._flights)
            page_size = self.workers.identity.page_size if self.workers.identity is not None else None
        roles: dict[str, Any] = {}
        num_running = num_waiting = 0
        for w in workers.values():
            if not w["up"] or "pages_total" not in w:
                continue
            r = roles.setdefault(w["role"], {"workers": 0, "page_size": page_size})
            r["workers"] += 1
            for k in ("pages_total", "pages_used", "pages_free", "pages_quarantined"):
                r[k] = r.get(k, 0) + int(w.get(k, 0))
            num_running += int(w.get("num_running", 0))
            num_waiting += int(w.get("num_waiting", 0))
        return {
            "roles": roles,
            "num_running": num_running,
            "num_waiting": num_waiting,
            "in_flight": in_flight,
            "transfers": dict(self.transfer_counts),
            "integrity": dict(self.integrity_counts),
            "workers": workers,
            "healthy": self.healthy(),
            "worker_deaths": dict(self.worker_deaths),
        }

    # -- receiver thread ------------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.hub.recv(timeout=0.2)
            except Exception:  # a closed hub at shutdown
                if self._stop.is_set():
                    return
                logger.exception("router: receive failed")
                continue
            backlog = 0
            while got is not None:  # catch up with the inbox before judging any worker silent
                try:
                    self._dispatch(*got)
                except Exception:
                    logger.exception("router: failed to handle %s from %s", got[1].kind, got[0])
                backlog += 1
                try:
                    got = self.hub.recv(timeout=0.0) if backlog < MAX_BACKLOG else None
                except Exception:  # a closed hub at shutdown: the outer recv says so
                    got = None
            self._check_deadlines()
            self._check_workers()

    def _dispatch(self, wid: str, msg: P.Message) -> None:
        if isinstance(msg, P.Register):
            self.registrar.register(wid, msg, self._started, self._declare_dead)
            return
        now = self._clock()
        with self._lock:
            entry = self.workers.get(wid)
            if entry is not None:
                self.workers.heard(wid, now)
        if entry is None:  # a worker we do not know (we restarted) or declared dead: it must register again
            self.registrar.unknown(wid, now)
            return
        if isinstance(msg, P.WorkerStats):
            with self._lock:
                self.workers.report(wid, msg.stats, now)
            return
        if isinstance(msg, P.HandoffSettled):  # even after the client got its answer: prefill must free
            self.transfer_counts["ok" if msg.verified else "failed"] += 1
            with self._lock:
                source = self._sources.get(msg.request_id)
                if source is not None and source.decode_id == wid:
                    del self._sources[msg.request_id]
                else:
                    source = None
            if source is not None:
                self.hub.send(source.prefill_id, P.ReleaseSource(msg.request_id, msg.verified))
            return
        rid = getattr(msg, "request_id", None)
        with self._lock:
            flight = self._flights.get(rid) if rid is not None else None
            source = self._sources.get(rid) if rid is not None else None
        if flight is not None and wid not in (flight.decode_id, flight.prefill_id):
            logger.warning("router: ignoring %s for %s from %s (not its worker)", msg.kind, rid, wid)
            return
        if isinstance(msg, P.RequestFailed):
            # tell the other side first, whatever the client is doing
            if flight is not None:
                pair = (flight.prefill_id, flight.decode_id)
            else:
                pair = (source.prefill_id, source.decode_id) if source is not None else ("", "")
            other = pair[1] if wid == pair[0] else pair[0]
            if other:
                self.hub.send(other, P.Abort(msg.request_id, f"{msg.role} failed: {msg.reason}"))
            with self._lock:
                self._sources.pop(msg.request_id, None)
        if flight is None or flight.finished:
            if isinstance(msg, P.DecodeReserved):  # reserved for a request that is gone: give it back
                self.hub.send(wid, P.Abort(msg.request_id, "request gone before prefill"))
            return
        if isinstance(msg, P.DecodeReserved):
            if wid == flight.decode_id:  # prefill may send now, to where decode listens
                self.hub.send(flight.prefill_id, msg)
            return
        if isinstance(msg, P.FirstToken):
            if wid != flight.prefill_id:
                return
            flight.first = msg
        elif isinstance(msg, P.PrefillSent):
            if wid != flight.prefill_id:
                return
            first = flight.first
            if first is not None and first.first_token != msg.first_token:  # two messages of prefill's must agree
                detail = f"prefill's first token differs: {first.first_token} first, {msg.first_token} when sent"
                self._fail_flight(flight, "prefill", detail)
                return
            self._advance(flight, _F.DECODING, when=(_F.PREFILLING,))
            flight.prefill_sent = msg
            if msg.prompt_logprobs is not None:  # a prefill that sends them here rather than in FirstToken
                flight.prompt_logprobs = msg.prompt_logprobs
            # decode needs prefill's first token (and its scores); the prompt's scores only go to the client
            self.hub.send(flight.decode_id, dataclasses.replace(msg, prompt_logprobs=None))
        elif isinstance(msg, P.Tokens) and wid != flight.decode_id:
            return
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, msg)

    def _check_deadlines(self) -> None:
        """Handoffs that did not verify in time fail here (decode and prefill also time out on their own)."""
        now = self._clock()
        limit = self.config.handoff_deadline_s + 5.0  # workers get the first chance to report
        with self._lock:
            late = [f for f in self._flights.values() if f.state is _F.PREFILLING and now - f.started > limit]
            for rid, src in list(self._sources.items()):
                if now - src.since > 3 * limit:  # its settle message was lost; prefill's own deadline freed the pages
                    del self._sources[rid]
        for flight in late:
            self._fail_flight(flight, "router", self._lateness(flight), code="timeout")

    def _lateness(self, flight: _Flight) -> str:
        """Why a flight missed its handoff deadline, as far as the router can tell: prefill never computed the
        prompt (with what its last load report said), or the handoff did not finish after it had."""
        limit = f"{self.config.handoff_deadline_s:g}s"
        if flight.first is not None:
            return f"KV handoff did not complete within {limit} (prefill had computed the prompt)"
        with self._lock:
            e = self.workers.get(flight.prefill_id)
            s = dict(e.stats) if e is not None else {}
        load = ""
        if s:
            load = (
                f"; its last report: {s.get('queued_prompt_tokens', '?')} prompt tokens queued, "
                f"{s.get('pages_free', '?')} of {s.get('pages_total', '?')} KV pages free, "
                f"{s.get('handoffs_in_flight', '?')} handoffs holding pages"
            )
        return f"prefill worker {flight.prefill_id} did not compute the prompt within {limit}{load}"

    # -- worker health --------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        """Keepalives out; a worker silent for `worker_timeout_s` is declared dead."""
        for wid, detail in self.registrar.keepalive(self._clock()):
            self._declare_dead(wid, detail)

    def _declare_dead(self, wid: str, detail: str) -> None:
        """Fail every request that still needs worker `wid`; new requests go to the other workers."""
        with self._lock:
            entry = self.workers.mark_down(wid, detail)
            if entry is None:
                return
            flights = [f for f in self._flights.values() if f.live]
            orphans = [(rid, src.prefill_id) for rid, src in self._sources.items() if src.decode_id == wid]
            for rid in [rid for rid, src in self._sources.items() if wid in (src.prefill_id, src.decode_id)]:
                del self._sources[rid]
        role = entry.role
        self.worker_deaths[role] += 1
        logger.error("router: %s worker %s declared dead: %s", role, wid, detail)
        for flight in flights:
            needs = (
                flight.decode_id == wid
                if role == "decode"
                else flight.state is _F.PREFILLING and flight.prefill_id == wid
            )
            if needs:
                self._fail_flight(flight, role, detail, code=WORKER_LOST)
        for rid, prefill_id in orphans:  # answered already, but prefill still holds the source pages
            self.hub.send(prefill_id, P.Abort(rid, detail))

    def _fail_flight(self, flight: _Flight, role: str, detail: str, code: str = "generation_failed") -> None:
        """End `flight` with an error chunk (via its queue) and tell both its workers to drop it (unless the event
        loop finished it meanwhile)."""
        if not self._advance(flight, _F.FAILING, when=(_F.PREFILLING, _F.DECODING)):
            return
        self._abort_both(flight, f"{role}: {detail}")
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, _Failure(flight.request_id, role, detail, code))

    # -- helpers --------------------------------------------------------------------------------------------
    def _advance(self, flight: _Flight, new: FlightState, when: tuple[FlightState, ...]) -> bool:
        """Move `flight` to `new` if it is in one of `when`, checked under the lock (the receiver thread and the
        event loop both move flights); False when the other thread moved it on first. Any other step is still
        checked against FLIGHT_TRANSITIONS."""
        with self._lock:
            if flight.state not in when:
                return False
            flight.advance(new)
            return True

    def _abort_both(self, flight: _Flight, reason: str) -> None:
        for wid in (flight.decode_id, flight.prefill_id):
            if wid:
                self.hub.send(wid, P.Abort(flight.request_id, reason))
        with self._lock:
            self._sources.pop(flight.request_id, None)

    def _router_record(self, flight: _Flight, reason: Reason, detail: str) -> IntegrityRecord:
        """The record of a request that ended without one from decode (abort, timeout, a worker lost).

        A request aborted after decode verified its handoff keeps decode's record: the
        record is about the handoff, which did verify.
        """
        if flight.decode_record is not None and reason == Reason.ABORTED:
            return flight.decode_record
        identity = self.workers.identity
        return IntegrityRecord(
            request_id=flight.request_id,
            status="failed",
            reason=reason.value,
            detail=detail,
            tokens_expected=flight.tokens_expected,
            tokens_covered=0,
            pages=0,
            layout_fingerprint=identity.layout_fingerprint if identity is not None else "",
            role="router",
        )

    def _wire_record(self, flight: _Flight, data: dict[str, Any]) -> IntegrityRecord:
        """A worker's record of the handoff; one that does not parse becomes a failed record saying so."""
        try:
            return IntegrityRecord.from_dict(data)
        except ValueError as e:
            logger.error("router: %s: malformed integrity record from a worker: %s", flight.request_id, e)
            return self._router_record(flight, Reason.TRANSFER_ERROR, f"malformed integrity record from a worker: {e}")

    def _error_chunk(
        self, flight: _Flight, message: str, record: IntegrityRecord, code: str = "generation_failed"
    ) -> GenerationChunk:
        return GenerationChunk(
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=flight.tokens_expected,
            num_output_tokens=flight.num_output_tokens,
            integrity=self._finish(flight, record),
            error=message,
            extra={"code": code},
        )

    def _finish(self, flight: _Flight, record: IntegrityRecord) -> dict[str, Any]:
        """The one place a request's integrity record is logged and counted (invariant 8, docs/handoff.md); returns
        its API form."""
        with self._lock:
            if flight.finished:
                assert flight.record is not None  # FINISHED is entered only here, with the record
                return flight.record.to_api()
            flight.advance(_F.FINISHED)
            if flight.streamed_first is not None:  # the client had that token before the verdict
                record = dataclasses.replace(record, tokens_before_verdict=1)
            flight.record = record
        self.integrity_counts[record.status] += 1
        self.integrity_metrics.observe(record)
        with self._lock:
            self.records.append(record)
            del self.records[:-1000]
        integrity_logger.info(record.to_json())
        return record.to_api()
