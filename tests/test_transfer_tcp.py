"""The TCP transport: between processes, bounded chunks, the wire format, broken connections; Mooncake stub."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import TransferConfig
from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender
from kvfence.transfer.tcp import TcpReceiver, TcpSender
from tests.helpers import kv as helpers
from tests.helpers.auth import cap, plane_auth
from tests.helpers.kv import WireClient, verdict, wait_for

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout("Qwen3ForCausalLM", 3, (KVBufferSpec("k", (2, 8)), KVBufferSpec("v", (2, 8))), 4, torch.float16)
N = 24


def seeded_pool(seed: int) -> KVPool:
    return helpers.seeded_pool(LAYOUT, N, seed)


def test_handoff_between_two_processes_over_tcp() -> None:
    d_pool, d_alloc = KVPool(LAYOUT, N), PageAllocator(N)
    receiver = TcpReceiver(d_pool, auth=AUTH)
    ids = list(range(500, 530))  # 30 tokens -> 8 pages
    dec = DecodeHandoff(
        Expectation("xproc", 30, token_hash(ids), cap("xproc")), d_alloc, d_pool, receiver, HandoffConfig()
    )
    dec.start()
    script = textwrap.dedent(
        f"""
        import torch
        from kvfence.disagg.handoff import PrefillHandoff, PrefillState, HandoffConfig
        from kvfence.kv.allocator import PageAllocator
        from kvfence.kv.layout import KVLayout
        from kvfence.kv.pool import KVPool
        from kvfence.transfer.base import TransferConfig
        from kvfence.auth.keys import ClusterKey
        from kvfence.auth.plane import PlaneAuth
        AUTH = PlaneAuth(ClusterKey.from_hex({AUTH.key.to_hex()!r}, "test"))
        from kvfence.transfer.tcp import TcpSender
        import time
        layout = KVLayout.from_description({LAYOUT.describe()!r})
        pool = KVPool(layout, {N})
        g = torch.Generator().manual_seed(7)
        for layer in pool.tensors:
            for t in layer.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        alloc = PageAllocator({N})
        alloc.allocate("filler", 3)
        alloc.allocate("xproc", 8)  # pages 3..10
        sender = TcpSender(pool, TransferConfig(max_transfer_pages=3), auth=AUTH)
        pre = PrefillHandoff("xproc", {ids!r}, alloc, pool, sender, {receiver.address!r}, HandoffConfig(),
                             transfer_id={cap("xproc")!r})
        pre.send()
        end = time.monotonic() + 20
        while not pre.settled and time.monotonic() < end:
            pre.poll()
            time.sleep(0.001)
        print(pre.outcome, pre.handle.chunks_sent, alloc.num_free)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: verdict(dec) is not None, timeout=60)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        receiver.close()
    assert dec.state == DecodeState.VERIFIED, (dec.record, err)
    assert out.split() == ["verified", "3", str(N - 3)], err  # 8 pages in chunks of 3; source pages freed
    expected = seeded_pool(7)
    assert [expected.read_page(p) for p in range(3, 11)] == [d_pool.read_page(p) for p in dec.pages]


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_chunks_and_bytes_in_flight_are_bounded(transport: str) -> None:
    src, dst = seeded_pool(1), KVPool(LAYOUT, N)
    cfg = TransferConfig(max_transfer_pages=3, max_inflight_bytes=4 * LAYOUT.bytes_per_page)
    if transport == "tcp":
        receiver, sender = TcpReceiver(dst, auth=AUTH), TcpSender(src, cfg, auth=AUTH)
    else:
        fabric = LocalFabric()
        receiver, sender = LocalReceiver(fabric, "d", dst, auth=AUTH), LocalSender(fabric, src, cfg, auth=AUTH)
    ids = list(range(80))  # 20 pages
    m = build_manifest("r", cap("r"), ids, src, list(range(20)))
    slot = receiver.expect("r", list(range(23, 3, -1)), cap("r"))
    handle = sender.send(receiver.address, m, list(range(20)))
    wait_for(lambda: slot.status.value == "complete")
    assert handle.chunks_sent == 7 and handle.max_chunk_pages == 3
    assert 0 < handle.max_inflight_seen <= 4 * LAYOUT.bytes_per_page
    assert slot.coverage.complete and slot.bytes_received == 20 * LAYOUT.bytes_per_page
    assert all(src.read_page(i) == dst.read_page(d) for i, d in enumerate(slot.dest_pages))
    sender.close()
    receiver.close()


def test_wire_format_and_a_connection_lost_mid_transfer_fails_the_request() -> None:
    src, d_pool, d_alloc = seeded_pool(2), KVPool(LAYOUT, N), PageAllocator(N)
    receiver = TcpReceiver(d_pool, auth=AUTH)
    ids = list(range(16))
    dec = DecodeHandoff(Expectation("r", 16, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, HandoffConfig())
    dec.start()
    xid = cap("r")
    m = build_manifest("r", xid, ids, src, [0, 1, 2, 3])
    bpp = LAYOUT.bytes_per_page
    with WireClient(receiver.address, AUTH) as c:
        c.send_manifest("r", xid, m)
        assert c.read() == {"t": "ready", "rid": "r", "xid": xid}  # decode accepted it: the pages may come
        c.send({"t": "pages", "rid": "r", "xid": xid, "seq": 0, "idx": [0, 9], "nb": [bpp, bpp]},
               src.read_page(0) + src.read_page(1))  # fmt: skip
        assert c.read() == {"t": "chunk_ack", "rid": "r", "xid": xid, "seq": 0, "n": 2 * bpp}
    wait_for(lambda: verdict(dec) is False)
    assert dec.record.reason == "transfer_error" and "closed" in dec.record.detail
    assert dec.slot.coverage.counts.tolist() == [1, 0, 0, 0] and dec.slot.coverage.outside == 1
    assert d_pool.read_page(dec.pages[0]) == src.read_page(0)
    assert dec.released and d_alloc.num_free == N
    d_alloc.check()
    receiver.close()


def test_tcp_sender_to_a_dead_address_fails_the_handle() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    src = seeded_pool(3)
    sender = TcpSender(src, auth=AUTH)
    handle = sender.send(f"tcp://127.0.0.1:{port}", build_manifest("r", cap("r"), [1], src, [0]), [0])
    assert handle.wait_sender_done(10)  # the connect runs on the transfer's thread
    assert handle.status.value == "error" and "cannot connect" in handle.reason


def test_a_decode_that_never_answers_the_handshake_holds_up_neither_the_caller_nor_the_sends_to_others() -> None:
    import time

    silent = socket.socket()  # takes the TCP connection, never says hello: the sender waits out its handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    receiver = TcpReceiver(KVPool(LAYOUT, N), auth=AUTH)
    src = seeded_pool(5)
    sender = TcpSender(src, auth=AUTH)
    try:
        t0 = time.monotonic()
        stuck = sender.send(
            f"tcp://127.0.0.1:{silent.getsockname()[1]}", build_manifest("a", cap("a"), [1], src, [0]), [0]
        )
        healthy = sender.send(receiver.address, build_manifest("b", cap("b"), [1], src, [0]), [0])
        returned = time.monotonic() - t0
        wait_for(lambda: healthy.link is not None, timeout=3.0)  # connected while the other still waits
        assert returned < 0.5, f"send waited {returned:.1f}s for the network (prefill's loop would stall)"
        assert not stuck.finished, "the silent decode's send ended too early for this test to show anything"
        assert stuck.wait_sender_done(30)
        assert stuck.status.value == "error" and "handshake" in stuck.reason
    finally:
        sender.close()
        receiver.close()
        silent.close()


def test_sends_queued_behind_a_failed_connect_fail_with_it_instead_of_each_waiting_again() -> None:
    import time

    from kvfence.auth.plane import PlaneAuth

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    src = seeded_pool(6)
    sender = TcpSender(src, auth=PlaneAuth(AUTH.key, handshake_timeout_s=1.0))
    address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        handles = [sender.send(address, build_manifest(r, cap(r), [1], src, [0]), [0]) for r in "abcde"]
        assert all(h.wait_sender_done(20) for h in handles)
        took = time.monotonic() - t0
        assert all(h.status.value == "error" and "handshake" in h.reason for h in handles), [h.reason for h in handles]
        assert took < 3.0, f"5 sends to a silent decode took {took:.1f}s: each waited out its own handshake"
    finally:
        sender.close()
        silent.close()


def test_a_malformed_pages_frame_closes_the_connection_and_fails_the_request() -> None:
    src, d_pool, d_alloc = seeded_pool(4), KVPool(LAYOUT, N), PageAllocator(N)
    receiver = TcpReceiver(d_pool, auth=AUTH)
    ids = list(range(8))
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, HandoffConfig())
    dec.start()
    before = [d_pool.read_page(p) for p in dec.pages]
    bpp, xid = LAYOUT.bytes_per_page, cap("r")
    with WireClient(receiver.address, AUTH) as c:
        c.send_manifest("r", xid, build_manifest("r", xid, ids, src, [0, 1]))
        assert c.read()["t"] == "ready"
        c.send({"t": "pages", "rid": "r", "xid": xid, "seq": 0, "idx": [0], "nb": [2 * bpp]}, bytes(2 * bpp))
        assert c.sock.recv(1) == b""  # the receiver hung up
    wait_for(lambda: verdict(dec) is False)
    assert dec.record.reason == "transfer_error"
    assert [d_pool.read_page(p) for p in dec.pages] == before  # nothing of the oversized page was written
    assert AUTH.events.counts().get("frame_malformed", 0) >= 1  # counted as a security event, not a traceback
    receiver.close()
