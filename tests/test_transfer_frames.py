"""The data plane's typed frames: each kind round-trips through the codec, and a frame that does not decode into a
frame of its direction is refused with a reason, on decode's side and on prefill's, over real TCP sockets."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import typing

import pytest
import torch

from kvfence.auth import handshake
from kvfence.disagg.handoff import DecodeHandoff, HandoffConfig
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer import frames
from kvfence.transfer.base import SendStatus, SlotStatus
from kvfence.transfer.frames import (
    Abort,
    Aborted,
    ChunkAck,
    Dest,
    Done,
    Error,
    Fenced,
    FrameError,
    Hello,
    Manifest,
    Pages,
    Ready,
    Verdict,
)
from kvfence.transfer.tcp import TcpReceiver, TcpSender
from tests.helpers.auth import cap, plane_auth
from tests.helpers.kv import WireClient, wait_for

LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (1, 4)), KVBufferSpec("v", (1, 4))), 4, torch.float32)
N = 8
X = "a" * 32

EXAMPLES = [
    Manifest("r", X),
    Pages("r", X, 3, [0, 5], [64, 32]),
    Done("r", X, 2),
    Abort("r", X, "prefill OOM"),
    Aborted("r", X),
    Fenced("r", X),
    Ready("r", X),
    ChunkAck("r", X, 3, 96),
    Verdict("r", X, False, "digest mismatch"),
    Error("r", X, "second manifest for request r"),
    Hello("session-1"),
    Dest("r", X, 2, [(4096, 128), (8192, 128)], (4096, 8192)),
]


def _members(union: object) -> set[type]:
    return set(typing.get_args(union))


def test_every_frame_kind_round_trips_through_the_codec_of_its_direction() -> None:
    assert {type(f) for f in EXAMPLES} == _members(frames.ToReceiver) | _members(frames.ToSender)  # none left out
    for f in EXAMPLES:
        data = frames.encode(f)
        wire = json.loads(data)
        assert next(iter(wire)) == "t" and wire["t"] == f.kind  # the kind first, as the transports' dicts had it
        if type(f) in _members(frames.ToReceiver):
            assert frames.decode_to_receiver(data) == f
        else:
            with pytest.raises(FrameError, match="sender's frame of an unknown kind"):
                frames.decode_to_receiver(data)
        if type(f) in _members(frames.ToSender):
            assert frames.decode_to_sender(data) == f
        else:
            with pytest.raises(FrameError, match="receiver's frame of an unknown kind"):
                frames.decode_to_sender(data)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (b"{not json", "sender's frame header is not JSON"),
        (b"[1, 2, 3]", "Expected `object`, got `array`"),
        (b'{"t": "bogus", "rid": "r", "xid": "x"}', "unknown kind"),
        (b'{"t": "pages", "rid": "r", "xid": "x", "seq": 0, "idx": [0]}', "missing required field `nb`"),
        (b'{"t": "pages", "rid": "r", "xid": "x", "seq": 0, "idx": [0, 1], "nb": [4]}', "2 pages but 1 sizes"),
        (b'{"t": "done", "rid": "r", "xid": "x", "pages": "2"}', "Expected `int`, got `str`"),
        (b'{"t": "done", "rid": "r", "xid": "x", "pages": 2, "extra": 1}', "unknown field `extra`"),
    ],
)
def test_a_header_that_is_not_a_senders_frame_names_what_is_wrong(header: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        frames.decode_to_receiver(header)


def test_decode_refuses_an_unknown_frame_kind_drops_the_connection_and_keeps_the_slot(caplog) -> None:
    auth = plane_auth()
    d_pool, d_alloc = KVPool(LAYOUT, N), PageAllocator(N)
    receiver = TcpReceiver(d_pool, auth=auth)
    ids = list(range(8))
    dec = DecodeHandoff(Expectation("r", 8, token_hash(ids), cap("r")), d_alloc, d_pool, receiver, HandoffConfig())
    dec.start()
    caplog.set_level(logging.WARNING, logger="kvfence.security")
    try:
        with WireClient(receiver.address, auth) as c:
            c.send({"t": "ready", "rid": "r", "xid": cap("r")})  # a receiver's word, sent to a receiver
            c.sock.settimeout(5)
            assert c.sock.recv(1) == b""  # decode hung up
        wait_for(lambda: auth.events.counts().get("frame_malformed") == 1)
        assert "sender's frame of an unknown kind" in caplog.text and "'ready'" in caplog.text
        assert dec.slot.status == SlotStatus.WAITING  # the refused frame touched nothing
        assert "Traceback" not in caplog.text
    finally:
        dec.abort("test over")
        receiver.close()


class _BadReceiver:
    """A decode endpoint that passes the handshake, reads prefill's manifest frame, then answers `reply` (raw
    header bytes, MACed as a real receiver would)."""

    def __init__(self, auth, reply: bytes) -> None:
        self.auth, self.reply = auth, reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(10)
        sock = self.listener.accept()[0]
        with sock:
            mac = handshake.accept(sock, self.auth.data_key, 5.0)
            prefix = sock.recv(8, socket.MSG_WAITALL)
            hlen, plen = struct.unpack("<II", prefix)
            sock.recv(hlen + handshake.FRAME_TAG_BYTES + plen, socket.MSG_WAITALL)
            out = struct.pack("<II", len(self.reply), 0)
            sock.sendall(out + self.reply + mac.sign(out, self.reply))
            sock.settimeout(5)
            try:
                while sock.recv(4096):
                    pass  # until prefill hangs up
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=5)


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (b'{"t": "manifest", "rid": "r", "xid": "X"}', "receiver's frame of an unknown kind"),  # a sender's word
        (b'{"t": "verdict", "rid": "r", "xid": "X", "ok": "yes", "reason": ""}', "Expected `bool`, got `str`"),
    ],
)
def test_prefill_refuses_a_malformed_reply_and_fails_the_transfer(caplog, reply: bytes, reason: str) -> None:
    auth = plane_auth()
    src = KVPool(LAYOUT, N)
    bad = _BadReceiver(auth, reply.replace(b'"X"', f'"{cap("r")}"'.encode()))
    sender = TcpSender(src, auth=auth)
    caplog.set_level(logging.WARNING, logger="kvfence.security")
    try:
        handle = sender.send(bad.address, build_manifest("r", cap("r"), list(range(8)), src, [0, 1]), [0, 1])
        assert handle.wait(10), "the sender kept waiting on a refused frame"
        assert handle.status == SendStatus.ERROR and handle.pages_sent == 0  # no `ready`: no page moved
        wait_for(lambda: auth.events.counts().get("frame_malformed") == 1)
        assert reason in caplog.text
    finally:
        sender.close()
        bad.close()
