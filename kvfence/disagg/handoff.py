"""One request on each side of a KV handoff: its state, one enum per side, and what each side does in each.

What it knows: the states a request goes through on decode and on prefill, the only transitions
allowed between them (an illegal one raises), and what each side does on entering a state. The
handoff's sub-states are the request's states: there is no second machine beside it.

    decode:   QUEUED ─pages─▶ RESERVED ─manifest─▶ RECEIVING ─done─▶ VERIFYING ─ok─▶ VERIFIED ─▶ RUNNING ─▶ FINISHED
                │                │                   │                   └─bad─┐
                │                └─── error / timeout / abort ───────────┴──▶ QUARANTINED ─settled─▶ FINISHED
                └──abort, no pages in time──────────────────────────────────────────────────────▶ FINISHED

    prefill:  COMPUTING ─send─▶ SENDING ─done─▶ AWAITING_VERDICT ─verdict, or the end of a failed send─▶ FINISHED
                  └──abort───────────────────────────────────────────────────────────────────────────▶ FINISHED

- Decode allocates the pages for the router's expected length (never prefill's claim),
  registers them with its receiver, and lets the request into the batch only after
  `integrity.verify` passes. A failed or aborted request's pages go to the allocator's
  quarantine (QUARANTINED); they are released (and poisoned again in strict mode) only once the
  receive slot is settled: no write of that transfer can still land. No deadline frees
  a page. When the quarantine deadline passes with the slot still unsettled (a write
  stuck mid-page), decode cuts the transfer's connection (`Receiver.sever`) so the
  stuck write fails, and releases once it has ended.
- Prefill keeps its source pages until decode's verdict arrives or the send ended, and
  in both cases only once the send thread has stopped reading them (`sender_done`);
  then it frees them (poisoned first in strict mode) and the request is FINISHED. When the
  verdict deadline passes with the send thread still inside a write, prefill cuts its
  connection so the write fails. How it ended (verified or why not) is `outcome`, not a state.
- Each decode handoff ends with exactly one `IntegrityRecord` (invariant 8, docs/handoff.md), counted in
  the `IntegrityMetrics` passed in.

Both objects are driven by a worker loop calling the non-blocking `poll()`; nothing
here starts a thread. Timeouts come from `HandoffConfig`; the clock is injectable.

What it does not know: scheduling, models or the router; messages to the router are
the worker's business (`disagg.messages`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvfence.disagg.config_checks import require_positive
from kvfence.disagg.lifecycle import IllegalTransition as IllegalTransition  # re-exported: raised by the machines here
from kvfence.disagg.lifecycle import Lifecycle
from kvfence.faults import FaultInjector
from kvfence.integrity.manifest import HandoffManifest, build_manifest, pages_for_tokens
from kvfence.integrity.record import IntegrityMetrics, IntegrityRecord
from kvfence.integrity.verify import Expectation, Reason, VerifyResult, verify_handoff
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import Receiver, ReceiveSlot, Sender, SendHandle, transfer_ref

logger = logging.getLogger(__name__)


class DecodeState(str, Enum):
    """Where one request stands on the decode worker, from its order until it is gone."""

    QUEUED = "queued"  # ordered; waiting for free pages
    RESERVED = "reserved"  # pages reserved for the router's length, receive slot open; no manifest yet
    RECEIVING = "receiving"  # the sender's manifest accepted: pages landing
    VERIFYING = "verifying"  # the sender said done: the checks run
    VERIFIED = "verified"  # every check passed: about to enter the batch (prefill's first token, its grammar)
    RUNNING = "running"  # in the engine's batch, streaming tokens
    QUARANTINED = "quarantined"  # failed or aborted: its pages wait until no write of its transfer can land
    FINISHED = "finished"  # gone from this worker (finished, failed, aborted; every page back)


class PrefillState(str, Enum):
    """Where one request stands on the prefill worker, from its order until its pages are freed."""

    COMPUTING = "computing"  # the prompt runs in the engine (prefill_only), or its grammar compiles first
    SENDING = "sending"  # manifest and pages on their way to decode (source pages held)
    AWAITING_VERDICT = "awaiting_verdict"  # `done` sent: the pages are held until decode's verdict
    FINISHED = "finished"  # gone from this worker (pages freed); `outcome` says how it ended


_D, _P = DecodeState, PrefillState
DECODE_TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    _D.QUEUED: frozenset({_D.RESERVED, _D.FINISHED}),  # reserved; or aborted, no pages in time, cannot reserve
    _D.RESERVED: frozenset({_D.RECEIVING, _D.QUARANTINED}),
    _D.RECEIVING: frozenset({_D.VERIFYING, _D.QUARANTINED}),
    _D.VERIFYING: frozenset({_D.VERIFIED, _D.QUARANTINED}),
    # into the batch; or gone before it (aborted, prefill's first tokens disagree, cannot enter the batch)
    _D.VERIFIED: frozenset({_D.RUNNING, _D.FINISHED}),
    _D.RUNNING: frozenset({_D.FINISHED}),
    _D.QUARANTINED: frozenset({_D.FINISHED}),
    _D.FINISHED: frozenset(),
}
PREFILL_TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    _P.COMPUTING: frozenset({_P.SENDING, _P.FINISHED}),
    _P.SENDING: frozenset({_P.AWAITING_VERDICT, _P.FINISHED}),
    _P.AWAITING_VERDICT: frozenset({_P.FINISHED}),
    _P.FINISHED: frozenset(),
}


@dataclass(frozen=True)
class HandoffConfig:
    transfer_timeout_s: float = 30.0  # decode: the sender's manifest -> its done (the transfer itself)
    # decode: reservation -> the sender's manifest. Prefill may first have to wait for pages (its queue, a stalled
    # neighbour): that is not this transfer's time; the router's handoff deadline normally ends such a request first,
    # with the reason it knows (docs/handoff.md)
    sender_wait_s: float = 120.0
    verdict_timeout_s: float = 30.0  # prefill: done sent -> decode's verdict; then source pages are freed anyway
    quarantine_timeout_s: float = 30.0  # decode: how long a failed request's transfer may take to settle before
    # decode cuts its connection (the pages stay quarantined until it has settled, however long that takes)
    verify: bool = True  # False only to demonstrate what an unverified handoff lets through
    strict: bool = False  # poison pages when they are quarantined and when they are freed

    def __post_init__(self) -> None:
        for name in ("transfer_timeout_s", "sender_wait_s", "verdict_timeout_s", "quarantine_timeout_s"):
            require_positive(self, name)


class DecodeHandoff:
    """Decode side of one request, from its order until it is gone: reserve, receive, verify; then the batch, or the
    quarantine. The worker moves it into the batch (`enter_batch`) and out of this worker (`finish`)."""

    def __init__(
        self,
        expect: Expectation,
        allocator: PageAllocator,
        pool: KVPool,
        receiver: Receiver,
        config: HandoffConfig | None = None,
        metrics: IntegrityMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        authenticated: bool = True,
    ) -> None:
        """`authenticated`: whether manifests are sealed with a secret cluster key (False under
        --insecure-no-auth); the record says so."""
        if expect.tokens_expected <= 0:
            raise ValueError(f"decode handoff {expect.request_id}: expects {expect.tokens_expected} tokens")
        self.expect = expect
        self.allocator, self.pool, self.receiver = allocator, pool, receiver
        self.config = config or HandoffConfig()
        self.metrics = metrics
        self.authenticated = authenticated
        self.clock = clock
        self._m = Lifecycle(f"decode request {expect.request_id}", _D.QUEUED, DECODE_TRANSITIONS, clock)
        self.num_pages = pages_for_tokens(expect.tokens_expected, pool.page_size)
        self.pages: list[int] = []
        self.slot: ReceiveSlot | None = None
        self.record: IntegrityRecord | None = None
        self.result: VerifyResult | None = None
        self.quarantined: list[int] = []
        self.released = False  # no page of it is quarantined any more (verified, or its quarantine is over)
        self.overdue = False  # the quarantine deadline passed with a write still possible
        self.severed = False  # ... and decode cut the transfer's connection to end it
        self._started_at = clock()
        self._sending_since: float | None = None  # when the sender's manifest was first seen: the transfer clock
        self._failed_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.expect.request_id

    @property
    def state(self) -> DecodeState:
        return self._m.state

    @property
    def history(self) -> list[tuple[DecodeState, float]]:
        return self._m.history

    @property
    def ok(self) -> bool | None:
        """True once verified, False once failed or aborted, None before either."""
        return None if self.result is None else self.result.ok

    @property
    def settled(self) -> bool:
        """Verified (its pages are plain reserved ones), or ended with every page back in the free list."""
        return self.state in (_D.VERIFIED, _D.RUNNING) or (self.state == _D.FINISHED and self.released)

    # -- paired verbs ----------------------------------------------------------------------------------------
    def can_start(self) -> bool:
        return self.allocator.can_allocate(self.num_pages)

    def start(self) -> list[int]:
        """Allocate pages for the router's expected length and expect the transfer; returns the page table."""
        self.pages = self.allocator.allocate(self.request_id, self.num_pages)  # raises, still QUEUED, when it cannot
        self._m.advance(_D.RESERVED)
        self.slot = self.receiver.expect(self.request_id, self.pages, self.expect.transfer_id)
        self._started_at = self.clock()
        return list(self.pages)

    def abort(self, reason: str = "aborted by decode") -> None:
        """Give up (client gone, router abort): tell the sender, quarantine the pages. A queued request (no pages
        yet) is simply gone; a verified one is the worker's to release."""
        if self.state == _D.QUEUED:
            self.receiver.abort(self.request_id, reason)  # a sender whose manifest came early stops waiting
            self._m.advance(_D.FINISHED)
            self.released = True
        elif self.state in (_D.RESERVED, _D.RECEIVING):
            self.receiver.abort(self.request_id, reason)
            self._end(VerifyResult(False, Reason.ABORTED, reason, 0, 0))

    def enter_batch(self) -> None:
        """The engine took the verified request into its batch."""
        self._m.advance(_D.RUNNING)

    def finish(self) -> None:
        """The request is gone from this worker (finished, or given up after it verified: the worker released its
        pages), or its quarantine is over."""
        self._m.advance(_D.FINISHED)

    def poll(self) -> DecodeState:
        """Advance as far as the transfer allows; never blocks. Returns the state."""
        if self.state in (_D.QUEUED, _D.VERIFIED, _D.RUNNING, _D.FINISHED):
            return self.state
        slot, now = self.slot, self.clock()
        assert slot is not None  # RESERVED and after have their slot
        if self.state == _D.RESERVED and slot.started:
            self._m.advance(_D.RECEIVING)
            self._sending_since = now
        if self.state in (_D.RESERVED, _D.RECEIVING):
            failure = slot.failure  # read once: the transport thread may move it on meanwhile
            if slot.complete:
                self._verify()
            elif failure is not None and failure[0] == "aborted":
                self._end(VerifyResult(False, Reason.ABORTED, f"prefill aborted: {failure[1]}", 0, 0))
            elif failure is not None:
                self.receiver.abort(self.request_id, failure[1])
                self._end(VerifyResult(False, Reason.TRANSFER_ERROR, failure[1], 0, 0))
            elif self._sending_since is None and now - self._started_at > self.config.sender_wait_s:
                detail = f"no sender started the transfer within {self.config.sender_wait_s:g}s of decode's reservation"
                self.receiver.abort(self.request_id, detail)
                self._end(VerifyResult(False, Reason.TIMEOUT, detail, 0, 0))
            elif self._sending_since is not None and now - self._sending_since > self.config.transfer_timeout_s:
                detail = (
                    f"no complete transfer {self.config.transfer_timeout_s:g}s after the sender started "
                    f"({slot.coverage.num_covered}/{self.num_pages} pages landed)"
                )
                self.receiver.abort(self.request_id, detail)
                self._end(VerifyResult(False, Reason.TIMEOUT, detail, 0, 0))
        if self.state == _D.QUARANTINED:
            self._maybe_release(now)
        return self.state

    # -- internals ---------------------------------------------------------------------------------------------
    def _verify(self) -> None:
        slot = self.slot
        assert slot is not None and slot.manifest is not None
        if self.state == _D.RESERVED:  # manifest and done seen in one poll
            self._m.advance(_D.RECEIVING)
        self._m.advance(_D.VERIFYING)
        t0 = self.clock()
        if self.config.verify:
            result = verify_handoff(slot.manifest, self.expect, self.pool.layout, self.pages, slot.coverage, self.pool)
        else:  # demonstration mode: accept whatever landed
            result = VerifyResult(True, None, "not verified (verification disabled)", 0, slot.manifest.num_tokens)
        verify_s = self.clock() - t0
        self.receiver.verdict(self.request_id, result.ok, "" if result.ok else Reason(result.reason).value)
        if result.ok:
            self._m.advance(_D.VERIFIED)
            self.released = True
            self.receiver.forget(self.request_id)
            self._emit(result, verify_s)
        else:
            self._end(result, verify_s)

    def _end(self, result: VerifyResult, verify_s: float | None = None) -> None:
        self._m.advance(_D.QUARANTINED)
        self._failed_at = self.clock()
        self.quarantined = self.allocator.quarantine(self.request_id)
        if self.config.strict and self.quarantined:
            self.pool.poison(self.quarantined)
        self._emit(result, verify_s)
        self._maybe_release(self._failed_at)

    def _maybe_release(self, now: float) -> None:
        """Release the quarantine once no write can land (invariant 5, docs/handoff.md); past the deadline, end a
        stuck write."""
        slot = self.slot
        assert slot is not None and self._failed_at is not None
        if slot.settled:
            if self.config.strict and self.quarantined:
                self.pool.poison(self.quarantined)  # whatever landed late is wiped before reuse
            self.allocator.release_quarantine(self.request_id)
            self.receiver.forget(self.request_id)
            self.released = True
            self._m.advance(_D.FINISHED)
            return
        if not self.overdue and now - self._failed_at > self.config.quarantine_timeout_s:
            self.overdue = True
            self.severed = self.receiver.sever(self.request_id)
            logger.warning(
                "decode: request %s: transfer %s not settled %.0fs after it ended (%d page write(s) in progress); "
                "%s; its %d page(s) stay quarantined until no write can land",
                self.request_id,
                transfer_ref(slot.transfer_id),
                self.config.quarantine_timeout_s,
                slot.writing,
                "cut its connection" if self.severed else "its writer cannot be cut from here (waiting for the sender)",
                len(self.quarantined),
            )

    def _emit(self, result: VerifyResult, verify_s: float | None) -> None:
        slot = self.slot
        assert slot is not None
        now = self.clock()
        timings = {"total": now - self._started_at}
        if slot.first_frame_at is not None and slot.complete_at is not None:
            timings["transfer"] = slot.complete_at - slot.first_frame_at
        if verify_s is not None:
            timings["verify"] = verify_s
        self.result = result
        self.record = IntegrityRecord.from_result(
            self.request_id,
            result,
            tokens_expected=self.expect.tokens_expected,
            pages=self.num_pages,
            layout_fingerprint=self.pool.layout.fingerprint,
            transfer_ref=transfer_ref(slot.transfer_id),
            authenticated=self.authenticated and slot.manifest is not None,
            timings=timings,
            verified=self.config.verify,
        )
        if self.metrics is not None:
            self.metrics.observe(self.record)


class PrefillHandoff:
    """Prefill side of one request, from its order until its pages are freed: the prompt computes, then build the
    manifest, send, hold the source pages until decode's verdict. How it ended is `outcome` ("verified" or
    "failed", with `reason`)."""

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        allocator: PageAllocator,
        pool: KVPool,
        sender: Sender,
        address: str,
        config: HandoffConfig | None = None,
        faults: FaultInjector | None = None,
        *,
        transfer_id: str,
        clock: Callable[[], float] = time.monotonic,
        first_token: int | None = None,
        first_logprobs: list | None = None,
    ) -> None:
        """`transfer_id`: the capability the router issued for this handoff (decode accepts no other);
        `first_token`/`first_logprobs`: what prefill sampled after the prompt, sent in the manifest (set them before
        `send` when they are not known yet)."""
        if not token_ids:
            raise ValueError(f"prefill handoff {request_id}: empty prompt")
        if not transfer_id:
            raise ValueError(f"prefill handoff {request_id}: no transfer id (the router issues one per request)")
        self.first_token, self.first_logprobs = first_token, first_logprobs
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.allocator, self.pool, self.sender, self.address = allocator, pool, sender, address
        self.config = config or HandoffConfig()
        self.faults = faults
        self.transfer_id = transfer_id
        self.clock = clock
        self._m = Lifecycle(f"prefill request {request_id}", _P.COMPUTING, PREFILL_TRANSITIONS, clock)
        self.manifest: HandoffManifest | None = None
        self.handle: SendHandle | None = None
        self.outcome: str | None = None  # "verified" | "failed", once known
        self.reason = ""
        self.released = False
        self.severed = False  # the verdict deadline passed with the send thread still running: its connection was cut
        self.released_pages: list[int] = []
        self._send_deadline = float("inf")
        self._verdict_deadline: float | None = None

    @property
    def state(self) -> PrefillState:
        return self._m.state

    @property
    def history(self) -> list[tuple[PrefillState, float]]:
        return self._m.history

    @property
    def settled(self) -> bool:
        return self.state == _P.FINISHED

    def send(self) -> SendHandle | None:
        """The prompt's KV is in the pool: build the manifest and start the transfer."""
        pages = self.allocator.pages_of(self.request_id)
        try:
            self.manifest = build_manifest(
                self.request_id,
                self.transfer_id,
                self.token_ids,
                self.pool,
                pages,
                self.faults,
                first_token=self.first_token,
                first_logprobs=self.first_logprobs,
            )
        except ValueError as e:
            self._fail(f"cannot build manifest: {e}")
            self.poll()
            return None
        self._m.advance(_P.SENDING)
        self.handle = self.sender.send(self.address, self.manifest, pages)
        self._send_deadline = self.clock() + self.config.transfer_timeout_s
        self._verdict_deadline = self._send_deadline + self.config.verdict_timeout_s  # reset when `done` goes out
        return self.handle

    def abort(self, reason: str = "aborted by prefill") -> None:
        if self.state == _P.COMPUTING:
            self._fail(reason)
        elif self.state in (_P.SENDING, _P.AWAITING_VERDICT) and self.handle is not None:
            self.handle.abort(reason)
            self._fail(reason)
        self.poll()

    def poll(self) -> PrefillState:
        h, now = self.handle, self.clock()
        # The handle's status moves on in transport threads while we read it: read `finished` first, since a
        # final status never changes, so what is read after it agrees with it (read the other way round, a
        # verdict landing between two reads looked like a failure whose reason was "verified").
        if h is not None and self.state == _P.SENDING and self.outcome is None:
            finished = h.finished
            if h.done_sent:
                self._m.advance(_P.AWAITING_VERDICT)
                self._verdict_deadline = now + self.config.verdict_timeout_s
            elif finished:
                self._fail(f"{h.status.value}: {h.reason}")
            elif now > self._send_deadline:
                h.abort("send deadline passed")
                what = "transfer not done" if h.ready else "decode never accepted the manifest (it reserved no pages)"
                self._fail(f"{what} within {self.config.transfer_timeout_s:g}s")
        if h is not None and self.state == _P.AWAITING_VERDICT and self.outcome is None:
            finished = h.finished
            if h.verified:
                self.outcome = "verified"
            elif finished:
                self._fail(f"{h.status.value}: {h.reason}")
            elif self._verdict_deadline is not None and now > self._verdict_deadline:
                self._fail(f"no verdict from decode within {self.config.verdict_timeout_s}s")
        if self.outcome is not None and not self.released:
            if h is None or h.sender_done:  # no thread reads the source pages any more
                self._release()
            elif not self.severed and self._verdict_deadline is not None and now > self._verdict_deadline:
                h.abort("verdict deadline passed")
                self.severed = h.sever()  # a send blocked on a stalled connection fails; then we release
        return self.state

    def _fail(self, reason: str) -> None:
        if self.outcome is None:
            self.outcome, self.reason = "failed", reason

    def _release(self) -> None:
        pages = self.allocator.owned_pages_of(self.request_id)  # never the shared prefix-cache pages
        if self.config.strict and pages:
            self.pool.poison(pages)
        self.released_pages = self.allocator.free(self.request_id)
        self.released = True
        self._m.advance(_P.FINISHED)
