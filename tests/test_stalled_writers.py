"""No page goes back to a free list while any transport thread could still write into it or read from it.

The attack: a prefill whose data connection stalls in the middle of a page (a partition, a SIGSTOP'd
process later resumed) while the deadlines run out. Decode must not hand the pages to another request
until the stuck write has provably ended; prefill must not reuse source pages a blocked send still reads.
Every test here runs the real TCP transport threads and sockets.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import torch

from kvfence.auth import handshake
from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig, PrefillHandoff, PrefillState
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SendStatus, SlotStatus, TransferConfig
from kvfence.transfer.tcp import TcpReceiver, TcpSender
from tests.helpers import kv as helpers
from tests.helpers.auth import cap, plane_auth
from tests.helpers.device import device_pool
from tests.helpers.kv import WireClient, verdict, wait_for

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 8)), KVBufferSpec("v", (2, 8))), 4, torch.float32)
BPP = LAYOUT.bytes_per_page


def seeded_pool(num_pages: int, seed: int, layout: KVLayout = LAYOUT) -> KVPool:
    return helpers.seeded_pool(layout, num_pages, seed)


class StalledPrefill:
    """A prefill that sends its manifest, then half of page 0, then stops sending (but stays connected)."""

    def __init__(self, address: str, rid: str, ids: list[int], src: KVPool) -> None:
        self.rid = rid
        self.page = src.read_page(0)
        self.client = WireClient(address, AUTH)
        self.sock = self.client.sock
        manifest = build_manifest(rid, cap(rid), ids, src, list(range(-(-len(ids) // LAYOUT.page_size))))
        self.client.send_manifest(rid, cap(rid), manifest)
        pages = {"t": "pages", "rid": rid, "xid": cap(rid), "seq": 0, "idx": [0], "nb": [BPP]}
        self.client.send(pages, self.page[: BPP // 2], payload_len=BPP)

    def resume(self) -> None:
        """The stalled process wakes up and sends the rest of its page and its `done`."""
        try:
            self.client.raw(self.page[BPP // 2 :])
            self.client.send({"t": "done", "rid": self.rid, "xid": cap(self.rid), "pages": 2})
        except OSError:
            pass  # decode cut the connection: nothing of it can land

    def close(self) -> None:
        self.sock.close()


def send_and_verify(rid: str, ids: list[int], src: KVPool, receiver: TcpReceiver, dec: DecodeHandoff) -> None:
    alloc = PageAllocator(src.num_pages)
    alloc.allocate(rid, dec.num_pages)
    sender = TcpSender(src, auth=AUTH)
    pre = PrefillHandoff(rid, ids, alloc, src, sender, receiver.address, HandoffConfig(), transfer_id=cap(rid))
    pre.send()
    wait_for(lambda: dec.poll() == DecodeState.VERIFIED and pre.poll() == PrefillState.FINISHED)
    sender.close()


@pytest.mark.parametrize("decode_pool", ["host", "device"])
def test_a_write_stalled_mid_page_past_every_deadline_never_lands_in_the_next_owners_pages(decode_pool: str) -> None:
    """Also with a device pool on decode, whose pages land in the connection's host buffers first."""
    d_pool = device_pool(LAYOUT, 2) if decode_pool == "device" else KVPool(LAYOUT, 2)
    d_alloc = PageAllocator(2)  # two pages: the next request must reuse them
    receiver = TcpReceiver(
        d_pool, io_timeout_s=600, auth=AUTH
    )  # the socket timeout stays out of it: only deadlines act
    now = [0.0]
    config = HandoffConfig(transfer_timeout_s=1, verdict_timeout_s=1, quarantine_timeout_s=1)
    ids_a = list(range(8))
    dec_a = DecodeHandoff(
        Expectation("a", 8, token_hash(ids_a), cap("a")), d_alloc, d_pool, receiver, config, clock=lambda: now[0]
    )
    pages_a = dec_a.start()
    stalled = StalledPrefill(receiver.address, "a", ids_a, seeded_pool(2, seed=1))
    wait_for(lambda: receiver.core.slot("a").writing == 1)  # the receiver thread is inside page 0's write
    assert dec_a.poll() == DecodeState.RECEIVING  # decode's loop sees the transfer start: its clock runs

    now[0] += 2  # the transfer deadline passes: request a fails
    assert verdict(dec_a) is False and dec_a.record.reason == "timeout"
    assert not dec_a.released and d_alloc.num_quarantined == 2  # a write is in progress: nothing is freed
    now[0] += 2  # the quarantine deadline passes: decode cuts the stalled connection, never frees by clock
    dec_a.poll()
    assert dec_a.overdue and dec_a.severed
    wait_for(lambda: verdict(dec_a) is False and dec_a.released)  # once the stuck write has failed
    assert receiver.core.slot("a") is None and d_alloc.num_free == 2

    ids_b = list(range(100, 108))
    dec_b = DecodeHandoff(Expectation("b", 8, token_hash(ids_b), cap("b")), d_alloc, d_pool, receiver, HandoffConfig())
    assert sorted(dec_b.start()) == sorted(pages_a)  # the very pages the stalled write was aimed at
    send_and_verify("b", ids_b, seeded_pool(2, seed=2), receiver, dec_b)
    verified = [d_pool.read_page(p) for p in dec_b.pages]

    stalled.resume()
    time.sleep(0.3)
    assert [d_pool.read_page(p) for p in dec_b.pages] == verified, "a late write changed verified pages"
    d_alloc.check()
    stalled.close()
    receiver.close()


def test_a_receiver_drops_a_connection_that_stalls_mid_frame_without_waiting_for_any_deadline() -> None:
    d_pool, d_alloc = KVPool(LAYOUT, 4), PageAllocator(4)
    receiver = TcpReceiver(d_pool, io_timeout_s=0.3, auth=AUTH)
    ids = list(range(8))
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, HandoffConfig())
    dec.start()
    stalled = StalledPrefill(receiver.address, "r", ids, seeded_pool(2, seed=1))
    wait_for(lambda: verdict(dec) is False, timeout=5)
    assert dec.record.reason == "transfer_error" and "closed" in dec.record.detail
    assert dec.released and d_alloc.num_free == 4 and not dec.overdue
    stalled.close()
    receiver.close()


def test_idle_connections_survive_the_socket_timeout_between_frames() -> None:
    d_pool, d_alloc = KVPool(LAYOUT, 4), PageAllocator(4)
    receiver = TcpReceiver(d_pool, io_timeout_s=0.2, auth=AUTH)
    src = seeded_pool(4, seed=3)
    sender = TcpSender(src, TransferConfig(io_timeout_s=0.2), auth=AUTH)
    for n, rid in enumerate(("first", "second")):  # the second transfer reuses the connection after idling
        if n:
            time.sleep(0.6)
        ids = list(range(n, n + 8))
        dec = DecodeHandoff(Expectation(rid, 8, token_hash(ids), cap(rid)), d_alloc, d_pool, receiver, HandoffConfig())
        dec.start()
        p_alloc = PageAllocator(4)
        p_alloc.allocate(rid, 2)
        pre = PrefillHandoff(rid, ids, p_alloc, src, sender, receiver.address, HandoffConfig(), transfer_id=cap(rid))
        pre.send()
        wait_for(lambda dec=dec, pre=pre: dec.poll() == DecodeState.VERIFIED and pre.poll() == PrefillState.FINISHED)
        d_alloc.free(rid)
    assert len(sender._conns) == 1 and not next(iter(sender._conns.values())).closed
    sender.close()
    receiver.close()


def test_pages_of_a_transfer_arriving_on_another_connection_are_discarded() -> None:
    d_pool, d_alloc = KVPool(LAYOUT, 4), PageAllocator(4)
    receiver = TcpReceiver(d_pool, auth=AUTH)
    src = seeded_pool(2, seed=4)
    ids = list(range(8))
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, HandoffConfig())
    dest = dec.start()
    before = d_pool.read_page(dest[0])
    owner = WireClient(receiver.address, AUTH)
    owner.send_manifest("r", cap("r"), build_manifest("r", cap("r"), ids, src, [0, 1]))
    wait_for(lambda: receiver.core.slot("r").status == SlotStatus.RECEIVING)
    intruder = WireClient(receiver.address, AUTH)  # another connection, even one that holds the key
    pages = {"t": "pages", "rid": "r", "xid": cap("r"), "seq": 0, "idx": [0], "nb": [BPP]}
    intruder.send(pages, src.read_page(0))
    intruder.send({"t": "done", "rid": "r", "xid": cap("r"), "pages": 1})
    assert intruder.read()["t"] == "chunk_ack"  # the frame was read (and dropped)
    slot = receiver.core.slot("r")
    assert slot.coverage.num_covered == 0 and slot.status == SlotStatus.RECEIVING and not slot.sender_final
    assert d_pool.read_page(dest[0]) == before
    for s in (owner, intruder):
        s.close()
    receiver.close()


class Blackhole:
    """A decode that authenticates a connection, accepts its manifest, then never reads again: one that stopped
    (SIGSTOP) with its socket open. Its accept thread answers the handshake and the manifest (`ready`), so the sender
    gets as far as sending pages."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.conns: list[socket.socket] = []
        self._accepted = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(10)
        try:
            sock = self.listener.accept()[0]
            mac = handshake.accept(sock, AUTH.data_key, 5.0)
            prefix = sock.recv(8, socket.MSG_WAITALL)  # the manifest: read it whole and say `ready`
            hlen, plen = struct.unpack("<II", prefix)
            header = json.loads(sock.recv(hlen + 16, socket.MSG_WAITALL)[:hlen])
            sock.recv(plen, socket.MSG_WAITALL)
            hb = json.dumps({"t": "ready", "rid": header["rid"], "xid": header["xid"]}).encode()
            reply = struct.pack("<II", len(hb), 0)
            sock.sendall(reply + hb + mac.sign(reply, hb))
        except OSError:
            return
        self.conns.append(sock)
        self._accepted.set()

    def accept(self) -> None:
        assert self._accepted.wait(10), "the sender never connected"

    def close(self) -> None:
        for s in [*self.conns, self.listener]:
            s.close()


BIG = KVLayout("LlamaForCausalLM", 4, (KVBufferSpec("k", (8, 64)), KVBufferSpec("v", (8, 64))), 16, torch.float32)


def test_prefill_keeps_source_pages_while_a_blocked_send_still_reads_them_then_cuts_it_at_the_verdict_deadline() -> (
    None
):
    src = seeded_pool(64, seed=5, layout=BIG)  # 64 pages of 256 KiB: far more than the socket buffers hold
    alloc = PageAllocator(64)
    alloc.allocate("r", 64)
    hole = Blackhole()
    sender = TcpSender(
        src, TransferConfig(max_transfer_pages=64, max_inflight_bytes=1 << 40, io_timeout_s=600), auth=AUTH
    )
    now = [0.0]
    config = HandoffConfig(transfer_timeout_s=1, verdict_timeout_s=1)
    pre = PrefillHandoff(
        "r", list(range(64 * 16)), alloc, src, sender, hole.address, config, clock=lambda: now[0], transfer_id=cap("r")
    )
    handle = pre.send()
    hole.accept()
    time.sleep(0.3)
    assert handle.status == SendStatus.SENDING and not handle.sender_done  # blocked inside sendmsg
    for _ in range(3):  # send deadline, then verdict deadline: the send thread is still reading the pages
        now[0] += 1.5
        pre.poll()
        assert pre.outcome == "failed"
        assert not pre.released or handle.sender_done, "source pages freed while a send still reads them"
    assert pre.severed
    wait_for(lambda: pre.poll() == PrefillState.FINISHED and pre.outcome == "failed")
    assert handle.sender_done and alloc.num_free == 64
    alloc.check()
    sender.close()
    hole.close()


def test_a_sender_whose_peer_stops_reading_fails_on_the_socket_timeout() -> None:
    src = seeded_pool(64, seed=6, layout=BIG)
    hole = Blackhole()
    sender = TcpSender(
        src, TransferConfig(max_transfer_pages=64, max_inflight_bytes=1 << 40, io_timeout_s=0.3), auth=AUTH
    )
    handle = sender.send(
        hole.address, build_manifest("r", cap("r"), list(range(64 * 16)), src, list(range(64))), range(64)
    )
    hole.accept()
    assert handle.wait_sender_done(timeout=10)
    assert handle.status == SendStatus.ERROR and "timed out" in handle.reason
    sender.close()
    hole.close()
