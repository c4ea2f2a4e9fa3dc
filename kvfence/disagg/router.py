"""The router: the front end's engine in disaggregated mode, routing each request to a prefill and a decode worker.

What it knows: the workers that registered (a `WorkerTable`: the deployment's identity,
each worker's health and reported load, the routing policy; registration and keepalives
are `disagg.registration`), and each request in flight (a `Flight`, `disagg.flight`). One
request, in the order a reader meets it (docs/handoff.md, "One request"):

    generate:  admit  -> refuse what no worker can hold (400), or a role with no worker up (503)
               order  -> pick a prefill and a decode worker by load, draw the transfer capability, send both
                         an `Order` at once (prefill's names decode's data-plane address; decode's carries the
                         token count and hash the router computed from the ids it admitted: prefill never
                         vouches for its own prompt)
               stream -> for each message of the flight: prefill's first token (streamed at once while the KV
                         travels), decode's tokens (its first chunk repeats that token: checked and dropped),
                         a worker's failure, or the router's own (deadline, worker lost): one handler each

It implements `EngineClient`, so the HTTP app serves it exactly as it serves one engine. It
ends every request with one integrity record (JSON log line + the final chunk + the counters in
`stats()`), and tells the other worker of a pair to drop a request one side failed.

Worker health: every worker sends `WorkerStats` a few times a second and the router
sends each up worker a keepalive (`RegisterReply(accepted=True, reason=HEARTBEAT)`,
sent by `disagg.registration.Registrar`). A worker silent for `worker_timeout_s` (on the
router's clock: monotonic time, or one a test moves) is declared dead: a request that still
needs it and has not delivered a token to its client yet is retried once on another pair
(its record says so); the others fail at once with an error naming it (the other worker of
each pair is told to drop them and free their pages), and new requests go to the others; a
role with no worker up gets HTTP 503 with an OpenAI-style error body until one registers. A
worker may register at any time (a replacement, a new one, or the same one again after it lost
its router); one that does not match the deployment is refused naming the difference, and one
that claims the id of a live worker of another process (its `instance`) is refused. A message
from a worker the router does not know (the router restarted, or declared that worker dead) is
answered `RegisterReply(accepted=False, reason=REREGISTER ...)`: the worker drops what it holds
and registers afresh.

What it does not know: tokens' text (decode detokenizes), KV bytes (they go straight
from prefill to decode on the data plane, which also carries decode's verdict back) or the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvfence.auth.events import SecurityEvents, SecurityEventsCollector
from kvfence.disagg import messages as P
from kvfence.disagg.flight import Failure, Flight, FlightState, FromWorker
from kvfence.disagg.registration import Registrar
from kvfence.disagg.router_config import RouterConfig
from kvfence.disagg.workers import ROLES, WorkerEntry, WorkerTable
from kvfence.engine.admission import admit
from kvfence.engine.engine_client import Capacity, GenerationChunk
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError, InvalidRequestError, ServiceUnavailableError
from kvfence.integrity.algorithms import DIGEST_ALGORITHM
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.token_hash import token_hash
from kvfence.integrity.verdict import Reason
from kvfence.transfer.transfer_id import new_transfer_id

logger = logging.getLogger(__name__)
integrity_logger = logging.getLogger("kvfence.integrity")

WORKER_LOST = P.WORKER_LOST
MAX_BACKLOG = 1024  # messages handled per pass before deadlines and worker health are checked
_F = FlightState


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
        self._flights: dict[str, Flight] = {}  # request id -> its flight
        self._wire: dict[str, str] = {}  # the id the workers know (this attempt's) -> request id
        self._lock = threading.RLock()  # flights, wire ids, deliveries and the worker table
        self.integrity_counts: Counter[str] = Counter()
        self.transfer_counts: Counter[str] = Counter()  # handoffs by result ("ok", "failed"), from their records
        # (worker id, process) -> its prefix-cache counters as last reported: kept after the process goes, so the
        # sums on /metrics never go back when a prefill worker dies, restarts or is marked down
        self._prefix_counts: dict[tuple[str, str], dict[str, int]] = {}
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
        self.retries: Counter[str] = Counter()  # role of the lost worker -> requests retried on another pair

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
        """Raise ServiceUnavailableError (HTTP 503 on /health and on new requests) when a role has no worker up."""
        for role, ok in self.healthy().items():
            if not ok:
                raise ServiceUnavailableError(
                    f"no healthy {role} worker ({self._down_reason(role)})", code="no_healthy_worker"
                )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        flight = self._admit(request_id, [int(t) for t in prompt_token_ids], params)
        self.start()
        self._send_orders(flight)
        held: list[FromWorker | Failure] = []  # decode's chunks that came before prefill's first token (see _holds)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(flight.queue.get(), timeout=self.config.request_timeout_s)
                except asyncio.TimeoutError:
                    detail = (
                        f"no progress from the workers for {self.config.request_timeout_s:.0f}s ({flight.state.value})"
                    )
                    self._abort_both(flight, detail)
                    yield self._error_chunk(flight, detail, self._router_record(flight, Reason.TIMEOUT, detail))
                    return
                if self._holds(flight, item):
                    held.append(item)
                    continue
                batch: list[FromWorker | Failure] = [item]
                while batch:
                    chunk, done = self._handle(flight, batch.pop(0))
                    if chunk is not None:
                        yield chunk
                    if done:
                        return
                    if held and flight.prefill_first_handled:  # what waited for it, in the order it came
                        batch, held = held, []
        finally:
            if not flight.finished:  # the client went away (generator closed or cancelled)
                self._abort_both(flight, "client disconnected")
                self._finish(flight, self._router_record(flight, Reason.ABORTED, "client disconnected"))
            with self._lock:
                self._flights.pop(request_id, None)
                self._wire.pop(flight.wire_id, None)

    # -- admit, order ------------------------------------------------------------------------------------------
    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams) -> Flight:
        """Refuse what cannot be served (503, 400) before any worker sees it; else the request's flight, with its
        pair picked by load and its transfer capability drawn."""
        self.check_health()
        self.check_token_ids(prompt)
        max_tokens = admit(len(prompt), params.max_tokens, self.capacity())  # ContextLengthExceededError (400)
        self._check_prompt_logprobs(len(prompt), params)
        flight = Flight(
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
        with self._lock:
            if request_id in self._flights:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            pair = self._pick(flight, len(prompt) + max_tokens, exclude=())
            if pair is None:  # the worker that could hold it went down since admission
                raise ServiceUnavailableError(f"no healthy worker can hold {len(prompt) + max_tokens} tokens now",
                                              code="no_healthy_worker")  # fmt: skip
            flight.prefill_id, flight.decode_id = pair
            self._flights[request_id] = flight
            self._wire[flight.wire_id] = request_id
        return flight

    @staticmethod
    def _check_prompt_logprobs(num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse (400) prompt logprobs that prefill's first-token message could not carry: the router's link
        would disconnect that prefill worker on receiving it, losing other requests' messages with it."""
        if params.prompt_logprobs is None:
            return
        need = P.prompt_logprobs_wire_bytes(num_prompt_tokens, params.prompt_logprobs)
        if need > P.MAX_CONTROL_MESSAGE_BYTES:
            raise InvalidRequestError(  # over HTTP, prompt logprobs are /v1/completions' `echo` with `logprobs`
                f"the prompt's log probabilities (prompt_logprobs={params.prompt_logprobs}: `echo` with `logprobs`) "
                f"for a prompt of {num_prompt_tokens} tokens may need {need / 2**20:.0f} MiB on the control link "
                f"from prefill, over its {P.MAX_CONTROL_MESSAGE_BYTES >> 20} MiB limit; ask for fewer logprobs, or "
                "send a shorter prompt",
                code="prompt_logprobs_too_large",
                param="logprobs",
            )

    def _pick(self, flight: Flight, need: int, exclude: tuple[str, ...]) -> tuple[str, str] | None:
        """(prefill, decode) for `flight` by load and the prefill workers' cached prefixes, the order costs accounted
        (called under the lock)."""
        now = self._clock()
        prompt, params = flight.prompt_token_ids, flight.params
        affine = self.config.prefix_affinity and params.prompt_logprobs is None  # those never read a prefix cache
        keys = self.workers.prefix_keys(params.cache_salt, prompt) if affine else []
        decode = self.workers.pick_decode(need, now, exclude=exclude)
        prefill = self.workers.pick_prefill(len(prompt), now, exclude=exclude, keys=keys)
        if decode is None or prefill is None:
            return None
        flight.expected_cached_tokens = self.workers.cached_tokens(prefill, keys)  # what its cache should spare
        self.workers.remember_prefix(keys, prefill)
        self.workers.order(decode, now, pages=self.workers.pages_for(need))
        self.workers.order(prefill, now, tokens=len(prompt) - flight.expected_cached_tokens)
        return prefill.worker_id, decode.worker_id

    def _send_orders(self, flight: Flight) -> None:
        """Both at once: decode reserves pages for the router's expectation while prefill computes the prompt; the
        manifest prefill sends waits at decode (parked) if it comes before the reservation."""
        with self._lock:
            decode: WorkerEntry | None = self.workers.get(flight.decode_id)
            address = decode.reg.handoff_address if decode is not None else ""
            wire, xid, prefill_id, decode_id = flight.wire_id, flight.transfer_id, flight.prefill_id, flight.decode_id
        params = P.params_to_wire(flight.params)
        prompt = flight.prompt_token_ids
        cached = flight.expected_cached_tokens
        self.hub.send(
            prefill_id, P.Order(wire, prompt, xid, params, decode_address=address, expected_cached_tokens=cached)
        )
        self.hub.send(
            decode_id,
            P.Order(wire, prompt, xid, params, tokens_expected=flight.tokens_expected, token_hash=flight.token_hash),
        )

    # -- stream: one handler per kind of news ---------------------------------------------------------------
    @staticmethod
    def _holds(flight: Flight, item: FromWorker | Failure) -> bool:
        """Whether decode's chunk waits for prefill's first token: the prompt's logprobs ride on the first chunk
        the client gets, and they come with prefill's token, which the two workers' channels may deliver after
        decode's first chunk (prefill queues it, then its pages go to decode, which can verify and answer first)."""
        return (
            isinstance(item, FromWorker)
            and item.role == "decode"
            and isinstance(item.msg, P.Tokens)
            and item.msg.request_id == flight.wire_id
            and flight.params.prompt_logprobs is not None
            and not flight.prefill_first_handled
        )

    def _handle(self, flight: Flight, item: FromWorker | Failure) -> tuple[GenerationChunk | None, bool]:
        """(the chunk for the client, if any; whether the request is done) for one piece of the flight's news."""
        if isinstance(item, Failure):
            if item.wire_id != flight.wire_id:
                return None, False  # from an attempt given up for a retry
            return self._on_failure(flight, item), True
        msg = item.msg
        if getattr(msg, "request_id", None) != flight.wire_id:
            return None, False  # from an attempt given up for a retry
        if isinstance(msg, P.RequestFailed):
            return self._on_failed(flight, msg), True
        if isinstance(msg, P.Tokens) and item.role == "prefill":
            return self._on_first_token(flight, msg), False
        if isinstance(msg, P.Tokens):
            return self._on_tokens(flight, msg)
        return None, False

    def _on_first_token(self, flight: Flight, msg: P.Tokens) -> GenerationChunk | None:
        """Prefill's first token: streamed at once (it comes from prefill's own KV; docs/handoff.md, "What the client
        sees before the verdict"), unless its text is not known, the request has stop strings, or the router holds
        first tokens until the verdict."""
        flight.prefill_first_handled = True
        if msg.prompt_logprobs is not None:
            flight.prompt_logprobs = msg.prompt_logprobs
        streams = self.config.first_token_before_verdict and msg.text is not None and not flight.params.stop
        with self._lock:
            if not streams or flight.num_output_tokens or not flight.live or msg.request_id != flight.wire_id:
                return None
            flight.first_token.streamed = msg
            flight.delivered += 1  # from here on the request is never retried on another pair
        flight.num_output_tokens = 1
        return self._chunk(flight, msg, finished=False)

    def _on_tokens(self, flight: Flight, msg: P.Tokens) -> tuple[GenerationChunk | None, bool]:
        """Decode's tokens; its first chunk repeats the token streamed from prefill (checked, then dropped); the last
        one carries the record."""
        rest, why = flight.first_token.drop_repeat(msg)
        if msg.integrity is not None:
            flight.decode_record = self._wire_record(flight, msg.integrity)
        if rest is None:
            assert why is not None
            record = flight.decode_record or self._router_record(flight, Reason.TRANSFER_ERROR, why)
            self._abort_both(flight, why)
            return self._error_chunk(flight, f"{why} ({flight.pair})", record), True
        if not (rest.token_ids or rest.text or rest.finished or rest.error):
            return None, False  # it only repeated the token streamed already (its record is kept)
        with self._lock:
            if rest.request_id != flight.wire_id:
                return None, False
            flight.delivered += len(rest.token_ids)
        flight.num_output_tokens += len(rest.token_ids)
        chunk = self._chunk(flight, rest, finished=rest.finished)
        if rest.finished:
            record = flight.decode_record or self._router_record(
                flight, Reason.ABORTED, rest.error or f"finished ({rest.finish_reason}) without a record"
            )
            chunk.integrity = self._finish(flight, record)
        return chunk, rest.finished

    def _on_failed(self, flight: Flight, msg: P.RequestFailed) -> GenerationChunk:
        """A worker cannot go on with the request (the router told the other side already)."""
        if msg.integrity is not None:
            record = self._wire_record(flight, msg.integrity)
        else:
            reason = Reason.TIMEOUT if msg.reason.startswith("timeout") else Reason.TRANSFER_ERROR
            record = self._router_record(flight, reason, f"{msg.role}: {msg.reason}")
        wid = flight.decode_id if msg.role == "decode" else flight.prefill_id
        message = f"{msg.role} worker {wid}: {msg.reason} ({flight.pair})"
        return self._error_chunk(flight, message, record, msg.code or "generation_failed")

    def _on_failure(self, flight: Flight, failure: Failure) -> GenerationChunk:
        """The router failed the request itself (deadline, a worker lost, shutdown)."""
        reason = Reason.TIMEOUT if failure.code == "timeout" else Reason.TRANSFER_ERROR
        record = self._router_record(flight, reason, f"{failure.role}: {failure.reason}")
        return self._error_chunk(flight, f"{failure.reason} ({flight.pair})", record, failure.code)

    def _chunk(self, flight: Flight, msg: P.Tokens, finished: bool) -> GenerationChunk:
        chunk = GenerationChunk(
            token_ids=list(msg.token_ids),
            text=msg.text or "",
            finished=finished,
            finish_reason=msg.finish_reason if finished else None,
            num_prompt_tokens=flight.tokens_expected,
            num_output_tokens=flight.num_output_tokens,
            logprobs=P.logprobs_from_wire(msg.logprobs),  # type: ignore[arg-type]
            prompt_logprobs=P.logprobs_from_wire(flight.prompt_logprobs),
            error=msg.error,
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
        end = P.Tokens(flight.wire_id, [], finished=True, finish_reason="abort")  # the stream ends with that record
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, FromWorker("decode", end))

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
                "digest_algorithm": e.reg.settings.get("digest_algorithm", DIGEST_ALGORITHM),
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
            # what prefill's manifests name (by where its pool lives: xxh3_64 on the host, mlh62 on a device)
            "digest_algorithm": ",".join(
                sorted({w["digest_algorithm"] for w in workers.values() if w["role"] == "prefill"})
            )
            or DIGEST_ALGORITHM,
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
            prefix_counts = list(self._prefix_counts.values())
            in_flight = len(self._flights)
            page_size = self.workers.identity.page_size if self.workers.identity is not None else None
        roles: dict[str, Any] = {}
        num_running = num_waiting = 0
        # counters over every worker process that reported one (gone ones too: a counter never goes back); the
        # pages gauge over the workers up now
        prefix_cache = {k: sum(c[k] for c in prefix_counts) for k in P.PREFIX_CACHE_COUNTERS} if prefix_counts else {}
        if prefix_cache:
            prefix_cache["pages"] = 0
        for w in workers.values():
            if not w["up"] or "pages_total" not in w:
                continue
            if prefix_cache:
                prefix_cache["pages"] += int((w.get("prefix_cache") or {}).get("pages", 0))
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
            "prefix_cache": prefix_cache,
            "in_flight": in_flight,
            "transfers": dict(self.transfer_counts),
            "integrity": dict(self.integrity_counts),
            "workers": workers,
            "healthy": self.healthy(),
            "worker_deaths": dict(self.worker_deaths),
            "retries": dict(self.retries),
            "control_messages_dropped": int(getattr(self.hub, "dropped_sends", 0)),
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
            stale = (
                isinstance(msg, P.WorkerStats) and entry is not None and not self.registrar.same_instance(entry, msg)
            )
            if entry is not None and not stale:
                self.workers.heard(wid, now)
        if entry is None:  # a worker we do not know (we restarted) or declared dead: it must register again
            self.registrar.unknown(wid, now)
            return
        if stale:  # another process's report under this worker's id (one that came back after it was replaced)
            instance = msg.instance if isinstance(msg, P.WorkerStats) else "?"
            logger.warning("router: ignoring a report for %s from another process (instance %s)", wid, instance)
            return
        if isinstance(msg, P.WorkerStats):
            counts = msg.stats.get("prefix_cache")
            with self._lock:
                self.workers.report(wid, msg.stats, now)
                if isinstance(counts, dict):
                    keep = {k: int(counts.get(k, 0)) for k in P.PREFIX_CACHE_COUNTERS}
                    self._prefix_counts[(wid, msg.instance)] = keep
            return
        if not isinstance(msg, (P.Tokens, P.RequestFailed)):
            logger.warning("router: unexpected %s from %s", msg.kind, wid)
            return
        with self._lock:
            request_id = self._wire.get(msg.request_id)
            flight = self._flights.get(request_id) if request_id is not None else None
        if flight is None or flight.finished:
            return  # a request that ended (or an attempt given up for a retry): nothing to do with its news
        if wid not in (flight.decode_id, flight.prefill_id):
            logger.warning("router: ignoring %s for %s from %s (not its worker)", msg.kind, msg.request_id, wid)
            return
        role = "decode" if wid == flight.decode_id else "prefill"
        if isinstance(msg, P.RequestFailed):
            lost = flight.decode_id if role == "prefill" else flight.prefill_id
            if msg.code == WORKER_LOST and self._retry(flight, lost, f"{role} lost its peer {lost}: {msg.reason}"):
                return
            other = flight.prefill_id if role == "decode" else flight.decode_id
            self.hub.send(other, P.Abort(msg.request_id, f"{role} failed: {msg.reason}"))
        elif role == "prefill":
            flight.first = msg
            with self._lock:
                if flight.state is _F.PREFILLING and msg.request_id == flight.wire_id:
                    flight.advance(_F.DECODING)
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, FromWorker(role, msg))

    def _check_deadlines(self) -> None:
        """Handoffs that did not verify in time fail here (decode and prefill also time out on their own)."""
        now = self._clock()
        limit = self.config.handoff_deadline_s + 5.0  # workers get the first chance to report
        with self._lock:
            late = [f for f in self._flights.values() if f.state is _F.PREFILLING and now - f.started > limit]
        for flight in late:
            self._fail_flight(flight, "router", self._lateness(flight), code="timeout")

    def _lateness(self, flight: Flight) -> str:
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
        """Retry (once, on another pair) or fail every request that still needs worker `wid`; new requests go to the
        other workers."""
        with self._lock:
            entry = self.workers.mark_down(wid, detail)
            if entry is None:
                return
            flights = [f for f in self._flights.values() if f.live]
        role = entry.role
        self.worker_deaths[role] += 1
        logger.error("router: %s worker %s declared dead: %s", role, wid, detail)
        for flight in flights:
            needs = (
                flight.decode_id == wid
                if role == "decode"
                else flight.state is _F.PREFILLING and flight.prefill_id == wid
            )
            if needs and not self._retry(flight, wid, detail):
                self._fail_flight(flight, role, detail, code=WORKER_LOST)

    def _retry(self, flight: Flight, lost_id: str, why: str) -> bool:
        """Start `flight` again on a pair without `lost_id`, when nothing of it reached the client yet and it was
        not retried before; False (the caller fails it) otherwise. The old attempt's surviving worker drops it; its
        news, under the old wire id, is ignored from here on."""
        with self._lock:
            if not (flight.live and flight.attempt == 0 and flight.delivered == 0):
                return False
            need = flight.tokens_expected + min(flight.params.max_tokens, self.capacity().context_length)
            pair = self._pick(flight, need, exclude=(lost_id,))
            if pair is None:
                return False
            old_wire, old_pair = flight.wire_id, (flight.prefill_id, flight.decode_id)
            wire = f"{flight.request_id}#retry{flight.attempt + 1}"
            flight.restart(wire, new_transfer_id(), *pair, why=why, now=self._clock())
            del self._wire[old_wire]
            self._wire[wire] = flight.request_id
        for wid in old_pair:
            if wid and wid != lost_id:
                self.hub.send(wid, P.Abort(old_wire, f"retried on another pair: {why}"))
        self.retries[self.workers.entries[lost_id].role if lost_id in self.workers.entries else "?"] += 1
        logger.warning("router: %s retried on %s after: %s", flight.request_id, flight.pair, why)
        self._send_orders(flight)
        return True

    def _fail_flight(self, flight: Flight, role: str, detail: str, code: str = "generation_failed") -> None:
        """End `flight` with an error chunk (via its queue) and tell both its workers to drop it (unless the event
        loop finished it meanwhile)."""
        with self._lock:
            if not flight.live:
                return
            flight.advance(_F.FAILING)
            wire = flight.wire_id
        self._abort_both(flight, f"{role}: {detail}")
        flight.loop.call_soon_threadsafe(flight.queue.put_nowait, Failure(wire, role, detail, code))

    # -- helpers --------------------------------------------------------------------------------------------
    def _abort_both(self, flight: Flight, reason: str) -> None:
        for wid in (flight.decode_id, flight.prefill_id):
            if wid:
                self.hub.send(wid, P.Abort(flight.wire_id, reason))

    def _router_record(self, flight: Flight, reason: Reason, detail: str) -> IntegrityRecord:
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

    def _wire_record(self, flight: Flight, data: dict[str, Any]) -> IntegrityRecord:
        """A worker's record of the handoff; one that does not parse becomes a failed record saying so."""
        try:
            return IntegrityRecord.from_dict(data)
        except ValueError as e:
            logger.error("router: %s: malformed integrity record from a worker: %s", flight.request_id, e)
            return self._router_record(flight, Reason.TRANSFER_ERROR, f"malformed integrity record from a worker: {e}")

    def _error_chunk(
        self, flight: Flight, message: str, record: IntegrityRecord, code: str = "generation_failed"
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

    def _finish(self, flight: Flight, record: IntegrityRecord) -> dict[str, Any]:
        """The one place a request's integrity record is logged and counted (invariant 8, docs/handoff.md); returns
        its API form. The record names the request as the client knows it, and says when it was retried."""
        with self._lock:
            if flight.finished:
                assert flight.record is not None  # FINISHED is entered only here, with the record
                return flight.record.to_api()
            flight.advance(_F.FINISHED)
            record = dataclasses.replace(
                record,
                request_id=flight.request_id,
                tokens_before_verdict=1 if flight.first_token.streamed is not None else 0,
                retried_after=flight.retried_after or None,
            )
            flight.record = record
        self.integrity_counts[record.status] += 1
        if record.transfer_ref:  # a handoff happened (a router record has none)
            self.transfer_counts["ok" if record.status in ("verified", "unverified") else "failed"] += 1
        self.integrity_metrics.observe(record)
        with self._lock:
            self.records.append(record)
            del self.records[:-1000]
        integrity_logger.info(record.to_json())
        return record.to_api()
