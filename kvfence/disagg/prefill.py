"""The prefill worker: runs prompts, sends their KV to decode, frees it only when that is safe.

What it knows: the requests the router ordered, one `_PrefillRequest` record each whose one
state (`PrefillState`: computing, sending, awaiting the verdict, finished; docs/handoff.md, "One
request") is its `PrefillHandoff`'s, moved only along `PREFILL_TRANSITIONS`. Each runs in its
engine as a `prefill_only` request (after its grammar, if any, compiled off the loop): the prompt
is computed, the first token sampled, and the pages kept under the request id. The moment a
prompt is computed prefill tells the router its first token (`Tokens`: the token, its text, the
logprobs the request asked for, the prompt's), then sends the manifest (which carries that token
too) and the pages to the decode address in its order, and holds the source pages until decode's
verdict on the data plane, an abort the send thread has acted on, or the verdict deadline.
Failures of its own it reports (`RequestFailed`); decode reports its rejections itself.

What it does not know: decode's page numbers (the transport maps logical pages), the
router's expectation (decode checks it), HTTP or text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfence.auth.plane import PlaneAuth
from kvfence.disagg import messages as P
from kvfence.disagg.config_checks import require_choice, require_positive
from kvfence.disagg.grammars import GrammarWaits
from kvfence.disagg.handoff import HandoffConfig, PrefillHandoff, PrefillState
from kvfence.disagg.worker_engine import PrefillEngine
from kvfence.engine.llm_engine import RequestOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.structured_output import GrammarBudget
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.transfer.base import TRANSFER_BACKENDS, Sender, TransferConfig, is_transfer_id

if TYPE_CHECKING:
    from kvfence.disagg.worker import WorkerIdentity

logger = logging.getLogger(__name__)
_S = PrefillState


@dataclass(frozen=True)
class PrefillConfig:
    transport: str = "tcp"  # the transfer backend, one of TRANSFER_BACKENDS (field name kept: worker_main sets it)
    deadline_s: float = 60.0  # send deadline (decode's `ready` included), then verdict deadline, for one handoff
    strict: bool = False  # poison source pages before they are freed
    transfer: TransferConfig = field(default_factory=TransferConfig)
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)  # response_format compiles, off the loop

    def __post_init__(self) -> None:
        require_choice(self, "transport", TRANSFER_BACKENDS)
        require_positive(self, "deadline_s")


class _EnginePages:
    """The allocator verbs `PrefillHandoff` uses, routed through the engine so its held-request table stays right."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    def pages_of(self, request_id: str) -> list[int]:
        """Every page the held request's prompt sits in, in order: its own and the prefix-cache pages it reads."""
        return self.engine.held_pages(request_id)

    def owned_pages_of(self, request_id: str) -> list[int]:
        """The pages only this request holds (strict mode may poison these; shared cached pages never)."""
        return self.engine.allocator.pages_of(request_id)

    def free(self, request_id: str) -> list[int]:
        return self.engine.release(request_id)


@dataclass
class _PrefillRequest:
    """One request on the prefill worker, from its order until its source pages are freed; its state is its
    handoff's."""

    order: P.Order
    params: SamplingParams
    handoff: PrefillHandoff
    reported: bool = False  # its failure was reported (or decode reports it)

    @property
    def request_id(self) -> str:
        return self.order.request_id

    @property
    def state(self) -> PrefillState:
        return self.handoff.state


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
        if self.config.strict and engine.prefix_cache is not None:
            engine.prefix_cache.before_free = engine.pool.poison  # evicted cached KV is wiped too
        self._handoff_config = HandoffConfig(
            transfer_timeout_s=self.config.deadline_s,
            verdict_timeout_s=self.config.deadline_s,
            quarantine_timeout_s=self.config.deadline_s,
            strict=self.config.strict,
        )
        self.send_msg: Callable[[P.Message], None] | None = None  # set by `attach`
        self.requests: dict[str, _PrefillRequest] = {}  # every request not FINISHED, in arrival order
        self._grammars = GrammarWaits(engine, self.config.grammar_budget)  # COMPUTING requests not in the engine yet
        self.counts: dict[str, int] = {"prefilled": 0, "released": 0, "failed": 0, "aborted": 0}

    def attach(self, send: Callable[[P.Message], None]) -> None:
        self.send_msg = send

    def held_request_ids(self) -> list[str]:
        """Every request this worker holds, in any state but FINISHED (what a lost router's requests are)."""
        return list(self.requests)

    def ids(self, state: PrefillState) -> list[str]:
        """The requests in `state`, in arrival order."""
        return [rid for rid, req in self.requests.items() if req.state is state]

    def _in(self, *states: PrefillState) -> list[_PrefillRequest]:
        return [req for req in self.requests.values() if req.state in states]

    def registration(self) -> P.Register:
        from kvfence.disagg.worker import registration_for

        return registration_for(self.role, self.engine, self.identity)

    # -- messages ---------------------------------------------------------------------------------------------
    def handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.Order):
            self._order(msg)
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id, msg.reason)
        elif not isinstance(msg, P.RegisterReply):
            logger.warning("prefill: unexpected %s", msg.kind)

    def _order(self, msg: P.Order) -> None:
        rid = msg.request_id
        if rid in self.requests:
            self._fail(rid, f"request id {rid!r} is already in use on prefill")
            return
        try:
            if not is_transfer_id(msg.transfer_id):
                raise KvfenceError("the router's transfer id is not a 128-bit capability")
            if not msg.decode_address:
                raise KvfenceError("the order names no decode address")
            params = P.params_from_wire(msg.params)
            handoff = PrefillHandoff(
                rid,
                msg.prompt_token_ids,
                self._pages,  # type: ignore[arg-type]
                self.engine.pool,
                self.sender,
                msg.decode_address,
                self._handoff_config,
                self.faults,
                transfer_id=msg.transfer_id,
            )
        except (KvfenceError, ValueError) as e:
            self._fail(rid, str(e))
            return
        req = _PrefillRequest(msg, params, handoff)
        self.requests[rid] = req
        if not self._grammars.start(rid, params):  # else it enters the engine once its grammar compiled
            self._compute(req)

    def _compute(self, req: _PrefillRequest) -> None:
        """Into the engine (prefill_only); a request the engine refuses fails here."""
        try:
            self.engine.add_request(
                req.request_id, sampling_params=req.params, prompt_token_ids=req.order.prompt_token_ids,
                prefill_only=True,
            )  # fmt: skip
        except KvfenceError as e:
            self._drop(req, str(e))

    def _drop(self, req: _PrefillRequest, reason: str, report: bool = True) -> None:
        """A request that never reached its transfer: its pages (if any) freed, gone from here."""
        self.engine.abort_request(req.request_id)
        self._grammars.forget(req.request_id)
        req.handoff.abort(reason)  # COMPUTING -> FINISHED (nothing to free any more)
        del self.requests[req.request_id]
        if report:
            self._fail(req.request_id, reason)

    def _abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.reported = True  # the router ended it
        if req.state is _S.COMPUTING:
            self._drop(req, reason, report=False)
            self.counts["aborted"] += 1
        else:
            req.handoff.abort(reason)  # the send thread stops; pages are freed once it no longer reads them
            self._settle(req)

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> bool:
        worked = False
        for rid in self._grammars.ended():  # grammars compiled off the loop: into the engine, or failed
            why = self._grammars.outcome(rid)
            req = self.requests.get(rid)
            if req is None or req.state is not _S.COMPUTING:
                continue
            if why:
                self._drop(req, why)
            else:
                self._compute(req)
        if self.engine.has_unfinished_requests():
            worked = True
            for out in self.engine.step():
                req = self.requests.get(out.request_id)
                if req is None or req.state is not _S.COMPUTING:
                    if out.finish_reason == "prefill_done":  # aborted while its last chunk ran: pages back
                        self.engine.release(out.request_id)
                    continue
                if out.finish_reason == "prefill_done":
                    self._computed(req, out)
                elif out.finished:  # aborted inside the engine
                    self._drop(req, f"the engine ended the request ({out.finish_reason})")
        for req in self._in(_S.SENDING, _S.AWAITING_VERDICT):
            req.handoff.poll()
            self._settle(req)
        return worked

    def _computed(self, req: _PrefillRequest, out: RequestOutput) -> None:
        """The prompt is computed: its first token to the router now (it may stream it while the KV travels), and
        the manifest (carrying that token too) and pages to decode."""
        token = int(out.new_token_ids[-1])
        first = P.logprobs_to_wire(out.new_logprobs[-1:]) if out.new_logprobs else None
        self._out(
            P.Tokens(
                req.request_id,
                [token],
                text=self.engine.first_token_text(token, req.params),
                num_output_tokens=1,
                logprobs=first,
                prompt_logprobs=P.logprobs_to_wire(out.prompt_logprobs),
            )
        )
        h = req.handoff
        h.first_token, h.first_logprobs = token, first[0] if first else None
        h.send()
        self.counts["prefilled"] += 1
        self._settle(req)

    def _settle(self, req: _PrefillRequest) -> None:
        """Report a failure of its own once; forget the request once its pages are freed."""
        h = req.handoff
        if h.outcome == "failed" and not req.reported:
            req.reported = True
            handle = h.handle
            if handle is None or not handle.decode_refused:  # decode reports its rejections and aborts itself
                lost = handle is not None and handle.peer_lost  # its decode worker is gone
                code = P.WORKER_LOST if lost else ""
                self._out(P.RequestFailed(req.request_id, self.role, f"KV handoff failed on prefill: {h.reason}",
                                          code=code))  # fmt: skip
            self.counts["failed"] += 1
        if h.settled:
            del self.requests[req.request_id]
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
            # not handed off yet (its grammar compiling, or its prompt computing)
            # the router's measure: each prompt less what the router expected its prefix cache to serve
            "queued_prompt_tokens": sum(
                len(req.order.prompt_token_ids) - req.order.expected_cached_tokens for req in self._in(_S.COMPUTING)
            ),
            "handoffs_in_flight": len(self._in(_S.SENDING, _S.AWAITING_VERDICT)),
            **{f"handoffs_{k}": v for k, v in self.counts.items()},
            "security_events": self.auth.events.counts(),
        }

    def idle(self) -> bool:
        """Nothing running and no pages held (tests wait for this before checking the pool)."""
        return not self.requests and not self.engine.has_unfinished_requests()

    def close(self) -> None:
        self._grammars.close()
        try:
            self.sender.close()
        except Exception:  # closing at shutdown must not mask the real exit reason
            logger.exception("prefill: closing the sender failed")
