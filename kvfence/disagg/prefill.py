"""The prefill worker: runs prompts, sends their KV to decode, frees it only when that is safe.

What it knows: the requests the router ordered (each runs in its engine as a
`prefill_only` request: the prompt is computed, the first token sampled, and the pages
kept under the request id), one `PrefillHandoff` per request once its prompt is done
(build the manifest, send over the data plane to the address the router gave, hold
the source pages until decode's verdict, an abort the send thread has acted on, or the
ack deadline), and what to tell the router (`PrefillSent` with the first token and
the log probabilities the request asked for — the first token's and the prompt's —
or `RequestFailed` for failures of its own).

What it does not know: decode's page numbers (the transport maps logical pages), the
router's expectation (decode checks it), HTTP or text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from kvfence.disagg import protocol as P
from kvfence.disagg.handoff import HandoffConfig, PrefillHandoff, PrefillState
from kvfence.disagg.router import params_from_dict
from kvfence.engine.llm_engine import RequestOutput
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.transfer.base import Sender, SendStatus, TransferConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    transport: str = "tcp"  # "tcp" | "mooncake" | "local" (in-process tests)
    deadline_s: float = 60.0  # send deadline, then ack deadline, for one handoff
    strict: bool = False  # poison source pages before they are freed
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        assert self.transport in ("tcp", "mooncake", "local"), self.transport
        assert self.deadline_s > 0, self.deadline_s


class _EnginePages:
    """The allocator verbs `PrefillHandoff` uses, routed through the engine so its held-request table stays right."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def pages_of(self, request_id: str) -> list[int]:
        return self.engine.allocator.pages_of(request_id)

    def free(self, request_id: str) -> list[int]:
        return self.engine.release(request_id)


class PrefillWorker:
    role = "prefill"

    def __init__(
        self,
        engine: Any,
        identity: Any,
        config: PrefillConfig | None = None,
        faults: FaultInjector | None = None,
        sender: Sender | None = None,
    ) -> None:
        self.engine = engine  # kvfence.engine.llm_engine.LLMEngine
        self.identity = identity  # worker.WorkerIdentity
        self.config = config or PrefillConfig()
        self.faults = faults
        if sender is None:
            if self.config.transport == "local":
                raise KvfenceError("prefill: an in-process (local) transport needs its sender passed in")
            if self.config.transport == "mooncake":
                from kvfence.transfer.mooncake import MooncakeSender

                sender = MooncakeSender(engine.pool, self.config.transfer, faults)
            else:
                from kvfence.transfer.tcp import TcpSender

                sender = TcpSender(engine.pool, self.config.transfer, faults)
        self.sender = sender
        self._pages = _EnginePages(engine)
        self._handoff_config = HandoffConfig(
            transfer_timeout_s=self.config.deadline_s,
            ack_timeout_s=self.config.deadline_s,
            quarantine_timeout_s=self.config.deadline_s,
            strict=self.config.strict,
        )
        self.send_msg: Any = None  # set by `attach`
        self.orders: dict[str, P.PrefillOrder] = {}  # prompt running in the engine, or computed and waiting
        self.computed: dict[str, RequestOutput] = {}  # prompt done, pages held, until decode's DecodeReserved
        self.handoffs: dict[str, PrefillHandoff] = {}  # prompt done, pages held until settled
        self.counts: dict[str, int] = {"prefilled": 0, "released": 0, "failed": 0, "aborted": 0}

    def attach(self, send: Any) -> None:
        self.send_msg = send

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
            h = self.handoffs.get(msg.request_id)
            if h is not None and h.state in (PrefillState.SENDING, PrefillState.AWAITING_ACK):
                h.settle(msg.verified, "" if msg.verified else "decode rejected the pages")
        elif not isinstance(msg, P.RegisterReply):
            logger.warning("prefill: unexpected %s", msg.kind)

    def _order(self, msg: P.PrefillOrder) -> None:
        rid = msg.request_id
        if rid in self.orders or rid in self.handoffs:
            self._fail(rid, f"request id {rid!r} is already in use on prefill")
            return
        try:
            self.engine.add_request(
                rid,
                sampling_params=params_from_dict(msg.params),
                prompt_token_ids=msg.prompt_token_ids,
                prefill_only=True,
            )
        except KvfenceError as e:
            self._fail(rid, str(e))
            return
        self.orders[rid] = msg

    def _reserved(self, msg: P.DecodeReserved) -> None:
        """Decode reserved the pages: the order now knows where to send (at once, if the prompt is done)."""
        order = self.orders.get(msg.request_id)
        if order is None:
            return  # aborted meanwhile
        self.orders[msg.request_id] = dataclasses.replace(
            order, handoff_address=msg.handoff_address, transfer_info=msg.transfer_info
        )
        done = self.computed.pop(msg.request_id, None)
        if done is not None:
            self._send(done)

    def _abort(self, rid: str, reason: str) -> None:
        if self.computed.pop(rid, None) is not None:  # computed, waiting for decode: its pages are held
            self.orders.pop(rid, None)
            self.engine.release(rid)
            self.counts["aborted"] += 1
        if self.orders.pop(rid, None) is not None:
            self.engine.abort_request(rid)  # frees its pages: nothing was sent yet
            self.counts["aborted"] += 1
        h = self.handoffs.get(rid)
        if h is not None:
            h.abort(reason)  # the send thread stops; pages are freed once it no longer reads them
            h.poll()
            self._settle(rid, h)

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
                    self._send(out)
                elif out.finished:  # aborted inside the engine
                    self.orders.pop(out.request_id, None)
        for rid, h in list(self.handoffs.items()):
            before = h.state
            h.poll()
            if h.state == PrefillState.FAILED and before != PrefillState.FAILED:
                self._report_failure(rid, h)
            self._settle(rid, h)
        return worked

    def _send(self, out: RequestOutput) -> None:
        rid, first_token = out.request_id, out.new_token_ids[-1]
        order = self.orders.get(rid)
        if order is None:  # aborted while its last chunk ran: give the pages back
            self.engine.release(rid)
            return
        if not order.handoff_address:  # decode has not reserved yet: hold the KV until it has
            self.computed[rid] = out
            return
        del self.orders[rid]
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
            first_token=int(first_token),
            first_logprobs=first[0] if first else None,
        )
        self.handoffs[rid] = h
        h.send()
        self.counts["prefilled"] += 1
        if h.state == PrefillState.FAILED:
            self._report_failure(rid, h)
            self._settle(rid, h)
            return
        assert h.manifest is not None
        self._out(
            P.PrefillSent(
                rid,
                h.manifest.num_pages,
                h.manifest.num_tokens,
                int(first_token),
                first_logprobs=first[0] if first else None,
                prompt_logprobs=P.logprobs_to_wire(out.prompt_logprobs),
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

    def _settle(self, rid: str, h: PrefillHandoff) -> None:
        if h.settled:
            del self.handoffs[rid]
            self.engine.release(rid)  # no-op for the pages (already freed); drops any held entry
            self.counts["released"] += 1

    def _fail(self, rid: str, reason: str) -> None:
        self.counts["failed"] += 1
        self._out(P.RequestFailed(rid, self.role, reason))

    def _out(self, msg: P.Message) -> None:
        assert self.send_msg is not None, "attach() a channel first"
        self.send_msg(msg)

    # -- numbers ----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            **P.engine_pool_stats(self.engine),
            "queued_prompt_tokens": sum(len(o.prompt_token_ids) for o in self.orders.values()),  # not prefilled yet
            "handoffs_in_flight": len(self.handoffs),
            **{f"handoffs_{k}": v for k, v in self.counts.items()},
        }

    def idle(self) -> bool:
        """Nothing running and no pages held (tests wait for this before checking the pool)."""
        return not self.orders and not self.handoffs and not self.engine.has_unfinished_requests()

    def close(self) -> None:
        try:
            self.sender.close()
        except Exception:  # closing at shutdown must not mask the real exit reason
            logger.exception("prefill: closing the sender failed")
