"""Host staging of device pools (`transfer.staging`), on CPU tensors standing in for a device: the sender's two
buffers (a chunk being sent is never overwritten by the copy of the next), the receiver's landing (a page is in
the pool, and its write over, only once its copy finished), buffer reuse, and transfers between host and device
pools in both directions over TCP."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvfence.disagg.handoff import DecodeState, HandoffConfig, PrefillState
from kvfence.integrity.record import IntegrityMetrics
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import TransferConfig, default_mover
from kvfence.transfer.staging import HostStaging, PageLanding, StagedPages, landing_rows
from kvfence.transfer.tcp import TcpReceiver, TcpSender
from tests.helpers.auth import plane_auth
from tests.helpers.device import device_pool
from tests.helpers.faults import drive, handoff_pair, same_bytes
from tests.helpers.kv import seed_pool

AUTH = plane_auth()
LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 4)), KVBufferSpec("v", (2, 4))), 4, torch.bfloat16)


def joined(payload: Any) -> bytes:
    return b"".join(bytes(p) for p in payload)


def test_the_next_chunk_is_copied_into_the_other_buffer_while_this_one_is_sent() -> None:
    pool = seed_pool(device_pool(LAYOUT, 8), 1)
    page = {p: pool.read_page(p) for p in range(8)}
    staging = HostStaging(pool, rows=2)
    assert staging.pinned == (pool.device.type == "cuda")  # pinned host memory only for a pool on CUDA
    mover = StagedPages(staging)
    first = mover.move([0, 1], [3, 5], {})
    mover.lookahead([2, 3], [6, 7])  # started before `first` goes out
    second = mover.move([2, 3], [6, 7], {})
    assert mover.lookaheads_used == 1
    assert joined(first) == page[3] + page[5], "the copy of the next chunk overwrote the chunk being sent"
    assert joined(second) == page[6] + page[7]
    mover.lookahead([4], [2])
    third = mover.move([4], [0], {})  # the plan changed: the chunk asked for is staged, the lookahead dropped
    assert joined(third) == page[0] and joined(second) == page[6] + page[7]
    mover.close()
    again = StagedPages(staging)
    assert joined(again.move([0], [1], {})) == page[1]
    again.close()
    assert staging.sets_made == 2  # the buffers of the first transfer were reused


def test_staged_pages_are_damaged_like_inline_ones() -> None:
    pool = seed_pool(device_pool(LAYOUT, 4), 2)
    mover = StagedPages(HostStaging(pool, rows=2))
    bpp = LAYOUT.bytes_per_page
    corrupt, short = mover.move([0, 1], [2, 3], {0: "corrupt_byte", 1: "short_write"})
    want = bytearray(pool.read_page(2))
    want[bpp // 2] ^= 0x5A
    assert bytes(corrupt) == bytes(want) and bytes(short) == pool.read_page(3)[: bpp // 2]
    mover.close()


def test_a_device_pool_gets_the_staged_mover_and_a_host_pool_the_inline_one() -> None:
    config = TransferConfig(max_transfer_pages=3)
    assert type(default_mover(KVPool(LAYOUT, 2), config)).__name__ == "InlinePages"
    staged = default_mover(device_pool(LAYOUT, 2), config)
    assert isinstance(staged, StagedPages) and staged.staging.rows == 3


class _Slot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writing = 0


def test_a_landed_page_reaches_the_pool_and_ends_its_write_only_when_its_copy_finished() -> None:
    src = seed_pool(KVPool(LAYOUT, 5), 3)
    pool = device_pool(LAYOUT, 8)
    landing = PageLanding(HostStaging(pool, rows=2))
    slot = _Slot()
    dests = [7, 1, 4, 0, 6]
    for i, dest in enumerate(dests):  # 5 pages through buffers of 2: the chunk is split
        row, views = landing.reserve()
        views[0][:] = src.read_page(i)
        slot.writing += 1
        landing.hold(row, slot, dest)
    assert landing.commits == 2 and slot.writing > 0  # the last page (at least) is still on its way
    if pool.device.type == "cpu":  # a deferred copy: nothing of the last buffer is in the pool before drain
        assert pool.read_page(dests[-1]) != src.read_page(4)
    landing.drain()
    assert slot.writing == 0
    assert all(pool.read_page(d) == src.read_page(i) for i, d in enumerate(dests))
    row, views = landing.reserve()  # half a page: its prefix now, the rest of the page untouched
    views[0][:] = bytes(LAYOUT.bytes_per_page)
    before = pool.read_page(7)
    landing.write_prefix(row, 7, 10)
    assert pool.read_page(7) == bytes(10) + before[10:]
    landing.close()
    assert landing_rows(LAYOUT.bytes_per_page) == 64 and landing_rows(64 << 20) == 1


class _Rig:
    """One TCP sender and receiver between a prefill and a decode pool, each host-visible or a device pool."""

    def __init__(self, prefill_device: bool, decode_device: bool) -> None:
        def make(device: bool) -> KVPool:
            return device_pool(LAYOUT, 16) if device else KVPool(LAYOUT, 16)

        self.p_pool, self.d_pool = make(prefill_device), seed_pool(make(decode_device), 99)
        self.p_alloc, self.d_alloc = PageAllocator(16), PageAllocator(16)
        self.config = HandoffConfig(transfer_timeout_s=5, verdict_timeout_s=5, quarantine_timeout_s=5)
        self.metrics, self.faults = IntegrityMetrics(), None
        tcfg = TransferConfig(max_transfer_pages=2, max_inflight_bytes=3 * LAYOUT.bytes_per_page)
        self.receiver = TcpReceiver(self.d_pool, auth=AUTH)
        self.sender = TcpSender(self.p_pool, tcfg, auth=AUTH)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.mark.parametrize(
    "prefill_device, decode_device", [(True, True), (False, True), (True, False)], ids=["d2d", "h2d", "d2h"]
)
def test_transfers_between_host_and_device_pools_over_tcp_are_exact_and_verified(
    prefill_device: bool, decode_device: bool
) -> None:
    rig = _Rig(prefill_device, decode_device)
    try:
        for n, rid in enumerate(["a", "b", "c"]):  # three in a row: staging buffers are reused
            pre, dec, src = handoff_pair(rig, rid, 27, seed=n)  # 7 pages: 4 chunks of at most 2
            pre.send()
            drive(pre, dec)
            assert (
                dec.state == DecodeState.VERIFIED and pre.state == PrefillState.FINISHED and pre.outcome == "verified"
            )
            assert dec.record.digest_algorithm == ("mlh62" if prefill_device else "xxh3_64")
            assert same_bytes(src, rig.d_pool, dec.pages)
            rig.d_alloc.free(rid)
        if prefill_device:
            assert rig.sender.staging is not None and rig.sender.staging.sets_made == 2
        if decode_device:
            assert rig.receiver.core.staging is not None and rig.receiver.core.staging.sets_made == 2
        for alloc in (rig.p_alloc, rig.d_alloc):
            alloc.check()
            assert alloc.num_free == 16
    finally:
        rig.close()
