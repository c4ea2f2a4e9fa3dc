"""The Mooncake transport (`transfer.mooncake`): every named fault detected as over local/TCP (with host pools
and with device pools), an innocent transfer byte-exact beside it, allocators balanced; a transfer from another
process; a chunk above the engine's lane batch; aborts mid-transfer; a lost control link keeps pages quarantined.
Tests that need the engine skip with `mooncake_available()`'s reason when it cannot run here.

One receiver and one sender (an engine each) serve the whole module: an engine takes about a second to drop.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig, PrefillHandoff
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest, seal
from kvfence.integrity.record import IntegrityMetrics
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SendStatus, TransferConfig
from kvfence.transfer.mooncake import MooncakeReceiver, MooncakeSender, parse_address
from kvfence.transfer.mooncake_engine import (
    MooncakeTransferError,
    mooncake_available,
    mooncake_gpu_memory,
    mooncake_version,
)
from tests.helpers.auth import cap, plane_auth
from tests.helpers.device import device_pool
from tests.helpers.faults import EXPECTED, check_fault_case, drive, handoff_pair, same_bytes  # shared fault matrix
from tests.helpers.kv import WireClient, seed_pool, wait_for

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout(
    "DeepseekV3ForCausalLM", 2, (KVBufferSpec("latent", (1, 16)), KVBufferSpec("rope", (1, 8))), 8, torch.bfloat16
)
NUM_PAGES = 320  # 4 (layer, buffer) slices a page: 300 reversed pages are 1,200 entries, above the lane queue
FAULT_CONFIG = TransferConfig(max_transfer_pages=2, max_inflight_bytes=3 * LAYOUT.bytes_per_page)


# -- needs no engine ------------------------------------------------------------------------------------------


def test_constructing_without_a_usable_engine_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if the wheel had no engine
    ok, reason = mooncake_available.__wrapped__("127.0.0.1", "tcp")  # bypass the per-process cache
    assert not ok and reason
    pool = KVPool(LAYOUT, 2)
    for make in (lambda: MooncakeSender(pool, auth=AUTH), lambda: MooncakeReceiver(pool, auth=AUTH)):
        with pytest.raises(KvfenceError) as info:
            make()
        assert str(info.value) == f"Mooncake backend not available: {reason}"


def test_constructing_without_the_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(KvfenceError, match=r"^Mooncake backend not available: the Mooncake Python package is not "
                       r"installed \(pip install mooncake-transfer-engine-non-cuda"):  # fmt: skip
        MooncakeReceiver(KVPool(LAYOUT, 2), auth=AUTH)


def test_unacknowledged_tcp_framing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(KvfenceError, match="MC_TCP_PROTO=1"):
        MooncakeSender(KVPool(LAYOUT, 2), auth=AUTH)


def test_the_installed_mooncake_build_says_whether_it_handles_gpu_memory() -> None:
    version = mooncake_version()
    if version is None:
        assert mooncake_gpu_memory() is None
    elif version.startswith("mooncake-transfer-engine-non-cuda"):
        assert mooncake_gpu_memory() is False  # every address is host memory to it: a GPU pointer must not reach it
    else:  # the CUDA wheel, mooncake-transfer-engine
        assert mooncake_gpu_memory() is True


def test_parse_address() -> None:
    assert parse_address("mooncake://10.0.0.7:5123") == ("10.0.0.7", 5123)
    with pytest.raises(ValueError, match="mooncake://host:port"):
        parse_address("tcp://10.0.0.7:5123")


# -- one receiver and one sender for the module ---------------------------------------------------------------


class Pair:
    """Decode pool + receiver and prefill pool + sender, joined over Mooncake (one control connection); `device`:
    both pools are device pools (KVFENCE_TEST_DEVICE), whose pages reach the host areas by torch copies."""

    def __init__(self, device: bool = False) -> None:
        self.d_pool, self.p_pool = [
            device_pool(LAYOUT, NUM_PAGES) if device else KVPool(LAYOUT, NUM_PAGES) for _ in "dp"
        ]
        self.receiver = MooncakeReceiver(self.d_pool, auth=AUTH)
        try:
            self.sender = MooncakeSender(self.p_pool, FAULT_CONFIG, auth=AUTH)
        except BaseException:
            self.receiver.close()
            raise

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(f"Mooncake unavailable: {reason}")
    p = Pair()
    yield p
    p.close()


@pytest.fixture(scope="module")
def device_pair() -> Iterator[Pair]:
    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(f"Mooncake unavailable: {reason}")
    p = Pair(device=True)
    yield p
    p.close()


POOLS = pytest.mark.parametrize("pools", ["pair", "device_pair"])  # host-visible pools, device pools


class Rig:
    """One test's view of the pair: fresh allocators, metrics and faults; decode's pool holds old KV."""

    def __init__(self, pair: Pair, faults: FaultInjector | None = None, config: HandoffConfig | None = None) -> None:
        self.pair, self.faults = pair, faults
        self.d_pool, self.p_pool, self.receiver, self.sender = pair.d_pool, pair.p_pool, pair.receiver, pair.sender
        self.sender.faults = self.receiver.core.faults = faults
        self.sender.config = FAULT_CONFIG
        self.config = config or HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=5)
        self.metrics = IntegrityMetrics()
        self.p_alloc, self.d_alloc = PageAllocator(NUM_PAGES), PageAllocator(NUM_PAGES)
        seed_pool(self.d_pool, 99)

    def pair_of(self, rid: str, num_tokens: int, seed: int) -> tuple[PrefillHandoff, DecodeHandoff, list[bytes]]:
        return handoff_pair(self, rid, num_tokens, seed)


@POOLS
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_is_detected_and_innocent_transfer_is_exact(
    request: pytest.FixtureRequest, pools: str, fault: str
) -> None:
    pair = request.getfixturevalue(pools)
    bad, good = f"{fault}-bad", f"{fault}-good"
    faults = FaultInjector().enable(fault, request_id=bad, page=1)
    rig = Rig(pair, faults)
    assert (rig.p_alloc.num_free, rig.d_alloc.num_free) == (NUM_PAGES, NUM_PAGES)
    good_pre = check_fault_case(rig, rig.pair_of, fault, faults, bad, good)  # back to NUM_PAGES free each side
    assert good_pre.handle.entries > 0 and good_pre.handle.chunks_sent == 2  # 4 pages in chunks of 2, via Mooncake


@POOLS
def test_a_delayed_write_after_abort_lands_only_in_its_landing_area_never_in_the_pool(
    request: pytest.FixtureRequest, pools: str
) -> None:
    """The sender keeps writing after decode aborted. Its writes land in the transfer's own landing area, which is
    never copied into the pool once the slot is closed: decode's pool pages were never writable by the sender."""
    pair = request.getfixturevalue(pools)
    faults = FaultInjector().enable("delayed_write_after_abort", request_id="late-bad", delay_s=0.02)
    rig = Rig(
        pair, faults, HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=5, strict=True)
    )
    bad_pre, bad_dec, _ = rig.pair_of("late-bad", 40, seed=3)
    bad_pre.send()
    # the sender knows its landing area before decode aborts (else it has nowhere to write late: nothing to test)
    drive(bad_pre, bad_dec, until=lambda: bad_dec.slot.manifest is not None and bad_pre.handle.dest is not None)
    bad_dec.abort("client disconnected")
    quarantined = set(bad_dec.quarantined)
    assert bad_dec.state == DecodeState.QUARANTINED and len(quarantined) == 5

    good_pre, good_dec, good_src = rig.pair_of("late-good", 24, seed=4)
    assert not quarantined & set(good_dec.pages)
    good_pre.send()
    drive(bad_pre, bad_dec, good_pre, good_dec)

    assert faults.fired["delayed_write_after_abort"] >= 1
    assert bad_pre.handle.pages_sent == 5  # the late writes really went out, into the landing area
    assert bad_dec.released and not bad_dec.overdue
    assert bad_dec.record.status == "failed" and bad_dec.record.reason == "aborted"
    assert good_dec.record.status == "verified" and same_bytes(good_src, rig.d_pool, good_dec.pages)
    assert all(torch.isnan(rig.d_pool.tensors[0]["latent"][p]).all() for p in quarantined)  # poisoned, not written
    assert rig.receiver.landing_bytes == 0  # freed on the sender's `aborted`: its writer had stopped
    rig.d_alloc.free("late-good")
    rig.d_alloc.check()
    assert rig.d_alloc.num_free == NUM_PAGES and rig.p_alloc.num_free == NUM_PAGES


def test_a_large_chunk_lands_in_scattered_pool_pages_in_one_entry_per_slice(pair: Pair) -> None:
    """300 pages in one chunk into reversed decode pages: the staging and landing areas are laid out
    buffer-major, so a chunk of consecutive logical pages is one Mooncake range whatever decode's page numbers,
    and the copy from the landing area puts every page where decode's page table says."""
    rig = Rig(pair)
    n = 300
    seed_pool(rig.p_pool, 5)
    rig.sender.config = TransferConfig(max_transfer_pages=n, max_inflight_bytes=n * LAYOUT.bytes_per_page)
    m = build_manifest("big", cap("big"), list(range(n * LAYOUT.page_size)), rig.p_pool, list(range(n)))
    dest = list(reversed(range(10, 10 + n)))
    slot = rig.receiver.expect("big", dest, cap("big"))
    handle = rig.sender.send(rig.receiver.address, m, list(range(n)))
    end = time.monotonic() + 20
    while slot.status.value != "complete" and time.monotonic() < end:
        time.sleep(0.002)
    assert slot.status.value == "complete", (slot.status, handle.status, handle.reason)
    assert handle.chunks_sent == 1 and handle.max_chunk_pages == n
    assert handle.entries == 1 and handle.batches == 1  # the whole area in one range: slices are back to back
    assert slot.coverage.complete and slot.bytes_received == n * LAYOUT.bytes_per_page
    assert all(rig.p_pool.read_page(i) == rig.d_pool.read_page(d) for i, d in enumerate(dest))
    rig.receiver.verdict("big", True)
    assert handle.wait(5) and handle.status == SendStatus.VERIFIED
    rig.receiver.forget("big")


def _slow_rig(pair: Pair) -> Rig:
    rig = Rig(pair)  # one page a chunk, one page in flight: a 40-page transfer takes many round trips
    rig.sender.config = TransferConfig(max_transfer_pages=1, max_inflight_bytes=LAYOUT.bytes_per_page)
    return rig


def test_decode_abort_mid_transfer_stops_the_sender_and_settles(pair: Pair) -> None:
    rig = _slow_rig(pair)
    pre, dec, _ = rig.pair_of("mid-d", 40 * LAYOUT.page_size, seed=6)
    pre.send()
    drive(pre, dec, until=lambda: dec.slot.coverage.num_covered >= 2)
    dec.abort("client disconnected")
    # the sender never writes decode's pool (only its landing area, unregistered at the abort): settled at once
    assert dec.state == DecodeState.FINISHED and dec.released and dec.ok is False
    drive(pre, dec)
    assert pre.outcome == "failed" and pre.handle.status in (SendStatus.ABORTED, SendStatus.ERROR)
    assert 2 <= pre.handle.pages_sent < 40  # stopped early
    assert dec.record.reason == "aborted"
    wait_for(lambda: rig.receiver.landing_bytes == 0)  # kept until the sender's last frame
    for alloc in (rig.p_alloc, rig.d_alloc):
        alloc.check()
        assert alloc.num_free == NUM_PAGES


def test_prefill_abort_mid_transfer_fails_decode_cleanly(pair: Pair) -> None:
    rig = _slow_rig(pair)
    pre, dec, _ = rig.pair_of("mid-p", 40 * LAYOUT.page_size, seed=7)
    pre.send()
    drive(pre, dec, until=lambda: dec.slot.coverage.num_covered >= 2)
    pre.abort("prefill shutting down")
    drive(pre, dec)
    assert dec.state == DecodeState.FINISHED and "prefill aborted" in dec.record.detail
    assert dec.released and not dec.overdue
    assert pre.handle.pages_sent < 40 and pre.handle.status == SendStatus.ABORTED
    for alloc in (rig.p_alloc, rig.d_alloc):
        alloc.check()
        assert alloc.num_free == NUM_PAGES


def test_control_link_lost_mid_transfer_frees_pool_pages_and_keeps_the_landing_area_until_the_sender_fences(
    pair: Pair,
) -> None:
    """Decode loses the control connection after prefill got its landing area. The pool pages are free at once
    (no peer can write them); the landing area is closed to writers at once and its memory kept until the sender's
    thread has ended and it says so with `fenced` over a new connection."""
    rig = _slow_rig(pair)
    rig.config = HandoffConfig(transfer_timeout_s=30, verdict_timeout_s=30, quarantine_timeout_s=600)
    pre, dec, _ = rig.pair_of("cut", 40 * LAYOUT.page_size, seed=8)
    pre.send()
    drive(pre, dec, until=lambda: dec.slot.coverage.num_covered >= 2)
    dec.slot.link.sever()  # the control connection breaks; prefill's writer may be mid-write
    drive(pre, dec, until=lambda: dec.ok is False)
    assert dec.record.reason == "transfer_error" and "closed" in dec.record.detail
    drive(pre, dec, until=lambda: dec.released)
    assert not dec.overdue and rig.d_alloc.num_free == NUM_PAGES
    # the sender marks `fenced` sent once its send returned
    drive(pre, dec, until=lambda: pre.settled and pre.handle.final_sent)
    assert pre.handle.sender_done and pre.handle.final_sent  # its `fenced` frame went out on a new connection
    wait_for(lambda: rig.receiver.landing_bytes_retained == 0)
    assert pre.handle.pages_sent < 40
    for alloc in (rig.p_alloc, rig.d_alloc):
        alloc.check()
        assert alloc.num_free == NUM_PAGES


def test_a_lost_control_link_frees_the_pool_pages_and_keeps_the_landing_memory_until_the_sender_fences(
    pair: Pair,
) -> None:
    rig = Rig(pair, config=HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=0.3))
    ids = list(range(16))
    seed_pool(rig.p_pool, 8)
    for rid, get_table in (("lost-after", True), ("lost-before", False)):
        dec = DecodeHandoff(
            Expectation(rid, 16, token_hash(ids), cap(rid)), rig.d_alloc, rig.d_pool, rig.receiver, rig.config
        )
        dec.start()
        m = build_manifest(rid, cap(rid), ids, rig.p_pool, [0, 1])
        with WireClient(rig.receiver.address, AUTH) as c:
            hello = c.read()
            assert hello == {"t": "hello", "session": rig.receiver.endpoint.session_id}  # no address of any memory
            if get_table:
                c.send_manifest(rid, cap(rid), m)
                dest = c.read()
                assert dest["t"] == "dest" and dest["num_pages"] == 2 and len(dest["bases"]) == 4
                pool_addrs = {t.data_ptr() for layer in rig.d_pool.tensors for t in layer.values()}
                assert not {a for a, _ in dest["bases"]} & pool_addrs  # a landing area, never the pool
            else:  # a malformed manifest (sealed by a key holder) fails the transfer: no landing area is made
                c.send({"t": "manifest", "rid": rid, "xid": cap(rid)}, seal(b"{not a manifest", AUTH.manifest_key))
                assert c.read()["t"] == "error"
        drive(dec, until=lambda dec=dec: dec.ok is False)
        assert dec.record.reason == "transfer_error"
        drive(dec)
        assert dec.released and not dec.overdue  # pool pages: free at once either way
        if not get_table:
            assert rig.receiver.landing_bytes_retained == 0
            continue
        assert rig.receiver.landing_bytes_retained == 2 * LAYOUT.bytes_per_page  # a write may still copy in
        with WireClient(rig.receiver.address, AUTH) as c:  # the sender, reconnected
            assert c.read()["t"] == "hello"
            c.send({"t": "fenced", "rid": rid, "xid": cap(rid)})
            wait_for(lambda: rig.receiver.landing_bytes_retained == 0)
    assert rig.d_alloc.num_free == NUM_PAGES
    rig.d_alloc.check()


def test_handoff_between_two_processes(pair: Pair) -> None:
    """Decode (this process, the module's receiver) and prefill (a child process with its own engine)."""
    # the child imports torch and Mooncake before it sends: on a loaded 2-core machine that can take 10 s
    rig = Rig(pair, config=HandoffConfig(transfer_timeout_s=60, verdict_timeout_s=60, quarantine_timeout_s=60))
    ids = list(range(500, 530))  # 30 tokens -> 4 pages of 8
    dec = DecodeHandoff(
        Expectation("xproc", 30, token_hash(ids), cap("xproc")), rig.d_alloc, rig.d_pool, rig.receiver, rig.config
    )
    dec.start()
    script = textwrap.dedent(
        f"""
        import os, time, torch
        from kvfence.disagg.handoff import PrefillHandoff, HandoffConfig
        from kvfence.kv.allocator import PageAllocator
        from kvfence.kv.layout import KVLayout
        from kvfence.kv.pool import KVPool
        from kvfence.transfer.base import TransferConfig
        from kvfence.auth.keys import ClusterKey
        from kvfence.auth.plane import PlaneAuth
        AUTH = PlaneAuth(ClusterKey.from_hex({AUTH.key.to_hex()!r}, "test"))
        from kvfence.transfer.mooncake import MooncakeSender
        layout = KVLayout.from_description({LAYOUT.describe()!r})
        pool = KVPool(layout, 16)
        g = torch.Generator().manual_seed(7)
        for layer in pool.tensors:
            for t in layer.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        alloc = PageAllocator(16)
        alloc.allocate("filler", 3)
        alloc.allocate("xproc", 4)  # pages 3..6
        sender = MooncakeSender(pool, TransferConfig(max_transfer_pages=3), auth=AUTH)
        pre = PrefillHandoff("xproc", {ids!r}, alloc, pool, sender, {rig.receiver.address!r}, HandoffConfig(),
                             transfer_id={cap("xproc")!r})
        pre.send()
        end = time.monotonic() + 20
        while not pre.settled and time.monotonic() < end:
            pre.poll()
            time.sleep(0.001)
        print(pre.outcome, pre.handle.chunks_sent, pre.handle.entries, alloc.num_free, flush=True)
        os._exit(0)  # skip the engine's one-second teardown
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        drive(dec, until=lambda: dec.ok is not None, timeout=60)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert dec.state == DecodeState.VERIFIED, (dec.record, err[-2000:])
    # 4 pages in chunks of 3; pages 3..6 land on consecutive decode pages, so each chunk merges per slice
    state, chunks, entries, free = out.split()
    assert (state, chunks, free) == ("verified", "2", str(16 - 3)), err[-2000:]
    assert 0 < int(entries) <= 4 * 4
    expected = KVPool(LAYOUT, 16)
    seed_pool(expected, 7)
    assert [expected.read_page(p) for p in range(3, 7)] == [rig.d_pool.read_page(p) for p in dec.pages]
    rig.d_alloc.free("xproc")
    rig.d_alloc.check()


def test_pages_beyond_decodes_allocation_are_counted_outside_and_never_written(pair: Pair) -> None:
    rig = Rig(pair)
    seed_pool(rig.p_pool, 9)
    before = [rig.d_pool.read_page(p) for p in range(NUM_PAGES)]
    m = build_manifest("over", cap("over"), list(range(3 * LAYOUT.page_size)), rig.p_pool, [0, 1, 2])  # 3 pages
    slot = rig.receiver.expect("over", [40, 41], cap("over"))  # decode allocated 2
    handle = rig.sender.send(rig.receiver.address, m, [0, 1, 2])
    end = time.monotonic() + 10
    while slot.status.value != "complete" and time.monotonic() < end:
        time.sleep(0.002)
    assert slot.coverage.counts.tolist() == [1, 1] and slot.coverage.outside == 1 and not slot.coverage.complete
    after = [rig.d_pool.read_page(p) for p in range(NUM_PAGES)]
    assert [p for p in range(NUM_PAGES) if after[p] != before[p]] == [40, 41]  # the landing area held 2 pages
    assert after[40] == rig.p_pool.read_page(0) and after[41] == rig.p_pool.read_page(1)
    rig.receiver.verdict("over", False, "coverage_gap")
    assert handle.wait(5) and handle.status == SendStatus.REJECTED
    rig.receiver.forget("over")


def test_a_failed_mooncake_write_aborts_the_transfer_with_the_engine_error(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = _slow_rig(pair)
    real, calls = rig.sender.endpoint.write_pages, []

    def failing_second_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MooncakeTransferError("Mooncake write failed (rc -1) on batch 1/1: simulated", "peer", -1, 0, True)
        return real(*args, **kwargs)

    monkeypatch.setattr(rig.sender.endpoint, "write_pages", failing_second_write)
    pre, dec, _ = rig.pair_of("mc-fail", 4 * LAYOUT.page_size, seed=10)
    pre.send()
    drive(pre, dec)
    assert pre.outcome == "failed" and pre.handle.status == SendStatus.ERROR
    assert "simulated" in pre.handle.reason and pre.handle.pages_sent == 1  # nothing after the failed chunk
    assert dec.state == DecodeState.FINISHED and "simulated" in dec.record.detail
    assert dec.slot.coverage.num_covered == 1  # the failed chunk's page was never marked
    assert dec.released and not dec.overdue  # the sender's `abort` settles it: it stopped writing
    assert rig.d_alloc.num_free == NUM_PAGES and rig.p_alloc.num_free == NUM_PAGES


def test_sending_to_a_dead_address_fails_the_handle(pair: Pair) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = build_manifest("dead", cap("dead"), [1], pair.p_pool, [0])
    handle = pair.sender.send(f"mooncake://127.0.0.1:{port}", m, [0])
    assert handle.wait_sender_done(10)  # the connect runs on the transfer's thread
    assert handle.status == SendStatus.ERROR and "cannot connect" in handle.reason
