"""The decode worker: reserves pages for the router's prompt length, verifies the KV that lands, then decodes.

What it knows: the requests the router announced, one `_DecodeRequest` record each whose
`DecodeRequestState` moves only along `DECODE_REQUEST_TRANSITIONS` (queued, handoff,
running, quarantined, finished; docs/handoff.md, "Lifecycles"), each with the expectation
the router computed (`tokens_expected`, token hash) and its sampling params; one
`DecodeHandoff` per request (pages reserved through the engine, a receive slot on the
data plane, verification before anything reads the pages); the first token prefill
sampled (relayed by the router); which requests run in its engine's continuous batch,
and the integrity record each one ends with. A request enters the batch
only when its handoff is READY; a rejected or failed handoff fails only that request
(`RequestFailed` with the reason and the record), its pages quarantined until the
transfer is settled, then released.

What it does not know: prompt text, prefill's pages, HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvfence.auth.plane import PlaneAuth
from kvfence.disagg import messages as P
from kvfence.disagg.config_checks import require_choice, require_positive
from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig
from kvfence.disagg.lifecycle import Lifecycle
from kvfence.disagg.worker_engine import DecodeEngine
from kvfence.engine.llm_engine import RequestOutput
from kvfence.engine.sampler import TokenLogprobs
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import Expectation
from kvfence.transfer.base import TRANSFER_BACKENDS, Receiver, is_transfer_id

if TYPE_CHECKING:
    from kvfence.disagg.worker import WorkerIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    transport: str = "tcp"  # the transfer backend, one of TRANSFER_BACKENDS (field name kept: worker_main sets it)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # the launcher passes a free port explicitly; 0 only in tests
    deadline_s: float = 60.0  # reserve -> verified (including waiting for pages and the first token)
    verify: bool = True  # False ONLY to demonstrate what the checks protect against
    strict: bool = False  # poison quarantined and released pages
    io_timeout_s: float = 10.0  # a data connection that moves no byte this long in the middle of a frame is dropped

    def __post_init__(self) -> None:
        require_choice(self, "transport", TRANSFER_BACKENDS)
        require_positive(self, "deadline_s")
        require_positive(self, "io_timeout_s")


class _EngineReservations:
    """The allocator verbs `DecodeHandoff` uses, routed through the engine's reservation hooks.

    `allocate` becomes `engine.reserve` for the whole request: the router's expected
    prompt length plus max_tokens (capped at the context length). The handoff gets the
    first pages (the prompt's, which prefill fills); the rest stay with the request for
    its output, so a request in the batch never needs a page it cannot get and decode never
    has to preempt (a verified request waiting for pages while holding its prompt's
    pages could otherwise deadlock the batch). `quarantine` becomes
    `engine.release(quarantine=True)`.
    """

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.tokens: dict[str, int] = {}  # request id -> tokens to reserve, set before `start`

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.engine.resolved.page_size)

    def can_allocate(self, n: int) -> bool:
        return self.engine.allocator.can_allocate(n)

    def allocate(self, request_id: str, n: int) -> list[int]:
        pages = self.engine.reserve(request_id, self.tokens.pop(request_id))
        if pages is None:
            raise MemoryError(f"decode: cannot reserve pages for {request_id}")
        assert len(pages) >= n, (len(pages), n)
        return pages[:n]  # the prompt's pages, in logical order: what the transfer fills and verify checks

    def quarantine(self, request_id: str) -> list[int]:
        return self.engine.release(request_id, quarantine=True)

    def release_quarantine(self, request_id: str) -> list[int]:
        return self.engine.allocator.release_quarantine(request_id)


class DecodeRequestState(str, Enum):
    """Where one request stands on the decode worker (docs/handoff.md, "Lifecycles")."""

    QUEUED = "queued"  # DecodePrepare accepted; waiting for free pages
    HANDOFF = "handoff"  # pages reserved, DecodeReserved sent; the KV handoff runs (`DecodeHandoff` has its states)
    RUNNING = "running"  # verified and in the engine's batch, streaming tokens
    QUARANTINED = "quarantined"  # the handoff failed or was aborted: its pages wait until the transfer settled
    FINISHED = "finished"  # gone from this worker (finished, failed, aborted or released)


_R = DecodeRequestState
DECODE_REQUEST_TRANSITIONS: dict[DecodeRequestState, frozenset[DecodeRequestState]] = {
    _R.QUEUED: frozenset({_R.HANDOFF, _R.FINISHED}),  # reserved; or aborted, timed out, cannot reserve
    # into the batch; handoff failed with pages to quarantine; or ended with none held any more
    _R.HANDOFF: frozenset({_R.RUNNING, _R.QUARANTINED, _R.FINISHED}),
    _R.RUNNING: frozenset({_R.FINISHED}),
    _R.QUARANTINED: frozenset({_R.FINISHED}),
    _R.FINISHED: frozenset(),
}


@dataclass
class _DecodeRequest:
    """One request on the decode worker, from DecodePrepare until it is gone."""

    prepare: P.DecodePrepare
    params: SamplingParams
    handoff: DecodeHandoff
    received_at: float
    first_token: int | None = None  # prefill's, from the manifest or the router's relay (they must agree)
    first_logprobs: TokenLogprobs | None = None  # prefill's scores of the first token, when asked for
    abort_reason: str | None = None  # the router's, when it aborted the request (it told the client itself)
    integrity: dict[str, Any] | None = None  # the handoff's record (wire form), from entering the batch
    chunks_sent: int = 0  # Tokens messages sent (the record rides on the first and the last)
    lifecycle: Lifecycle[DecodeRequestState] = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(f"decode request {self.request_id}", _R.QUEUED, DECODE_REQUEST_TRANSITIONS)

    @property
    def request_id(self) -> str:
        return self.prepare.request_id

    @property
    def state(self) -> DecodeRequestState:
        return self.lifecycle.state

    def advance(self, new: DecodeRequestState) -> None:
        self.lifecycle.advance(new)

    @property
    def aborted_by_router(self) -> bool:
        return self.abort_reason is not None


class DecodeWorker:
    role = "decode"

    def __init__(
        self,
        engine: DecodeEngine,
        identity: WorkerIdentity,
        config: DecodeConfig | None = None,
        faults: FaultInjector | None = None,
        receiver: Receiver | None = None,
        metrics: IntegrityMetrics | None = None,
        *,
        auth: PlaneAuth,
    ) -> None:
        """`auth`: the cluster key's data-plane keys and this process's security events; a `receiver` passed in
        must use the same."""
        self.engine = engine  # kvfence.engine.llm_engine.LLMEngine
        self.identity = identity
        self.config = config or DecodeConfig()
        self.faults = faults
        self.auth = auth
        if receiver is None:
            if self.config.transport == "local":
                raise KvfenceError("decode: the local (in-process) transfer backend needs its receiver passed in")
            if self.config.transport == "mooncake":
                from kvfence.transfer.mooncake import MooncakeReceiver as receiver_cls
            else:
                from kvfence.transfer.tcp import TcpReceiver as receiver_cls
            c = self.config
            receiver = receiver_cls(
                engine.pool, c.listen_host, c.listen_port, faults, io_timeout_s=c.io_timeout_s, auth=auth
            )
        self.receiver = receiver
        self.metrics = metrics if metrics is not None else IntegrityMetrics()
        self._pages = _EngineReservations(engine)
        self._handoff_config = HandoffConfig(
            transfer_timeout_s=self.config.deadline_s,
            sender_wait_s=2 * self.config.deadline_s,  # past the router's deadline: it fails the request first
            verdict_timeout_s=self.config.deadline_s,
            quarantine_timeout_s=self.config.deadline_s,
            verify=self.config.verify,
            strict=self.config.strict,
        )
        self.send_msg: Callable[[P.Message], None] | None = None  # set by `attach`
        self.requests: dict[str, _DecodeRequest] = {}  # every request not FINISHED, in arrival order
        self._settled: list[str] = []  # entered the batch this step: HandoffSettled goes out after their first tokens
        self.counts: dict[str, int] = {"verified": 0, "unverified": 0, "rejected": 0, "failed": 0, "aborted": 0}

    def attach(self, send: Callable[[P.Message], None]) -> None:
        self.send_msg = send

    def held_request_ids(self) -> list[str]:
        """Every request this worker holds, in any state but FINISHED (what a lost router's requests are)."""
        return list(self.requests)

    def ids(self, state: DecodeRequestState) -> list[str]:
        """The requests in `state`, in arrival order."""
        return [rid for rid, req in self.requests.items() if req.state is state]

    def _in(self, state: DecodeRequestState) -> list[_DecodeRequest]:
        return [req for req in self.requests.values() if req.state is state]

    def _finish(self, req: _DecodeRequest) -> None:
        req.advance(_R.FINISHED)
        del self.requests[req.request_id]

    def registration(self) -> P.Register:
        from kvfence.disagg.worker import registration_for

        return registration_for(self.role, self.engine, self.identity, self.receiver.address)

    # -- messages ---------------------------------------------------------------------------------------------
    def handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.DecodePrepare):
            self._prepare(msg)
        elif isinstance(msg, P.PrefillSent):
            rid, token = msg.request_id, int(msg.first_token)
            req = self.requests.get(rid)
            if req is not None and req.state is _R.HANDOFF:
                self._first_token(req, token, msg.first_logprobs, "the router")
            elif req is not None and req.state is _R.RUNNING and req.first_token != token:  # batched on the manifest's
                self.engine.abort_request(rid)
                self._finish(req)
                detail = f"prefill's first token differs: {req.first_token} in the manifest, {token} from the router"
                self._out(P.RequestFailed(rid, self.role, detail))
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id, msg.reason)
        elif not isinstance(msg, P.RegisterReply):
            logger.warning("decode: unexpected %s", msg.kind)

    def _prepare(self, msg: P.DecodePrepare) -> None:
        rid = msg.request_id
        if rid in self.requests:
            self._out(P.RequestFailed(rid, self.role, f"request id {rid!r} is already in use on decode"))
            return
        try:
            params = P.params_from_wire(msg.params)
            if msg.tokens_expected <= 0 or msg.tokens_expected != len(msg.prompt_token_ids):
                raise KvfenceError(
                    f"router expects {msg.tokens_expected} tokens for a prompt of {len(msg.prompt_token_ids)}"
                )
            if not is_transfer_id(msg.transfer_id):
                raise KvfenceError("the router's transfer id is not a 128-bit capability")
            handoff = DecodeHandoff(
                Expectation(rid, msg.tokens_expected, msg.token_hash, msg.transfer_id),
                self._pages,  # type: ignore[arg-type]
                self.engine.pool,
                self.receiver,
                self._handoff_config,
                self.metrics,
                authenticated=self.auth.secure,
            )
        except (KvfenceError, ValueError) as e:
            self._out(P.RequestFailed(rid, self.role, f"cannot prepare request: {e}"))
            return
        self.requests[rid] = _DecodeRequest(msg, params, handoff, time.monotonic())
        self._start_queued()

    def _start_queued(self) -> None:
        """Reserve pages for queued requests, first come first served, while the pool has room."""
        for req in self._in(_R.QUEUED):
            rid = req.request_id
            total = self._reserve_tokens(req)
            if not self._pages.can_allocate(self._pages.pages_for(total)):
                if time.monotonic() - req.received_at > self.config.deadline_s:
                    self._finish(req)
                    self._out(
                        P.RequestFailed(
                            rid,
                            self.role,
                            f"timeout: no free KV pages for {total} tokens within {self.config.deadline_s:.0f}s",
                        )
                    )
                    continue
                return
            self._pages.tokens[rid] = total
            try:
                pages = req.handoff.start()
            except (KvfenceError, MemoryError) as e:
                self._pages.tokens.pop(rid, None)
                self._finish(req)
                self._out(P.RequestFailed(rid, self.role, f"cannot reserve pages: {e}"))
                continue
            req.advance(_R.HANDOFF)
            self._out(P.DecodeReserved(rid, self.receiver.address, len(pages)))

    def _reserve_tokens(self, req: _DecodeRequest) -> int:
        """Prompt + max_tokens, capped at the context length (the request can never hold more)."""
        return min(req.prepare.tokens_expected + req.params.max_tokens, self.engine.resolved.context_length)

    def _abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if req.state is _R.QUEUED:
            self._finish(req)
            self.counts["aborted"] += 1
        elif req.state is _R.HANDOFF:
            req.abort_reason = reason
            h = req.handoff
            if h.state in (DecodeState.WAITING, DecodeState.TRANSFERRING):
                h.abort(reason)
            elif h.state == DecodeState.READY:  # verified but not in the batch yet: the pages are plain reserved ones
                self.engine.release(rid)
                self._finish(req)
                self.counts["aborted"] += 1
                return
            self._end(req)
        elif req.state is _R.RUNNING:
            self.engine.abort_request(rid)
            self._finish(req)
            self.counts["aborted"] += 1
        # QUARANTINED: already ended; its pages are released once the transfer settled

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Work to do right now: requests in the engine, or a verified handoff that can enter the batch."""
        if self.engine.has_unfinished_requests():
            return True
        return any(
            req.first_token is not None and req.handoff.state == DecodeState.READY for req in self._in(_R.HANDOFF)
        )

    def set_waker(self, wake: Callable[[], None]) -> None:
        """The worker loop's wake-up (its channel's `wake`): the receiver calls it when a transfer moves on."""
        self.receiver.core.notify = wake

    @property
    def poll_interval_s(self) -> float | None:
        """How long the worker loop may wait for a message when not `busy` (None: its idle default).

        Handoffs in flight complete on the transport's thread. With a waker (`set_waker`) that thread
        ends the loop's wait itself; without one, a short wait notices them within a millisecond without
        spinning a core that prefill needs to compute the very prompt being waited for.
        """
        if self.receiver.core.notify is not None:
            return None
        return 0.001 if any(req.state is _R.HANDOFF for req in self.requests.values()) else None

    def step(self) -> bool:
        self._start_queued()
        for req in self._in(_R.HANDOFF):
            h = req.handoff
            h.poll()
            if h.state == DecodeState.READY:
                m = h.slot.manifest if h.slot is not None else None
                if m is not None and m.first_token is not None:  # no relay to wait for; or it must agree
                    self._first_token(req, m.first_token, m.first_logprobs, "the manifest")
                if req.state is not _R.HANDOFF:
                    continue  # the two sources disagreed: failed
                if req.first_token is not None:
                    self._enter_batch(req)
                elif time.monotonic() - req.received_at > self.config.deadline_s:
                    self.engine.release(req.request_id)
                    self._finish(req)
                    self._out(
                        P.RequestFailed(req.request_id, self.role, "timeout: prefill's first token never arrived")
                    )
            elif h.state in (DecodeState.FAILED, DecodeState.ABORTED):
                self._end(req)
        for req in self._in(_R.QUARANTINED):
            req.handoff.poll()
            if req.handoff.released:
                self._finish(req)
        self._send_tokens(
            self.engine.report_pending()
        )  # first tokens of requests that just entered the batch, before a forward
        for rid in self._settled:  # now prefill may release their source pages
            self._out(P.HandoffSettled(rid, verified=True))
        self._settled.clear()
        worked = False
        if self.engine.has_unfinished_requests():
            worked = True
            self._send_tokens(self.engine.step())
        return worked

    def _send_tokens(self, outputs: list[RequestOutput]) -> None:
        """One frame for all these requests' new tokens; the record rides on the first and the last chunk."""
        tokens: list[P.Message] = []
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or req.state is not _R.RUNNING:
                continue
            record = req.integrity if out.finished or req.chunks_sent == 0 else None
            req.chunks_sent += 1
            if out.finished:
                self._finish(req)
            tokens.append(
                P.Tokens(
                    out.request_id,
                    list(out.new_token_ids),
                    text=out.new_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    integrity=record,
                    num_output_tokens=out.num_output_tokens,
                    logprobs=P.logprobs_to_wire(out.new_logprobs),  # type: ignore[arg-type]
                )
            )
        if (msg := P.batch(tokens)) is not None:
            self._out(msg)

    def _first_token(self, req: _DecodeRequest, token: int, logprobs: list | None, source: str) -> None:
        """Prefill's first token, from whichever of its two messages comes first (the manifest or the router's
        relay of PrefillSent); the second must say the same, else the request fails."""
        if req.first_token is not None:
            if req.first_token != token:
                rid = req.request_id
                self.engine.release(rid)
                self._finish(req)
                detail = f"prefill's first token differs: {req.first_token} earlier, {token} from {source}"
                self._out(P.RequestFailed(rid, self.role, detail))
            return
        req.first_token = token
        first = P.logprobs_from_wire([logprobs]) if logprobs is not None else None
        req.first_logprobs = first[0] if first else None

    def _enter_batch(self, req: _DecodeRequest) -> None:
        """A verified handoff with its first token: the request joins the engine's continuous batch."""
        rid, h = req.request_id, req.handoff
        record = h.record.to_dict() if h.record is not None else None
        self.counts["verified" if self.config.verify else "unverified"] += 1
        first_token = req.first_token
        if first_token is None:  # callers check; an explicit error survives `python -O`
            raise RuntimeError(f"decode request {rid}: into the batch without prefill's first token")
        try:
            self.engine.add_prefilled_request(
                rid, req.prepare.prompt_token_ids, first_token, req.params, first_logprobs=req.first_logprobs
            )
        except KvfenceError as e:
            self.engine.release(rid)
            self._finish(req)
            self._out(P.RequestFailed(rid, self.role, f"cannot start decoding the request: {e}", integrity=record))
            return
        self._skip_first_draw(rid)
        req.integrity = record
        req.advance(_R.RUNNING)
        self._settled.append(rid)  # told after its first token went out (that is on the client's critical path)

    def _skip_first_draw(self, rid: str) -> None:
        """A seeded request's generator has already made one draw on prefill (the first token).

        The sampler takes one uniform draw per token from the request's own generator, so
        advancing decode's fresh generator by one draw makes a seeded request produce the
        same tokens as it would in one engine.
        """
        import torch

        req = self.engine.scheduler.requests.get(rid)
        if req is not None and req.generator is not None and req.sampling_params.seed is not None:
            torch.rand((), generator=req.generator)

    def _end(self, req: _DecodeRequest) -> None:
        """A handoff that failed or was aborted: report it once; its pages stay QUARANTINED until no write can land
        (invariant 5, docs/handoff.md)."""
        rid, h = req.request_id, req.handoff
        if h.released:
            self._finish(req)
        else:
            req.advance(_R.QUARANTINED)
        rec: IntegrityRecord | None = h.record
        if h.state == DecodeState.ABORTED:
            self.counts["aborted"] += 1
        else:
            self.counts["rejected" if rec is not None and rec.status == "rejected" else "failed"] += 1
        if req.aborted_by_router:
            return  # the router ended it and told the client already
        if rec is not None:
            what = "rejected" if rec.status == "rejected" else "failed"
            reason = f"KV handoff {what} ({rec.reason}): {rec.detail}"
        else:
            reason = f"KV handoff {h.state.value}"
        self._out(P.RequestFailed(rid, self.role, reason, integrity=rec.to_dict() if rec is not None else None))

    def _out(self, msg: P.Message) -> None:
        if self.send_msg is None:
            raise RuntimeError("decode: attach() a channel before handling messages")
        self.send_msg(msg)

    # -- numbers ----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        pool = P.engine_pool_stats(self.engine)
        queued, quarantined = self._in(_R.QUEUED), self._in(_R.QUARANTINED)
        return {
            **pool,
            "num_waiting": pool["num_waiting"] + len(queued),
            "pages_wanted": sum(self._pages.pages_for(self._reserve_tokens(req)) for req in queued),
            "handoffs_in_flight": len(self._in(_R.HANDOFF)),
            "handoffs_quarantined": len(quarantined),
            "handoffs_overdue": sum(req.handoff.overdue for req in quarantined),  # a write could still land
            **{f"handoffs_{k}": v for k, v in self.counts.items()},
            "security_events": self.auth.events.counts(),
        }

    def idle(self) -> bool:
        return not self.requests and not self.busy

    def close(self) -> None:
        try:
            self.receiver.close()
        except Exception:
            logger.exception("decode: closing the receiver failed")
