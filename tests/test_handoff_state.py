"""The handoff state machines: transitions, deferred release, timeouts, quarantine, aborts."""

from __future__ import annotations

import time

import pytest
import torch

from kvfence.disagg.handoff import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    DecodeHandoff,
    DecodeState,
    HandoffConfig,
    IllegalTransition,
    PrefillHandoff,
    PrefillState,
)
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.record import IntegrityMetrics
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SendHandle, SendStatus, fill_from_bytes
from kvfence.transfer.frames import Abort, Done, Error, Fenced, Frame, Manifest, Ready
from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender
from tests.helpers.auth import cap, plane_auth, sealed

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 4)), KVBufferSpec("v", (2, 4))), 4, torch.float32)
N = 16


class FakeLink:
    def __init__(self) -> None:
        self.sent: list[Frame] = []

    def send(self, header, payload=()) -> None:
        self.sent.append(header)


def setup(one_sided: bool = False, **cfg):
    fabric = LocalFabric()
    d_pool, p_pool = KVPool(LAYOUT, N), KVPool(LAYOUT, N)
    p_pool.tensors[0]["k"].normal_()
    receiver = LocalReceiver(fabric, "d", d_pool, one_sided=one_sided, auth=AUTH)
    sender = LocalSender(fabric, p_pool, auth=AUTH)
    config = HandoffConfig(**{"transfer_timeout_s": 5, "verdict_timeout_s": 5, "quarantine_timeout_s": 5, **cfg})
    return fabric, d_pool, p_pool, receiver, sender, config


def wait_for(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def test_terminal_states_have_no_exit_and_illegal_transitions_raise() -> None:
    for table, terminals in (
        (DECODE_TRANSITIONS, {DecodeState.FINISHED}),
        (PREFILL_TRANSITIONS, {PrefillState.FINISHED}),
    ):
        assert {s for s, nxt in table.items() if not nxt} == terminals
    _, d_pool, _, receiver, _, config = setup()
    dec = DecodeHandoff(Expectation("r", 5, token_hash(range(5)), cap("r")), PageAllocator(N), d_pool, receiver, config)
    with pytest.raises(IllegalTransition, match="queued -> verified"):
        dec._m.advance(DecodeState.VERIFIED)
    assert dec.state == DecodeState.QUEUED
    receiver.close()


def test_prefill_keeps_source_pages_until_decode_verdict() -> None:
    _, d_pool, p_pool, receiver, sender, config = setup()
    p_alloc, d_alloc = PageAllocator(N), PageAllocator(N)
    ids = list(range(10))
    src = p_alloc.allocate("r", 4)  # 3 pages for the prompt + 1 for the first decoded token
    dec = DecodeHandoff(Expectation("r", 10, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config)
    dec.start()
    pre = PrefillHandoff("r", ids, p_alloc, p_pool, sender, receiver.address, config, transfer_id=cap("r"))
    assert pre.state == PrefillState.COMPUTING
    handle = pre.send()
    wait_for(lambda: handle.status == SendStatus.AWAITING_VERDICT and handle.sender_done)
    assert pre.poll() == PrefillState.AWAITING_VERDICT
    assert p_alloc.pages_of("r") == src, "source pages are held while decode has not verified"
    wait_for(lambda: dec.poll() == DecodeState.VERIFIED)  # once the receiver thread has applied `done`
    wait_for(lambda: pre.poll() == PrefillState.FINISHED and pre.released)
    assert pre.outcome == "verified" and dec.ok
    assert sorted(pre.released_pages) == sorted(src) and p_alloc.num_free == N
    assert [s for s, _ in pre.history] == ["computing", "sending", "awaiting_verdict", "finished"]
    assert [s for s, _ in dec.history] == ["queued", "reserved", "receiving", "verifying", "verified"]
    p_alloc.check()
    receiver.close()


def test_prefill_frees_source_pages_when_no_verdict_comes_before_the_verdict_deadline() -> None:
    _, d_pool, p_pool, receiver, sender, config = setup(verdict_timeout_s=0.2)
    p_alloc, d_alloc = PageAllocator(N), PageAllocator(N)
    ids = list(range(6))
    p_alloc.allocate("r", 2)
    DecodeHandoff(
        Expectation("r", 6, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config
    ).start()  # never polled
    pre = PrefillHandoff("r", ids, p_alloc, p_pool, sender, receiver.address, config, transfer_id=cap("r"))
    pre.send()
    wait_for(lambda: pre.poll() == PrefillState.AWAITING_VERDICT)
    assert p_alloc.num_free == N - 2
    wait_for(lambda: pre.poll() == PrefillState.FINISHED and pre.released, timeout=3)
    assert pre.outcome == "failed" and "no verdict" in pre.reason and p_alloc.num_free == N
    receiver.close()


def test_decode_times_out_and_releases_its_quarantine_once_settled() -> None:
    _, d_pool, _, receiver, _, config = setup(sender_wait_s=0.05, strict=True)
    d_alloc, metrics = PageAllocator(N), IntegrityMetrics()
    dec = DecodeHandoff(Expectation("r", 9, token_hash(range(9)), cap("r")), d_alloc, d_pool, receiver, config, metrics)
    pages = dec.start()
    assert len(pages) == 3 and d_alloc.num_free == N - 3
    wait_for(lambda: dec.poll() == DecodeState.FINISHED)  # two-sided, nothing sent: released at once
    assert dec.ok is False and dec.record.reason == "timeout" and dec.record.status == "failed"
    assert [s for s, _ in dec.history] == ["queued", "reserved", "quarantined", "finished"]
    assert "no sender started the transfer" in dec.record.detail
    assert dec.released and d_alloc.num_free == N and d_alloc.num_quarantined == 0  # two-sided: settled at once
    assert torch.isnan(d_pool.tensors[1]["v"][pages]).all()  # strict mode poisoned them
    assert metrics.value("kvfence_handoff_failed_total", {"reason": "timeout"}) == 1
    d_alloc.check()
    receiver.close()


def test_one_sided_slot_no_sender_ever_bound_settles_when_it_fails() -> None:
    _, d_pool, _, receiver, _, config = setup(one_sided=True, sender_wait_s=0.05)
    d_alloc = PageAllocator(N)
    dec = DecodeHandoff(Expectation("r", 9, token_hash(range(9)), cap("r")), d_alloc, d_pool, receiver, config)
    dec.start()
    wait_for(lambda: dec.poll() == DecodeState.FINISHED)
    assert dec.record.reason == "timeout"
    assert dec.released and d_alloc.num_quarantined == 0 and d_alloc.num_free == N  # no manifest: nobody can write
    d_alloc.check()
    receiver.close()


def test_one_sided_quarantine_outlives_its_deadline_until_the_sender_fences() -> None:
    """A one-sided sender that got the request bound may write at any time: no deadline frees its pages, only
    its own word (last frame, or `fenced` on another connection) does."""
    _, d_pool, p_pool, receiver, _, config = setup(one_sided=True, quarantine_timeout_s=0.3)
    now = [0.0]
    d_alloc = PageAllocator(N)
    ids = list(range(9))
    dec = DecodeHandoff(
        Expectation("r", 9, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config, clock=lambda: now[0]
    )
    dec.start()
    core, link = receiver.core, FakeLink()
    core.on_frame(
        link,
        Manifest("r", cap("r")),
        sealed(build_manifest("r", cap("r"), ids, p_pool, [0, 1, 2]), AUTH),
    )
    assert dec.poll() == DecodeState.RECEIVING
    dec.abort("client went away")
    assert dec.state == DecodeState.QUARANTINED and not dec.released and d_alloc.num_quarantined == 3
    now[0] += 3600.0  # an hour past the quarantine deadline
    dec.poll()
    assert dec.overdue and not dec.severed  # nothing to cut: the writes do not pass through the connection
    assert not dec.released and d_alloc.num_quarantined == 3 and d_alloc.num_free == N - 3
    other = d_alloc.allocate("other", N - 3)
    assert not set(other) & set(dec.quarantined)
    d_alloc.free("other")
    core.on_frame(FakeLink(), Fenced("r", "y"))  # another transfer's fence: not ours
    dec.poll()
    assert not dec.released
    core.on_frame(FakeLink(), Fenced("r", cap("r")))  # on a new connection
    assert dec.poll() == DecodeState.FINISHED
    assert dec.released and d_alloc.num_quarantined == 0 and d_alloc.num_free == N
    d_alloc.check()
    receiver.close()


def test_sender_abort_frame_ends_decode_as_aborted_and_settles_the_slot() -> None:
    _, d_pool, p_pool, receiver, _, config = setup()
    d_alloc = PageAllocator(N)
    ids = list(range(12))
    dec = DecodeHandoff(Expectation("r", 12, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config)
    dec.start()
    core, link = receiver.core, FakeLink()
    core.on_frame(
        link,
        Manifest("r", cap("r")),
        sealed(build_manifest("r", cap("r"), ids, p_pool, [0, 1, 2]), AUTH),
    )
    core.receive_page("r", cap("r"), 0, LAYOUT.bytes_per_page, fill_from_bytes(p_pool.read_page(0)))
    assert dec.poll() == DecodeState.RECEIVING
    core.on_frame(link, Abort("r", cap("r"), "prefill OOM"))
    assert dec.poll() == DecodeState.FINISHED and dec.ok is False
    assert dec.record.reason == "aborted" and "prefill OOM" in dec.record.detail
    assert dec.released and d_alloc.num_free == N
    receiver.close()


def test_an_early_manifest_waits_for_decode_to_reserve_and_a_second_one_is_refused() -> None:
    _, d_pool, p_pool, receiver, sender, config = setup()
    core, link = receiver.core, FakeLink()
    m = build_manifest("r", cap("r"), [1, 2, 3], p_pool, [0])
    core.on_frame(link, Manifest("r", cap("r")), sealed(m, AUTH))
    assert link.sent == []  # parked: no `ready`, so the sender moves no page yet
    core.on_frame(link, Manifest("r", cap("r")), sealed(m, AUTH))
    assert isinstance(link.sent[-1], Error) and "second manifest" in link.sent[-1].reason
    core.expect("r", [5], cap("r"))  # decode reserves: the parked manifest is taken up
    assert link.sent[-1] == Ready("r", cap("r")) and core.slot("r").manifest == m
    core.on_frame(link, Manifest("r", cap("r")), sealed(m, AUTH))
    assert isinstance(link.sent[-1], Error) and "second manifest" in link.sent[-1].reason
    other = build_manifest("r", "0" * 32, [1, 2, 3], p_pool, [0])
    core.on_frame(link, Manifest("r", "0" * 32), sealed(other, AUTH))
    assert isinstance(link.sent[-1], Error) and "expects another transfer" in link.sent[-1].reason
    assert core.slot("r").manifest == m  # the first (right) manifest still holds
    receiver.close()


def test_a_manifest_decode_never_reserves_is_refused_after_its_time_to_live() -> None:
    _, _, p_pool, receiver, sender, config = setup()
    p_alloc = PageAllocator(N)
    p_alloc.allocate("ghost", 1)
    pre = PrefillHandoff("ghost", [1, 2], p_alloc, p_pool, sender, receiver.address, config, transfer_id=cap("ghost"))
    pre.send()
    time.sleep(0.05)
    assert pre.poll() == PrefillState.SENDING and p_alloc.num_free == N - 1  # parked, waiting for `ready`
    receiver.core.expire_pending(time.monotonic() + receiver.core.pending_ttl_s + 1)
    wait_for(lambda: pre.poll() == PrefillState.FINISHED and pre.released)
    assert pre.outcome == "failed" and "never reserved request ghost" in pre.reason and p_alloc.num_free == N
    assert pre.handle is not None and pre.handle.pages_sent == 0
    receiver.close()


def test_decode_abort_before_any_frame_quarantines_and_tells_a_late_sender_to_stop() -> None:
    _, d_pool, p_pool, receiver, sender, config = setup()
    p_alloc, d_alloc = PageAllocator(N), PageAllocator(N)
    ids = list(range(8))
    p_alloc.allocate("r", 2)
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config)
    dec.start()
    dec.abort("client went away")
    assert dec.state == DecodeState.FINISHED and dec.released and d_alloc.num_free == N
    pre = PrefillHandoff("r", ids, p_alloc, p_pool, sender, receiver.address, config, transfer_id=cap("r"))
    pre.send()
    wait_for(lambda: pre.poll() == PrefillState.FINISHED and pre.released)
    assert (
        pre.outcome == "failed" and "no longer expects request r" in pre.reason
    )  # the slot is gone: nothing of the late transfer lands
    assert p_alloc.num_free == N
    receiver.close()


def test_the_receiver_notifies_decode_whenever_a_transfer_moves_on() -> None:
    _, d_pool, p_pool, receiver, _, config = setup()
    calls: list[str] = []
    receiver.core.notify = lambda: calls.append(receiver.core.slot("r").status.value)
    d_alloc = PageAllocator(N)
    ids = list(range(8))
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, config)
    dec.start()
    core, link = receiver.core, FakeLink()
    core.on_frame(
        link,
        Manifest("r", cap("r")),
        sealed(build_manifest("r", cap("r"), ids, p_pool, [0, 1]), AUTH),
    )
    for i in range(2):
        core.receive_page("r", cap("r"), i, LAYOUT.bytes_per_page, fill_from_bytes(p_pool.read_page(i)), link)
    core.on_frame(link, Done("r", cap("r"), 2))
    assert calls == ["receiving", "complete"]  # manifest accepted, sender done: each wakes the worker
    assert dec.poll() == DecodeState.VERIFIED
    receiver.close()


class _VerdictBetweenReads(SendHandle):
    """A send handle whose status a transport thread moves on right after the first time prefill reads it: the
    first read sees SENDING, every later one VERIFIED (what a verdict landing between two reads looks like)."""

    def __init__(self, manifest) -> None:
        super().__init__(manifest)
        self.sender_done = True
        self._reads = 0

    @property  # type: ignore[override]
    def status(self) -> SendStatus:
        self._reads += 1
        return SendStatus.SENDING if self._reads == 1 else SendStatus.VERIFIED

    @status.setter
    def status(self, value: SendStatus) -> None:
        pass


class _OneHandleSender:
    def send(self, address, manifest, pages):
        return _VerdictBetweenReads(manifest)


def test_a_verdict_landing_between_two_reads_of_the_send_status_is_not_a_failure() -> None:
    _, _, p_pool, receiver, _, config = setup()
    p_alloc = PageAllocator(N)
    p_alloc.allocate("r", 3)
    pre = PrefillHandoff("r", list(range(10)), p_alloc, p_pool, _OneHandleSender(), "d", config, transfer_id=cap("r"))
    pre.send()
    pre.poll()
    assert pre.outcome == "verified", pre.reason  # it was "failed" with the reason "verified: " under load
    assert pre.state == PrefillState.FINISHED and pre.released and p_alloc.num_free == N
    p_alloc.check()
    receiver.close()


def test_a_new_transfer_under_a_request_id_decode_ended_before_is_parked_not_refused() -> None:
    """A client may send its X-Request-Id again once the first request has ended: the router then issues a new
    transfer id. A manifest for the old transfer is still refused at once; one for the new transfer that comes
    before decode reserves it waits for the reservation like any other."""
    _, _, p_pool, receiver, _, _ = setup()
    core, link = receiver.core, FakeLink()
    first, again = cap("r"), cap("r-again")
    core.expect("r", [5], first)
    core.forget("r")  # decode is done with the first request
    core.on_frame(link, Manifest("r", first), sealed(build_manifest("r", first, [1, 2, 3], p_pool, [0]), AUTH))
    assert isinstance(link.sent[-1], Error) and "no longer expects request r" in link.sent[-1].reason
    n = len(link.sent)
    m = build_manifest("r", again, [1, 2, 3], p_pool, [0])
    core.on_frame(link, Manifest("r", again), sealed(m, AUTH))
    assert len(link.sent) == n  # parked: no reply until decode reserves
    core.expect("r", [6], again)
    assert link.sent[-1] == Ready("r", again) and core.slot("r").manifest == m
    receiver.close()
