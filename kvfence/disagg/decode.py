"""The decode worker: reserves pages for the router's prompt length, verifies the KV that lands, then decodes.

What it knows: the requests the router ordered, one `_DecodeRequest` record each, whose one
state (`DecodeState`: queued, reserved, receiving, verifying, verified, running, quarantined,
finished; docs/handoff.md, "One request") is its `DecodeHandoff`'s, moved only along
`DECODE_TRANSITIONS`; each with the expectation the router computed (`tokens_expected`, token
hash, the transfer id it issued) and its sampling params. A request's pages are reserved
through the engine when the pool has room; the KV lands in them on the data plane and is
verified before anything reads it; the first token prefill sampled comes in the authenticated
manifest; a verified request enters the engine's continuous batch (once its grammar, if any,
has compiled off the loop) and streams `Tokens` to the router, the first and the last carrying
its integrity record. A rejected or failed handoff fails only that request (`RequestFailed`
with the reason and the record), its pages quarantined until the transfer is settled.

What it does not know: prompt text, prefill's pages, HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfence.auth.plane import PlaneAuth
from kvfence.disagg import messages as P
from kvfence.disagg.decode_config import DecodeConfig
from kvfence.disagg.grammars import GrammarWaits
from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig
from kvfence.disagg.worker_engine import DecodeEngine
from kvfence.engine.llm_engine import RequestOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.record import IntegrityMetrics
from kvfence.integrity.verify import Expectation, Reason
from kvfence.math_utils import cdiv
from kvfence.transfer.base import Receiver, is_transfer_id

if TYPE_CHECKING:
    from kvfence.disagg.worker import WorkerIdentity

logger = logging.getLogger(__name__)
_S = DecodeState


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
        return cdiv(num_tokens, self.engine.resolved.page_size)

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


@dataclass
class _DecodeRequest:
    """One request on the decode worker, from its order until it is gone; its state is its handoff's."""

    order: P.Order
    params: SamplingParams
    handoff: DecodeHandoff
    received_at: float
    abort_reason: str | None = None  # the router's, when it aborted the request (it told the client itself)
    integrity: dict[str, Any] | None = None  # the handoff's record (wire form), from entering the batch
    chunks_sent: int = 0  # Tokens messages sent (the record rides on the first and the last)
    reported: bool = False  # its failure was reported (or the router ended it)

    @property
    def request_id(self) -> str:
        return self.order.request_id

    @property
    def state(self) -> DecodeState:
        return self.handoff.state


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
            receiver_cls: Callable[..., Receiver]
            if self.config.transport == "mooncake":
                from kvfence.transfer.mooncake import MooncakeReceiver

                receiver_cls = MooncakeReceiver
            else:
                from kvfence.transfer.tcp import TcpReceiver

                receiver_cls = TcpReceiver
            c = self.config
            receiver = receiver_cls(
                engine.pool, c.listen_host, c.listen_port, faults, io_timeout_s=c.io_timeout_s, auth=auth
            )
        self.receiver = receiver
        self.receiver.core.pending_ttl_s = 2 * self.config.deadline_s  # an early manifest waits for our reservation
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
        self._grammars = GrammarWaits(engine, self.config.grammar_budget)  # compiled while the KV travels
        self.counts: dict[str, int] = {"verified": 0, "unverified": 0, "rejected": 0, "failed": 0, "aborted": 0}

    def attach(self, send: Callable[[P.Message], None]) -> None:
        self.send_msg = send

    def held_request_ids(self) -> list[str]:
        """Every request this worker holds, in any state but FINISHED (what a lost router's requests are)."""
        return list(self.requests)

    def ids(self, state: DecodeState) -> list[str]:
        """The requests in `state`, in arrival order."""
        return [rid for rid, req in self.requests.items() if req.state is state]

    def _in(self, *states: DecodeState) -> list[_DecodeRequest]:
        return [req for req in self.requests.values() if req.state in states]

    def _gone(self, req: _DecodeRequest) -> None:
        """The request left this worker (its handoff is FINISHED)."""
        del self.requests[req.request_id]
        self._grammars.forget(req.request_id)

    def _finish(self, req: _DecodeRequest) -> None:
        req.handoff.finish()
        self._gone(req)

    def registration(self) -> P.Register:
        from kvfence.disagg.worker import registration_for

        return registration_for(self.role, self.engine, self.identity, self.receiver.address)

    # -- messages ---------------------------------------------------------------------------------------------
    def handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.Order):
            self._order(msg)
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id, msg.reason)
        elif not isinstance(msg, P.RegisterReply):
            logger.warning("decode: unexpected %s", msg.kind)

    def _order(self, msg: P.Order) -> None:
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
            self._out(P.RequestFailed(rid, self.role, f"cannot take the request: {e}"))
            return
        self.requests[rid] = _DecodeRequest(msg, params, handoff, time.monotonic())
        self._grammars.start(rid, params)  # compiles while the pages are reserved and the KV travels
        self._reserve_queued()

    def _reserve_queued(self) -> None:
        """Reserve pages for queued requests, first come first served, while the pool has room."""
        for req in self._in(_S.QUEUED):
            rid = req.request_id
            total = self._reserve_tokens(req)
            if not self._pages.can_allocate(self._pages.pages_for(total)):
                if time.monotonic() - req.received_at > self.config.deadline_s:
                    req.handoff.abort("no free KV pages")
                    self._gone(req)
                    reason = f"timeout: no free KV pages for {total} tokens within {self.config.deadline_s:.0f}s"
                    self._out(P.RequestFailed(rid, self.role, reason))
                    continue
                return
            self._pages.tokens[rid] = total
            try:
                req.handoff.start()
            except (KvfenceError, MemoryError) as e:
                self._pages.tokens.pop(rid, None)
                req.handoff.abort(str(e))
                self._gone(req)
                self._out(P.RequestFailed(rid, self.role, f"cannot reserve pages: {e}"))

    def _reserve_tokens(self, req: _DecodeRequest) -> int:
        """Prompt + max_tokens, capped at the context length (the request can never hold more)."""
        return min(req.order.tokens_expected + req.params.max_tokens, self.engine.resolved.context_length)

    def _abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.abort_reason = reason
        h = req.handoff
        if req.state is _S.QUEUED:
            h.abort(reason)
            self._gone(req)
            self.counts["aborted"] += 1
        elif req.state in (_S.RESERVED, _S.RECEIVING):
            h.abort(reason)
            self._ended(req)
            if req.state is _S.FINISHED:  # settled at once: nothing was writing
                self._gone(req)
        elif req.state is _S.VERIFIED:  # verified but not in the batch yet: the pages are plain reserved ones
            self.engine.release(rid)
            self._finish(req)
            self.counts["aborted"] += 1
        elif req.state is _S.RUNNING:
            self.engine.abort_request(rid)
            self._finish(req)
            self.counts["aborted"] += 1
        # QUARANTINED: already ended; its pages are released once the transfer settled

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Work to do right now: requests in the engine, or a verified request that can enter the batch."""
        if self.engine.has_unfinished_requests():
            return True
        return any(not self._grammars.waiting(req.request_id) for req in self._in(_S.VERIFIED))

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
        return 0.001 if self._in(_S.RESERVED, _S.RECEIVING) else None

    def step(self) -> bool:
        self._reserve_queued()
        self.receiver.core.expire_pending()
        for req in self._in(_S.RESERVED, _S.RECEIVING, _S.QUARANTINED):
            before = req.state
            req.handoff.poll()
            if req.state is _S.QUARANTINED and before is not _S.QUARANTINED:
                self._ended(req)
            if req.state is _S.FINISHED:
                self._gone(req)
                if before is not _S.QUARANTINED:
                    self._ended(req)
        for req in self._in(_S.VERIFIED):
            self._enter_batch(req)
        # first tokens of requests that just entered the batch, before a forward
        self._send_tokens(self.engine.report_pending())
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
            if req is None or req.state is not _S.RUNNING:
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

    def _enter_batch(self, req: _DecodeRequest) -> None:
        """A verified request joins the engine's continuous batch, from the first token prefill put in its sealed
        manifest (once its grammar, if it has one, has compiled off the loop)."""
        rid, h = req.request_id, req.handoff
        if self._grammars.waiting(rid):
            return  # still compiling: the next step looks again
        record = h.record.to_dict() if h.record is not None else None
        why = self._grammars.outcome(rid)
        manifest = h.slot.manifest if h.slot is not None else None
        if not why and (manifest is None or manifest.first_token is None):
            why = "prefill's manifest carries no first token"
        first_logprobs: TokenLogprobs | None = None
        if not why and manifest is not None and manifest.first_logprobs is not None:
            first = P.logprobs_from_wire([manifest.first_logprobs])
            first_logprobs = first[0] if first else None
        if not why:
            assert manifest is not None and manifest.first_token is not None
            try:
                self.engine.add_prefilled_request(
                    rid, req.order.prompt_token_ids, manifest.first_token, req.params, first_logprobs=first_logprobs
                )
            except KvfenceError as e:
                why = f"cannot start decoding the request: {e}"
        if why:
            self.engine.release(rid)
            self._finish(req)
            self._out(P.RequestFailed(rid, self.role, why, integrity=record))
            return
        self.counts["verified" if self.config.verify else "unverified"] += 1
        self._skip_first_draw(rid)
        req.integrity = record
        h.enter_batch()

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

    def _ended(self, req: _DecodeRequest) -> None:
        """A handoff that failed or was aborted: count it and report it once (unless the router ended it); its pages
        stay QUARANTINED until no write can land (invariant 5, docs/handoff.md)."""
        if req.reported:
            return
        req.reported = True
        rec = req.handoff.record
        if rec is not None and rec.reason == Reason.ABORTED.value:
            self.counts["aborted"] += 1
        else:
            self.counts["rejected" if rec is not None and rec.status == "rejected" else "failed"] += 1
        if req.abort_reason is not None:
            return  # the router ended it and told the client already
        if rec is not None:
            what = "rejected" if rec.status == "rejected" else "failed"
            reason = f"KV handoff {what} ({rec.reason}): {rec.detail}"
        else:
            reason = f"KV handoff {req.state.value}"
        self._out(P.RequestFailed(req.request_id, self.role, reason, integrity=rec.to_dict() if rec else None))

    def _out(self, msg: P.Message) -> None:
        if self.send_msg is None:
            raise RuntimeError("decode: attach() a channel before handling messages")
        self.send_msg(msg)

    # -- numbers ----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        pool = P.engine_pool_stats(self.engine)
        queued, quarantined = self._in(_S.QUEUED), self._in(_S.QUARANTINED)
        return {
            **pool,
            "num_waiting": pool["num_waiting"] + len(queued),
            "pages_wanted": sum(self._pages.pages_for(self._reserve_tokens(req)) for req in queued),
            "handoffs_in_flight": len(self._in(_S.RESERVED, _S.RECEIVING, _S.VERIFYING, _S.VERIFIED)),
            "handoffs_quarantined": len(quarantined),
            "handoffs_overdue": sum(req.handoff.overdue for req in quarantined),  # a write could still land
            **{f"handoffs_{k}": v for k, v in self.counts.items()},
            "security_events": self.auth.events.counts(),
        }

    def idle(self) -> bool:
        return not self.requests and not self.busy

    def close(self) -> None:
        self._grammars.close()
        try:
            self.receiver.close()
        except Exception:
            logger.exception("decode: closing the receiver failed")
