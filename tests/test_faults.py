"""Every named fault, over both transports, with pools in host memory and with device pools (through host staging
and device digests; on CPU tensors unless KVFENCE_TEST_DEVICE names a GPU): detected with the right reason, the
request fails cleanly, allocators balance, and an innocent transfer running at the same time verifies with exact
bytes."""

from __future__ import annotations

import pytest
import torch

from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig, PrefillHandoff
from kvfence.faults import FAULT_NAMES, FaultInjector, FaultPoint
from kvfence.integrity.record import IntegrityMetrics
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import TransferConfig
from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender
from kvfence.transfer.tcp import TcpReceiver, TcpSender
from tests.helpers.auth import plane_auth
from tests.helpers.device import device_pool
from tests.helpers.faults import EXPECTED, check_fault_case, drive, handoff_pair, same_bytes

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout(
    "DeepseekV3ForCausalLM", 2, (KVBufferSpec("latent", (1, 16)), KVBufferSpec("rope", (1, 8))), 8, torch.bfloat16
)
NUM_PAGES = 32
TRANSPORTS = ["local", "tcp", "local-staged", "tcp-staged"]  # -staged: both pools are device pools


class Rig:
    """A prefill pool+allocator+sender and a decode pool+allocator+receiver joined by one transport."""

    def __init__(self, transport: str, faults: FaultInjector | None = None, config: HandoffConfig | None = None):
        self.faults = faults
        self.config = config or HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=5)
        self.metrics = IntegrityMetrics()
        self.p_alloc, self.d_alloc = PageAllocator(NUM_PAGES), PageAllocator(NUM_PAGES)
        transport, staged = transport.removesuffix("-staged"), transport.endswith("-staged")
        self.p_pool, self.d_pool = [
            device_pool(LAYOUT, NUM_PAGES) if staged else KVPool(LAYOUT, NUM_PAGES) for _ in "pd"
        ]
        g = torch.Generator().manual_seed(99)  # decode's pool holds a previous request's KV
        for layer in self.d_pool.tensors:
            for t in layer.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        tcfg = TransferConfig(max_transfer_pages=2, max_inflight_bytes=3 * LAYOUT.bytes_per_page)
        if transport == "local":
            fabric = LocalFabric()
            self.receiver = LocalReceiver(fabric, "decode0", self.d_pool, faults, auth=AUTH)
            self.sender = LocalSender(fabric, self.p_pool, tcfg, faults, auth=AUTH)
        else:
            self.receiver = TcpReceiver(self.d_pool, faults=faults, auth=AUTH)
            self.sender = TcpSender(self.p_pool, tcfg, faults, auth=AUTH)

    def pair(self, rid: str, num_tokens: int, seed: int) -> tuple[PrefillHandoff, DecodeHandoff, list[bytes]]:
        return handoff_pair(self, rid, num_tokens, seed)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def test_every_named_fault_has_an_expected_outcome() -> None:
    assert set(EXPECTED) | {"delayed_write_after_abort"} == set(FAULT_NAMES)
    with pytest.raises(ValueError, match="unknown fault"):
        FaultPoint("no_such_fault")
    assert FaultInjector.from_flag(None) is None
    assert FaultInjector.from_flag("drop_page,stale_page").enabled == ["drop_page", "stale_page"]


def test_a_fault_spec_selects_requests_by_id_pattern_page_and_every_nth() -> None:
    point = FaultPoint.parse("corrupt_byte@cmpl-bad-*#2%3")
    assert (point.name, point.request_id, point.page, point.every) == ("corrupt_byte", "cmpl-bad-*", 2, 3)
    for bad in ("nope", "drop_page#x", "drop_page%0", "drop_page#-1"):
        with pytest.raises(ValueError):
            FaultPoint.parse(bad)
    faults = FaultInjector([point])
    asked = ["cmpl-good-0", *[f"cmpl-bad-{i}" for i in range(7)]]
    hit = [rid for rid in asked if faults.point("corrupt_byte", rid) is not None]
    assert hit == ["cmpl-bad-0", "cmpl-bad-3", "cmpl-bad-6"]  # matching ids only, every 3rd from the first
    assert faults.point("corrupt_byte", "cmpl-bad-3") is not None  # asked again: the same verdict
    assert faults.point("corrupt_byte", "cmpl-bad-4") is None


def test_a_pattern_matches_the_id_the_client_gave_as_well_as_the_engine_id() -> None:
    """`--inject-fault NAME@victim-*` with `X-Request-Id: victim-1` aims at the engine's `cmpl-victim-1-0` (it used
    to match nothing: a test built on it passed without any fault firing)."""
    point = FaultPoint.parse("drop_page@victim-*")
    for rid in ("cmpl-victim-1-0", "chatcmpl-victim-7-2", "resp-victim-x-0"):
        assert point.matches(rid), rid
    for rid in ("cmpl-innocent-1-0", "cmpl-1-victim-0", "victim"):
        assert not point.matches(rid), rid
    assert FaultPoint.parse("drop_page@cmpl-victim-1-*").matches("cmpl-victim-1-0")  # engine ids still work


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_is_detected_and_innocent_transfer_is_exact(transport: str, fault: str) -> None:
    faults = FaultInjector().enable(fault, request_id="bad", page=1)
    rig = Rig(transport, faults)
    try:
        check_fault_case(rig, rig.pair, fault, faults, "bad", "good")
    finally:
        rig.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_delayed_write_after_abort_lands_only_in_quarantined_pages(transport: str) -> None:
    faults = FaultInjector().enable("delayed_write_after_abort", request_id="bad", delay_s=0.02)
    rig = Rig(
        transport, faults, HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=5, strict=True)
    )
    try:
        baseline = rig.d_alloc.num_free
        bad_pre, bad_dec, bad_src = rig.pair("bad", 40, seed=3)
        bad_pre.send()
        drive(bad_pre, bad_dec, until=lambda: bad_dec.slot.manifest is not None)
        bad_dec.abort("client disconnected")
        quarantined = set(bad_dec.quarantined)
        assert bad_dec.state == DecodeState.QUARANTINED and len(quarantined) == 5
        assert not bad_dec.released, "a write can still land: the pages must stay quarantined"
        assert rig.d_alloc.num_quarantined == 5

        # an innocent request arrives while the late writes are landing; it never gets a quarantined page
        good_pre, good_dec, good_src = rig.pair("good", 24, seed=4)
        assert not quarantined & set(good_dec.pages)
        good_pre.send()
        drive(bad_pre, bad_dec, good_pre, good_dec)

        assert faults.fired["delayed_write_after_abort"] >= 1
        assert bad_dec.released and not bad_dec.overdue  # released because the sender settled
        assert bad_dec.record.status == "failed" and bad_dec.record.reason == "aborted"
        assert good_dec.record.status == "verified" and same_bytes(good_src, rig.d_pool, good_dec.pages)
        assert all(torch.isnan(rig.d_pool.tensors[0]["latent"][p]).all() for p in quarantined)  # strict: poisoned
        rig.d_alloc.free("good")
        rig.d_alloc.check()
        rig.p_alloc.check()
        assert rig.d_alloc.num_free == baseline and rig.p_alloc.num_free == NUM_PAGES
    finally:
        rig.close()


@pytest.mark.parametrize("fault", ["placeholder_handoff", "stale_page"])
def test_without_verification_a_placeholder_or_stale_page_is_admitted(fault: str) -> None:
    """Demonstration only: verify=False admits the incident; decode's pages hold a previous request's KV."""
    faults = FaultInjector().enable(fault, request_id="victim", page=1)
    rig = Rig("local", faults, HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, verify=False))
    try:
        pre, dec, src = rig.pair("victim", 37, seed=5)
        before = {p: rig.d_pool.read_page(p) for p in dec.pages}  # the previous request's KV
        pre.send()
        drive(pre, dec)
        assert dec.state == DecodeState.VERIFIED and dec.record.status == "unverified"
        assert dec.slot.coverage.complete == (fault == "stale_page")  # a stale page fools coverage; digests catch it
        stale = [p for p in dec.pages if rig.d_pool.read_page(p) == before[p]]
        assert stale, "some admitted page still holds another request's bytes"
        assert not same_bytes(src, rig.d_pool, dec.pages)
        assert rig.metrics.value("kvfence_handoff_unverified_total") == 1
    finally:
        rig.close()
