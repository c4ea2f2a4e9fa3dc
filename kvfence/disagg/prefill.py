"""The prefill worker: runs prompts, sends their KV to decode, frees it only when that is safe.

What it knows: the requests the router ordered, one `_PrefillRequest` record each whose
`PrefillRequestState` moves only along `PREFILL_REQUEST_TRANSITIONS` (computing, computed,
handoff, finished; docs/handoff.md, "Lifecycles") (each runs in its engine as a
`prefill_only` request: the prompt is computed, the first token sampled, and the pages
kept under the request id), one `PrefillHandoff` per request once its prompt is done
(build the manifest, send over the data plane to the address the router gave, hold
the source pages until decode's verdict, an abort the send thread has acted on, or the
verdict deadline), and what to tell the router (`FirstToken` the moment a prompt is
computed: the first token, its text, the log probabilities the request asked for — the
first token's and the prompt's; `PrefillSent` once the transfer started; or
`RequestFailed` for failures of its own).

What it does not know: decode's page numbers (the transport maps logical pages), the
router's expectation (decode checks it), HTTP or text.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvfence.auth.plane import PlaneAuth
from kvfence.disagg import messages as P
from kvfence.disagg.config_checks import require_choice, require_positive
from kvfence.disagg.handoff import HandoffConfig, PrefillHandoff, PrefillState
from kvfence.disagg.lifecycle import Lifecycle
from kvfence.disagg.worker_engine import PrefillEngine
from kvfence.engine.llm_engine import RequestOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.transfer.base import TRANSFER_BACKENDS, Sender, SendStatus, TransferConfig, is_transfer_id

if TYPE_CHECKING:
    from kvfence.disagg.worker import WorkerIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    transport: str = "tcp"  # the transfer backend, one of TRANSFER_BACKENDS (field name kept: worker_main sets it)
    deadline_s: float = 60.0  # send deadline, then verdict deadline, for one handoff
    strict: bool = False  # poison source pages before they are freed
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        require_choice(self, "transport", TRANSFER_BACKENDS)
        require_positive(self, "deadline_s")


class _EnginePages:
    """The allocator verbs `PrefillHandoff` uses, routed through the engine so its held-request table stays right."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    def pages_of(self, request_id: str) -> list[int]:
        return self.engine.allocator.pages_of(request_id)

    def free(self, request_id: str) -> list[int]:
        return self.engine.release(request_id)


class PrefillRequestState(str, Enum):
    """Where one request stands on the prefill worker (docs/handoff.md, "Lifecycles")."""

    COMPUTING = "computing"  # the prompt runs in the engine (prefill_only); decode may reserve meanwhile
    COMPUTED = "computed"  # prompt done, pages held; waiting for decode's DecodeReserved (where to send)
    HANDOFF = "handoff"  # the `PrefillHandoff` sends and holds the source pages until it settled
    FINISHED = "finished"  # gone from this worker (pages freed)


_Q = PrefillRequestState
PREFILL_REQUEST_TRANSITIONS: dict[PrefillRequestState, frozenset[PrefillRequestState]] = {
    _Q.COMPUTING: frozenset({_Q.COMPUTED, _Q.HANDOFF, _Q.FINISHED}),  # HANDOFF at once when decode reserved first
    _Q.COMPUTED: frozenset({_Q.HANDOFF, _Q.FINISHED}),
    _Q.HANDOFF: frozenset({_Q.FINISHED}),
    _Q.FINISHED: frozenset(),
}


@dataclass
class _PrefillRequest:
    """One request on the prefill worker, from PrefillOrder until its source pages are freed."""

    order: P.PrefillOrder  # its handoff_address is filled in when decode's DecodeReserved arrives
    params: SamplingParams
    computed: RequestOutput | None = None  # the prompt's output (first token, logprobs), once COMPUTED
    computed_at: float | None = None  # when it became COMPUTED: it holds pages from then on, at most `deadline_s`
    handoff: PrefillHandoff | None = None  # from HANDOFF on
    lifecycle: Lifecycle[PrefillRequestState] = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(f"prefill request {self.request_id}", _Q.COMPUTING, PREFILL_REQUEST_TRANSITIONS)

    @property
    def request_id(self) -> str:
        return self.order.request_id

    @property
    def state(self) -> PrefillRequestState:
        return self.lifecycle.state

    def advance(self, new: PrefillRequestState) -> None:
        self.lifecycle.advance(new)


class PrefillWorker:
    role = "prefill"

    def __init__(
        self,
        engine: PrefillEngine,
        identity: WorkerIdentity,
        config: PrefillConfig | None = None,
        faults: FaultInjector | None = None,
        sender: Sender | None = None,
        *,
        auth: PlaneAuth,
    ) -> None:
        """`auth`: the cluster key's data-plane keys and this process's security events; a `sender` passed in
        must use the same."""
        self.engine = engine  # kvfence.engine.llm_engine.LLMEngine
        self.identity = identity  # worker.WorkerIdentity
        self.config = config or PrefillConfig()
        self.faults = faults
        self.auth = auth
        if sender is None:
            if self.config.transport == "local":
                raise KvfenceError("prefill: the local (in-process) transfer backend needs its sender passed in")
            if self.config.transport == "mooncake":
                from kvfence.transfer.mooncake import MooncakeSender

                sender = MooncakeSender(engine.pool, self.config.transfer, faults, auth=auth)
            else:
                from kvfence.transfer.tcp import TcpSender

                sender = TcpSender(engine.pool, self.config.transfer, faults, auth=auth)
        self.sender = sender
        self._pages = _EnginePages(engine)
        self._handoff_config = HandoffConfig(
            transfer_timeout_s=self.config.deadline_s,
            verdict_timeout_s=self.config.deadline_s,
            quarantine_timeout_s=self.config.deadline_s,
            strict=self.config.strict,
        )
        self.send_msg: Callable[[P.Message], None] | None = None  # set by `attach`
        self.requests: dict[str, _PrefillRequest] = {}  # every request not FINISHED, in arrival order
        self.counts: dict[str, int] = {"prefilled": 0, "released": 0, "failed": 0, "aborted": 0}

    def attach(self, send: Callable[[P.Message], None]) -> None:
        self.send_msg = send

    def held_request_ids(self) -> list[str]:
        """Every request this worker holds, in any state but FINISHED (what a lost router's requests are)."""
        return list(self.requests)

    def ids(self, state: PrefillRequestState) -> list[str]:
        """The requests in `state`, in arrival order."""
        return [rid for rid, req in self.requests.items() if req.state is state]

    def _in(self, state: PrefillRequestState) -> list[_PrefillRequest]:
        return [req for req in self.requests.values() if req.state is state]

    def _finish(self, req: _PrefillRequest) -> None:
        req.advance(_Q.FINISHED)
        del self.requests[req.request_id]

    def registration(self) -> P.Register:
        from kvfence.disagg.worker import registration_for

        return registration_for(self.role, self.engine, self.identity)

    # -- messages ---------------------------------------------------------------------------------------------
    def handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.PrefillOrder):
            self._order(msg)
        elif isinstance(msg, P.DecodeReserved):
            self._reserved(msg)
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id, msg.reason)
        elif isinstance(msg, P.ReleaseSource):
            req = self.requests.get(msg.request_id)
            h = req.handoff if req is not None else None
            if h is not None and h.state in (PrefillState.SENDING, PrefillState.AWAITING_VERDICT):
                h.settle(msg.verified, "" if msg.verified else "decode rejected the pages")
        elif not isinstance(msg, P.RegisterReply):
            logger.warning("prefill: unexpected %s", msg.kind)

    def _order(self, msg: P.PrefillOrder) -> None:
        rid = msg.request_id
        if rid in self.requests:
            self._fail(rid, f"request id {rid!r} is already in use on prefill")
            return
        if not is_transfer_id(msg.transfer_id):
            self._fail(rid, "the router's transfer id is not a 128-bit capability")
            return
        try:
            params = P.params_from_wire(msg.params)
            self.engine.add_request(
                rid, sampling_params=params, prompt_token_ids=msg.prompt_token_ids, prefill_only=True
            )
        except KvfenceError as e:
            self._fail(rid, str(e))
            return
        self.requests[rid] = _PrefillRequest(msg, params)

    def _reserved(self, msg: P.DecodeReserved) -> None:
        """Decode reserved the pages: the order now knows where to send (at once, if the prompt is done)."""
        req = self.requests.get(msg.request_id)
        if req is None or req.state not in (_Q.COMPUTING, _Q.COMPUTED):
            return  # aborted meanwhile
        req.order = dataclasses.replace(req.order, handoff_address=msg.handoff_address, transfer_info=msg.transfer_info)
        if req.computed is not None:
            self._send(req.computed)

    def _abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if req.state is _Q.COMPUTED:  # computed, waiting for decode: its pages are held
            self._finish(req)
            self.engine.release(rid)
            self.counts["aborted"] += 1
        elif req.state is _Q.COMPUTING:
            self._finish(req)
            self.engine.abort_request(rid)  # frees its pages: nothing was sent yet
            self.counts["aborted"] += 1
        elif req.handoff is not None:
            h = req.handoff
            h.abort(reason)  # the send thread stops; pages are freed once it no longer reads them
            h.poll()
            self._settle(req)

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> bool:
        worked = False
        if self.engine.has_unfinished_requests():
            worked = True
            for out in self.engine.step():
                if out.finish_reason == "prefill_done":
                    self._first_token(out)
                    self._send(out)
                elif out.finished:  # aborted inside the engine
                    req = self.requests.get(out.request_id)
                    if req is not None and req.state is _Q.COMPUTING:
                        self._finish(req)
        self._expire_computed()
        for req in self._in(_Q.HANDOFF):
            h = req.handoff
            assert h is not None  # HANDOFF is entered with its handoff
            before = h.state
            h.poll()
            if h.state == PrefillState.FAILED and before != PrefillState.FAILED:
                self._report_failure(req.request_id, h)
            self._settle(req)
        return worked

    def _expire_computed(self) -> None:
        """No page is held without a clock: a computed prompt whose decode reservation has not come within
        `deadline_s` (its relay was lost, or the router with it) is dropped and its pages freed."""
        now = time.monotonic()
        for req in self._in(_Q.COMPUTED):
            if req.computed_at is not None and now - req.computed_at > self.config.deadline_s:
                self._finish(req)
                self.engine.release(req.request_id)
                self._fail(
                    req.request_id,
                    f"timeout: decode's reservation never reached prefill within {self.config.deadline_s:.0f}s of the "
                    "prompt being computed; its KV was dropped",
                )

    def _first_token(self, out: RequestOutput) -> None:
        """Tell the router the first token now: it may stream it while the KV still travels to decode."""
        req = self.requests.get(out.request_id)
        if req is None:
            return
        token = int(out.new_token_ids[-1])
        first = P.logprobs_to_wire(out.new_logprobs[-1:]) if out.new_logprobs else None
        self._out(
            P.FirstToken(
                out.request_id,
                token,
                text=self.engine.first_token_text(token, req.params),
                first_logprobs=first[0] if first else None,
                prompt_logprobs=P.logprobs_to_wire(out.prompt_logprobs),
            )
        )

    def _send(self, out: RequestOutput) -> None:
        rid, first_token = out.request_id, out.new_token_ids[-1]
        req = self.requests.get(rid)
        if req is None:  # aborted while its last chunk ran: give the pages back
            self.engine.release(rid)
            return
        order = req.order
        if not order.handoff_address:  # decode has not reserved yet: hold the KV until it has (or the deadline)
            req.computed, req.computed_at = out, time.monotonic()
            req.advance(_Q.COMPUTED)
            return
        first = P.logprobs_to_wire(out.new_logprobs[-1:]) if out.new_logprobs else None
        h = PrefillHandoff(
            rid,
            order.prompt_token_ids,
            self._pages,  # type: ignore[arg-type]
            self.engine.pool,
            self.sender,
            order.handoff_address,
            self._handoff_config,
            self.faults,
            transfer_id=order.transfer_id,
            first_token=int(first_token),
            first_logprobs=first[0] if first else None,
        )
        req.handoff, req.computed = h, None
        req.advance(_Q.HANDOFF)
        h.send()
        self.counts["prefilled"] += 1
        if h.state == PrefillState.FAILED:
            self._report_failure(rid, h)
            self._settle(req)
            return
        assert h.manifest is not None  # SENDING is entered with its manifest
        self._out(
            P.PrefillSent(
                rid,
                h.manifest.num_pages,
                h.manifest.num_tokens,
                int(first_token),
                first_logprobs=first[0] if first else None,  # the prompt's went with FirstToken
            )
        )

    def _report_failure(self, rid: str, h: PrefillHandoff) -> None:
        """Tell the router about failures of our own; decode reports its rejections and aborts itself."""
        st = h.handle.status if h.handle is not None else None
        from_decode = st == SendStatus.REJECTED or (
            st == SendStatus.ABORTED and h.handle is not None and h.handle.remote_abort is not None
        )
        if not from_decode:
            lost = h.handle is not None and h.handle.peer_lost  # its decode worker is gone
            code = P.WORKER_LOST if lost else ""
            self._out(P.RequestFailed(rid, self.role, f"KV handoff failed on prefill: {h.reason}", code=code))
        self.counts["failed"] += 1

    def _settle(self, req: _PrefillRequest) -> None:
        if req.handoff is not None and req.handoff.settled:
            self._finish(req)
            self.engine.release(req.request_id)  # no-op for the pages (already freed); drops any held entry
            self.counts["released"] += 1

    def _fail(self, rid: str, reason: str) -> None:
        self.counts["failed"] += 1
        self._out(P.RequestFailed(rid, self.role, reason))

    def _out(self, msg: P.Message) -> None:
        if self.send_msg is None:
            raise RuntimeError("prefill: attach() a channel before handling messages")
        self.send_msg(msg)

    # -- numbers ----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            **P.engine_pool_stats(self.engine),
            # not handed off yet (computing, or computed and waiting for decode)
            "queued_prompt_tokens": sum(
                len(req.order.prompt_token_ids) for req in self.requests.values() if req.state is not _Q.HANDOFF
            ),
            "handoffs_in_flight": len(self._in(_Q.HANDOFF)),
            **{f"handoffs_{k}": v for k, v in self.counts.items()},
            "security_events": self.auth.events.counts(),
        }

    def idle(self) -> bool:
        """Nothing running and no pages held (tests wait for this before checking the pool)."""
        return not self.requests and not self.engine.has_unfinished_requests()

    def close(self) -> None:
        try:
            self.sender.close()
        except Exception:  # closing at shutdown must not mask the real exit reason
            logger.exception("prefill: closing the sender failed")
