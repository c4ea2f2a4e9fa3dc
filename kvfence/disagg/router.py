"""The router: the front end's engine in disaggregated mode, pairing one prefill and one decode worker.

What it knows: the workers that registered (role, capacity, layout and model
fingerprints) and whether a pair of them may exchange KV at all (same context length,
page size, dtype, layout and model; each role's pool holding one full context); each
request in flight and where it stands (decode reserving, prefill running, tokens
streaming); the expected prompt length and token hash, which it computes itself from
the ids the API layer admitted, so prefill never vouches for its own prompt. It
implements `EngineClient`, so the HTTP app serves it exactly as it serves one engine.
Log probabilities of the prompt come from prefill (in `PrefillSent`) and ride on the
request's first chunk; those of the output come with decode's tokens. It ends every
request with one integrity record (JSON log line + the final chunk + the counters in
`stats()`), and relays aborts and failures to the other side.

Worker health: every worker sends `WorkerStats` a few times a second and the router
sends each worker a keepalive (`RegisterReply(accepted=True, reason=HEARTBEAT)`). A
worker silent for `worker_timeout_s` is declared dead: the requests that still need it
fail at once with an error naming the worker (the surviving side is told to drop them
and free their pages), and new requests get HTTP 503 with an OpenAI-style error body
until a worker of that role registers (a replacement, or the same worker again). A
message from a worker the router does not know (the router restarted, or declared
that worker dead) is answered `RegisterReply(accepted=False, reason=REREGISTER ...)`:
the worker drops what it holds and registers afresh.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfence.disagg import protocol as P
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError, InvalidRequestError
from kvfence.integrity.digest import DIGEST_ALGORITHM, token_hash
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import Reason
from kvfence.server.admission import admit, build_capacity, check_role_settings, role_capacity
from kvfence.server.engine_client import Capacity, GenerationChunk

logger = logging.getLogger(__name__)
integrity_logger = logging.getLogger("kvfence.integrity")

HEARTBEAT = "heartbeat"  # reason of the router's keepalive RegisterReply
REREGISTER = "re-register"  # prefix of the reason telling an unknown worker to register again
ROLES = ("prefill", "decode")


class Hub(Protocol):
    def send(self, worker_id: str, msg: P.Message) -> None: ...
    def recv(self, timeout: float | None = 0.0) -> tuple[str, P.Message] | None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class RouterConfig:
    handoff_deadline_s: float = 60.0  # decode must have verified the KV this long after the order (flag)
    request_timeout_s: float = 300.0  # a request with no news from any worker for this long is failed (flag)
    register_timeout_s: float = 300.0  # how long to wait at start for one prefill and one decode worker
    worker_timeout_s: float = 10.0  # a worker silent this long is declared dead (flag)
    heartbeat_interval_s: float = 0.5  # router -> worker keepalive period
    allow_context_above_pool: bool = False
    model_name: str | None = None  # name served to clients; default: the workers' model name

    def __post_init__(self) -> None:
        assert self.handoff_deadline_s > 0 and self.request_timeout_s > 0 and self.register_timeout_s > 0
        assert self.worker_timeout_s > self.heartbeat_interval_s > 0


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return params.to_dict()


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams.from_dict(d)


def check_pair(prefill: P.Register, decode: P.Register) -> None:
    """Refuse a prefill/decode pair that cannot exchange KV; the message names both values."""
    check_role_settings(_pairing_info(prefill), _pairing_info(decode))
    if prefill.vocab_size != decode.vocab_size:
        raise CapacityConfigError(
            f"prefill and decode workers disagree on the vocabulary (prefill={prefill.vocab_size} "
            f"decode={decode.vocab_size} token ids); start both with the same --model"
        )
    p_transport, d_transport = prefill.settings.get("transport", "tcp"), decode.settings.get("transport", "tcp")
    if p_transport != d_transport:
        raise CapacityConfigError(
            f"prefill and decode workers use different KV transfer backends (prefill={p_transport!r} "
            f"decode={d_transport!r}); start both with the same --transfer-backend"
        )


def _pairing_info(reg: P.Register) -> dict[str, Any]:
    return {
        "context_length": reg.context_length,
        "page_size": reg.page_size,
        "dtype": reg.dtype,
        "model_fingerprint": reg.model_fingerprint,
        "layout_fingerprint": reg.layout_fingerprint,
    }


def check_registration(reg: P.Register, allow_context_above_pool: bool = False) -> None:
    """A role whose context length exceeds its own pool is refused."""
    if reg.role not in ("prefill", "decode"):
        raise CapacityConfigError(f"worker {reg.worker_id} registered with unknown role {reg.role!r}")
    if reg.pool_tokens % reg.page_size:
        raise CapacityConfigError(f"{reg.role}: pool of {reg.pool_tokens} tokens is not whole pages of {reg.page_size}")
    role_capacity(
        reg.role, reg.context_length, reg.pool_tokens // reg.page_size, reg.page_size, allow_context_above_pool
    )


@dataclass
class _Flight:
    """One request on its way through the router."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    expected_len: int
    token_hash: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[P.Message]
    started: float = field(default_factory=time.monotonic)
    phase: str = "reserving"  # reserving -> prefilling -> decoding -> done
    decode_id: str = ""  # the workers serving this request
    prefill_id: str = ""  # set when the prefill order goes out
    done: bool = False
    num_output_tokens: int = 0
    prefill_sent: P.PrefillSent | None = None
    prompt_logprobs: list[Any] | None = None  # prefill's scores of the prompt (wire form), for the first chunk
    record: IntegrityRecord | None = None  # the integrity record, once finished
    decode_record: IntegrityRecord | None = None  # decode's record of the handoff, once it sent one


class Router:
    """EngineClient over one prefill and one decode worker, reached through a `Hub`."""

    def __init__(self, hub: Hub, config: RouterConfig | None = None) -> None:
        self.hub = hub
        self.config = config or RouterConfig()
        self.prefill: P.Register | None = None
        self.decode: P.Register | None = None
        self._capacity: Capacity | None = None
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._worker_stats: dict[str, dict[str, Any]] = {}
        self.integrity_counts: Counter[str] = Counter()
        self.transfer_counts: Counter[str] = Counter()
        self.records: list[IntegrityRecord] = []  # last records (bounded), for tests
        self.integrity_metrics = IntegrityMetrics()  # Prometheus counters, in a registry of this router
        self._receiver: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_seen: dict[str, float] = {}  # worker id -> monotonic time of its last message
        self._down: dict[str, str] = {}  # role -> why it has no healthy worker (until one registers)
        self._told_reregister: dict[str, float] = {}  # worker id -> when we last asked it to register again
        self._last_heartbeat = 0.0
        self.worker_deaths: Counter[str] = Counter()  # role -> workers declared dead

    # -- start-up -------------------------------------------------------------
    def wait_for_workers(self, timeout: float | None = None) -> None:
        """Block until one prefill and one decode worker registered and were accepted as a pair."""
        timeout = timeout if timeout is not None else self.config.register_timeout_s
        deadline = time.monotonic() + timeout
        pending: dict[str, P.Register] = {}
        while self.prefill is None or self.decode is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ("prefill", "decode") if getattr(self, r) is None]
                raise CapacityConfigError(
                    f"router: no {' and no '.join(missing)} worker registered within {timeout:.0f}s"
                )
            got = self.hub.recv(timeout=min(left, 0.5))
            if got is None:
                continue
            wid, msg = got
            if not isinstance(msg, P.Register):
                logger.warning("router: ignoring %s from %s before registration", msg.kind, wid)
                continue
            try:
                check_registration(msg, self.config.allow_context_above_pool)
                if getattr(self, msg.role) is not None:
                    raise CapacityConfigError(
                        f"router: a {msg.role} worker is already registered; one of each is served"
                    )
            except CapacityConfigError as e:
                self.hub.send(wid, P.RegisterReply(accepted=False, reason=str(e)))
                raise
            pending[msg.role] = msg
            setattr(self, msg.role, msg)
            if self.prefill is not None and self.decode is not None:
                try:
                    check_pair(self.prefill, self.decode)
                except CapacityConfigError as e:
                    for reg in (self.prefill, self.decode):
                        self.hub.send(reg.worker_id, P.RegisterReply(accepted=False, reason=str(e)))
                    raise
        assert self.prefill is not None and self.decode is not None
        self._capacity = build_capacity(
            min(self.prefill.context_length, self.decode.context_length),
            {
                "prefill": (self.prefill.pool_tokens // self.prefill.page_size, self.prefill.page_size),
                "decode": (self.decode.pool_tokens // self.decode.page_size, self.decode.page_size),
            },
            self.config.allow_context_above_pool,
        )
        for reg in (self.prefill, self.decode):
            self._last_seen[reg.worker_id] = time.monotonic()
            self.hub.send(reg.worker_id, P.RegisterReply(accepted=True))
        logger.info(
            "router: paired prefill %s (pool %d tokens) with decode %s (pool %d tokens); context %d, page %d, "
            "layout %s, model %s",
            self.prefill.worker_id,
            self.prefill.pool_tokens,
            self.decode.worker_id,
            self.decode.pool_tokens,
            self._capacity.context_length,
            self._capacity.page_size,
            self.decode.layout_fingerprint,
            self.decode.model_fingerprint,
        )

    def start(self) -> None:
        """Start the receiver thread (after `wait_for_workers`)."""
        assert self._capacity is not None, "call wait_for_workers() first"
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive_loop, name="kvfence-router-recv", daemon=True)
            self._receiver.start()

    def close(self, notify_workers: bool = True) -> None:
        """Stop receiving; fail the requests still in flight; tell the workers to stop (unless `notify_workers`
        is False: then they see their router vanish, as after a crash, and register with the next one)."""
        if self._stop.is_set():
            return
        if notify_workers:
            for reg in (self.prefill, self.decode):
                if reg is not None:
                    self.hub.send(reg.worker_id, P.Shutdown())
        self._stop.set()
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        with self._lock:
            flights = [f for f in self._flights.values() if not f.done]
        for flight in flights:
            self._fail_flight(flight, "router", "router shutting down")
        self.hub.close()

    # -- EngineClient ---------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        return self.decode.model_name if self.decode is not None else "unknown"

    def capacity(self) -> Capacity:
        assert self._capacity is not None, "router has no workers yet"
        return self._capacity

    @property
    def vocab_size(self) -> int | None:
        """Token ids the paired workers accept are [0, vocab_size); None until a decode worker registered one."""
        return (self.decode.vocab_size or None) if self.decode is not None else None

    def check_token_ids(self, prompt: list[int]) -> None:
        """Refuse (HTTP 400) a prompt with an id outside the vocabulary, before any worker sees it."""
        vocab = self.vocab_size
        bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            limit = f"[0, {vocab})" if vocab is not None else "[0, ...)"
            raise InvalidRequestError(f"prompt: token id {bad} is outside the vocabulary {limit}", param="prompt")

    def healthy(self) -> dict[str, bool]:
        """Role -> whether a live worker of that role is registered."""
        return {role: getattr(self, role) is not None and role not in self._down for role in ROLES}

    def check_health(self) -> None:
        """Raise (HTTP 503 on /health and on new requests) when a role has no healthy worker."""
        for role in ROLES:
            if getattr(self, role) is None or role in self._down:
                from kvfence.server.api import ApiError

                why = self._down.get(role, "none registered")
                raise ApiError(503, f"no healthy {role} worker ({why})", type="server_error", code="no_healthy_worker")

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.check_health()  # HTTP 503 while a role has no live worker
        assert self.prefill is not None and self.decode is not None, "router has no workers yet"
        prompt = [int(t) for t in prompt_token_ids]
        self.check_token_ids(prompt)  # raises InvalidRequestError (HTTP 400)
        admit(len(prompt), params.max_tokens, self.capacity())  # raises ContextLengthExceededError (HTTP 400)
        if request_id in self._flights:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.start()
        flight = _Flight(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            expected_len=len(prompt),  # the router's own count of what it admitted
            token_hash=token_hash(prompt),  # likewise, from the ids it admitted
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            decode_id=self.decode.worker_id,
        )
        with self._lock:
            self._flights[request_id] = flight
        self.hub.send(
            self.decode.worker_id,
            P.DecodePrepare(
                request_id=request_id,
                prompt_token_ids=prompt,
                expected_len=flight.expected_len,
                token_hash=flight.token_hash,
                params=params_to_dict(params),
                deadline_s=self.config.handoff_deadline_s,
            ),
        )
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(flight.queue.get(), timeout=self.config.request_timeout_s)
                except asyncio.TimeoutError:
                    detail = f"no progress from the workers for {self.config.request_timeout_s:.0f}s ({flight.phase})"
                    self._abort_both(flight, detail)
                    yield self._error_chunk(flight, detail, self._router_record(flight, Reason.TIMEOUT, detail))
                    return
                if isinstance(msg, P.Tokens):
                    if msg.integrity is not None:
                        flight.decode_record = IntegrityRecord(**msg.integrity)
                    flight.num_output_tokens += len(msg.token_ids)
                    chunk = GenerationChunk(
                        token_ids=list(msg.token_ids),
                        text=msg.text,
                        finished=msg.finished,
                        finish_reason=msg.finish_reason,
                        num_prompt_tokens=flight.expected_len,
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
                        record = IntegrityRecord(**msg.integrity)
                    else:
                        reason = Reason.TIMEOUT if msg.reason.startswith("timeout") else Reason.TRANSFER_ERROR
                        record = self._router_record(flight, reason, f"{msg.role}: {msg.reason}")
                    yield self._error_chunk(flight, f"{msg.role} worker: {msg.reason}", record)
                    return
        finally:
            if not flight.done:  # the client went away (generator closed or cancelled)
                self._abort_both(flight, "client disconnected")
                self._finish(flight, self._router_record(flight, Reason.ABORTED, "client disconnected"))
            with self._lock:
                self._flights.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None or flight.done:
            return
        self._abort_both(flight, "aborted by client")
        self._finish(flight, self._router_record(flight, Reason.ABORTED, "aborted by client"))
        chunk = P.Tokens(request_id, [], finished=True, finish_reason="abort")  # the stream ends with that record
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, chunk)

    def server_info(self) -> dict[str, Any]:
        cap = self._capacity
        roles = {}
        for reg in (self.prefill, self.decode):
            if reg is not None:
                roles[reg.role] = {
                    "worker_id": reg.worker_id,
                    "context_length": reg.context_length,
                    "max_total_tokens": reg.pool_tokens,
                    "page_size": reg.page_size,
                    "dtype": reg.dtype,
                    "model_fingerprint": reg.model_fingerprint,
                    "layout_fingerprint": reg.layout_fingerprint,
                    "layout": reg.layout,
                    "handoff_address": reg.handoff_address,
                    **reg.settings,
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
            "roles": roles,
        }

    def stats(self) -> dict[str, Any]:
        roles: dict[str, Any] = {}
        num_running = num_waiting = 0
        for role in ("prefill", "decode"):
            s = self._worker_stats.get(role)
            if s is None:
                continue
            roles[role] = {
                k: s[k] for k in ("pages_total", "pages_used", "pages_free", "pages_quarantined", "page_size") if k in s
            }
            num_running += int(s.get("num_running", 0))
            num_waiting += int(s.get("num_waiting", 0))
        with self._lock:
            in_flight = len(self._flights)
        return {
            "roles": roles,
            "num_running": num_running,
            "num_waiting": num_waiting,
            "in_flight": in_flight,
            "transfers": dict(self.transfer_counts),
            "integrity": dict(self.integrity_counts),
            "workers": dict(self._worker_stats),
            "healthy": self.healthy(),
            "worker_deaths": dict(self.worker_deaths),
        }

    # -- receiver thread ------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.hub.recv(timeout=0.2)
            except Exception:  # a closed hub at shutdown
                if self._stop.is_set():
                    return
                logger.exception("router: receive failed")
                continue
            if got is not None:
                try:
                    self._dispatch(*got)
                except Exception:
                    logger.exception("router: failed to handle %s from %s", got[1].kind, got[0])
            self._check_deadlines()
            self._check_workers()

    def _dispatch(self, wid: str, msg: P.Message) -> None:
        assert self.prefill is not None and self.decode is not None
        if isinstance(msg, P.Register):
            self._register_late(wid, msg)
            return
        role = self._role_of(wid)
        if role is None:  # a worker we do not know (we restarted) or declared dead: it must register again
            now = time.monotonic()
            if now - self._told_reregister.get(wid, 0.0) > 1.0:
                self._told_reregister[wid] = now
                reason = f"{REREGISTER}: this router does not know worker {wid}; register again"
                self.hub.send(wid, P.RegisterReply(accepted=False, reason=reason))
            return
        self._last_seen[wid] = time.monotonic()
        if isinstance(msg, P.WorkerStats):
            self._worker_stats[msg.role] = msg.stats
            return
        if isinstance(msg, P.HandoffSettled):  # even after the client got its answer: prefill must free
            self.transfer_counts["ok" if msg.verified else "failed"] += 1
            self.hub.send(self.prefill.worker_id, P.ReleaseSource(msg.request_id, msg.verified))
            return
        rid = getattr(msg, "request_id", None)
        with self._lock:
            flight = self._flights.get(rid) if rid is not None else None
        if isinstance(msg, P.RequestFailed):
            # tell the other side first, whatever the client is doing
            other = self.prefill if msg.role == "decode" else self.decode
            self.hub.send(other.worker_id, P.Abort(msg.request_id, f"{msg.role} failed: {msg.reason}"))
        if flight is None or flight.done:
            if isinstance(msg, P.DecodeReserved):  # reserved for a request that is gone: give it back
                self.hub.send(self.decode.worker_id, P.Abort(msg.request_id, "request gone before prefill"))
            return
        if isinstance(msg, P.DecodeReserved):
            if "prefill" in self._down:  # raced with prefill's death: nobody can fill these pages
                self._fail_flight(flight, "prefill", f"no healthy prefill worker ({self._down['prefill']})")
                return
            flight.phase = "prefilling"
            flight.prefill_id = self.prefill.worker_id
            self.hub.send(
                self.prefill.worker_id,
                P.PrefillOrder(
                    request_id=flight.request_id,
                    prompt_token_ids=flight.prompt_token_ids,
                    params=params_to_dict(flight.params),
                    handoff_address=msg.handoff_address,
                    transfer_info=msg.transfer_info,
                    deadline_s=self.config.handoff_deadline_s,
                ),
            )
        elif isinstance(msg, P.PrefillSent):
            flight.phase = "decoding"
            flight.prefill_sent = msg
            flight.prompt_logprobs = msg.prompt_logprobs
            # decode needs prefill's first token (and its scores); the prompt's scores only go to the client
            self.hub.send(self.decode.worker_id, dataclasses.replace(msg, prompt_logprobs=None))
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, msg)

    def _check_deadlines(self) -> None:
        """Handoffs that did not verify in time fail here (decode and prefill also time out on their own)."""
        now = time.monotonic()
        limit = self.config.handoff_deadline_s + 5.0  # workers get the first chance to report
        with self._lock:
            late = [
                f for f in self._flights.values() if not f.done and f.phase != "decoding" and now - f.started > limit
            ]
        for flight in late:
            reason = f"KV handoff did not complete within {self.config.handoff_deadline_s:.0f}s (phase {flight.phase})"
            self._abort_both(flight, reason)
            flight.loop.call_soon_threadsafe(
                flight.queue.put_nowait, P.RequestFailed(flight.request_id, "router", reason)
            )
            flight.phase = "done"

    # -- worker health ----------------------------------------------------------
    def _role_of(self, wid: str) -> str | None:
        """The role of a live registered worker `wid`; None for unknown or dead ones."""
        for role in ROLES:
            reg = getattr(self, role)
            if reg is not None and reg.worker_id == wid and role not in self._down:
                return role
        return None

    def _check_workers(self) -> None:
        """Keepalives out; a worker silent for `worker_timeout_s` is declared dead."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.config.heartbeat_interval_s:
            self._last_heartbeat = now
            for role in ROLES:
                reg = getattr(self, role)
                if reg is not None and role not in self._down:
                    self.hub.send(reg.worker_id, P.RegisterReply(accepted=True, reason=HEARTBEAT))
        for role in ROLES:
            reg = getattr(self, role)
            if reg is None or role in self._down:
                continue
            silent = now - self._last_seen.get(reg.worker_id, now)
            if silent > self.config.worker_timeout_s:
                self._declare_dead(role, f"worker {reg.worker_id} lost: no message for {silent:.1f}s")

    def _declare_dead(self, role: str, detail: str) -> None:
        """Fail every request that still needs `role`'s worker; new requests get 503 until one registers."""
        reg = getattr(self, role)
        assert reg is not None
        self._down[role] = detail
        self.worker_deaths[role] += 1
        self._worker_stats.pop(role, None)
        logger.error("router: %s worker %s declared dead: %s", role, reg.worker_id, detail)
        with self._lock:
            flights = [f for f in self._flights.values() if not f.done and f.phase != "done"]
        for flight in flights:
            needs = (
                flight.decode_id == reg.worker_id
                if role == "decode"
                else flight.phase in ("reserving", "prefilling") and flight.prefill_id in ("", reg.worker_id)
            )
            if needs:
                self._fail_flight(flight, role, detail)

    def _fail_flight(self, flight: _Flight, role: str, detail: str) -> None:
        """End `flight` with an error chunk (via its queue) and tell both its workers to drop it."""
        self._abort_both(flight, f"{role}: {detail}")
        flight.phase = "done"
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, P.RequestFailed(flight.request_id, role, detail))

    def _register_late(self, wid: str, msg: P.Register) -> None:
        """A worker registering after start-up: a replacement for a dead one, or a known one coming back."""
        try:
            check_registration(msg, self.config.allow_context_above_pool)
            current = getattr(self, msg.role)
            if current is not None and msg.role not in self._down and current.worker_id != wid:
                raise CapacityConfigError(
                    f"router: a healthy {msg.role} worker ({current.worker_id}) is already registered; "
                    "one of each is served"
                )
            other = self.decode if msg.role == "prefill" else self.prefill
            if other is not None:
                pair = (msg, other) if msg.role == "prefill" else (other, msg)
                check_pair(*pair)
        except CapacityConfigError as e:
            logger.warning("router: refused %s worker %s: %s", msg.role, wid, e)
            self.hub.send(wid, P.RegisterReply(accepted=False, reason=str(e)))
            return
        if current is not None and msg.role not in self._down:  # the same worker again: it dropped its requests
            self._declare_dead(msg.role, f"worker {wid} registered again (it lost its router)")
        setattr(self, msg.role, msg)
        self._down.pop(msg.role, None)
        self._told_reregister.pop(wid, None)
        self._last_seen[wid] = time.monotonic()
        assert self.prefill is not None and self.decode is not None
        self._capacity = build_capacity(
            min(self.prefill.context_length, self.decode.context_length),
            {
                "prefill": (self.prefill.pool_tokens // self.prefill.page_size, self.prefill.page_size),
                "decode": (self.decode.pool_tokens // self.decode.page_size, self.decode.page_size),
            },
            self.config.allow_context_above_pool,
        )
        self.hub.send(wid, P.RegisterReply(accepted=True))
        logger.info("router: %s worker %s registered (replacing a lost one)", msg.role, wid)

    # -- helpers --------------------------------------------------------------
    def _abort_both(self, flight: _Flight, reason: str) -> None:
        assert self.prefill is not None and self.decode is not None
        self.hub.send(flight.decode_id or self.decode.worker_id, P.Abort(flight.request_id, reason))
        self.hub.send(flight.prefill_id or self.prefill.worker_id, P.Abort(flight.request_id, reason))

    def _router_record(self, flight: _Flight, reason: Reason, detail: str) -> IntegrityRecord:
        """The record of a request that ended without one from decode (abort, timeout, prefill failure).

        A request aborted after decode verified its handoff keeps decode's record: the
        record is about the handoff, which did verify.
        """
        assert self.decode is not None
        if flight.decode_record is not None and reason == Reason.ABORTED:
            return flight.decode_record
        return IntegrityRecord(
            request_id=flight.request_id,
            status="failed",
            reason=reason.value,
            detail=detail,
            tokens_expected=flight.expected_len,
            tokens_covered=0,
            pages=0,
            layout_fingerprint=self.decode.layout_fingerprint,
            role="router",
        )

    def _error_chunk(self, flight: _Flight, message: str, record: IntegrityRecord) -> GenerationChunk:
        return GenerationChunk(
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=flight.expected_len,
            num_output_tokens=flight.num_output_tokens,
            integrity=self._finish(flight, record),
            error=message,
        )

    def _finish(self, flight: _Flight, record: IntegrityRecord) -> dict[str, Any]:
        """The one place a request's integrity record is logged and counted; returns its API form."""
        if flight.done:
            assert flight.record is not None
            return flight.record.to_api()
        flight.done = True
        flight.phase = "done"
        flight.record = record
        self.integrity_counts[record.status] += 1
        self.integrity_metrics.observe(record)
        with self._lock:
            self.records.append(record)
            del self.records[:-1000]
        integrity_logger.info(record.to_json())
        return record.to_api()
