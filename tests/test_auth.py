"""Authentication of the internal planes, piece by piece: the cluster key and where it comes from, the data plane's
handshake and frame MACs, the data-plane receiver refusing strangers before it reads or allocates anything, sealed
manifests and transfer capabilities that a stranger's frame cannot use or spoil, and the control plane's CURVE.
(tests/test_attacks.py runs the same attacks as separate processes against a real `kvfence serve`.)"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import pytest
import torch

from kvfence.auth import handshake
from kvfence.auth.curve import CurveKeys
from kvfence.auth.events import SecurityEvent
from kvfence.auth.keys import ENV_KEY, ENV_KEY_FILE, ClusterKey, ClusterKeyError, load_cluster_key, write_key_file
from kvfence.auth.plane import PlaneAuth
from kvfence.disagg import messages as P
from kvfence.disagg.handoff import DecodeHandoff, DecodeState, HandoffConfig, PrefillHandoff
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SlotStatus
from kvfence.transfer.tcp import TcpReceiver, TcpSender, parse_address
from tests.helpers.auth import plane_auth, xid
from tests.helpers.kv import WireClient, seeded_pool, wait_for

LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (2, 8)), KVBufferSpec("v", (2, 8))), 4, torch.float32)
N = 16


# -- the key ----------------------------------------------------------------------------------------------------


def test_a_role_without_a_key_refuses_to_start_and_says_how_to_get_one() -> None:
    with pytest.raises(ClusterKeyError, match="--cluster-key-file.*--insecure-no-auth"):
        load_cluster_key(None, insecure=False, environ={})
    insecure = load_cluster_key(None, insecure=True, environ={})
    assert not insecure.secure and insecure.describe() == {"enabled": False, "key_id": None}


def test_the_key_comes_from_the_flag_then_the_file_variable_then_the_key_variable(tmp_path) -> None:
    a, b, c = ClusterKey.generate(), ClusterKey.generate(), ClusterKey.generate()
    write_key_file(tmp_path / "a", a)
    write_key_file(tmp_path / "b", b)
    env = {ENV_KEY_FILE: str(tmp_path / "b"), ENV_KEY: c.to_hex()}
    assert load_cluster_key(str(tmp_path / "a"), False, env) == a
    assert load_cluster_key(None, False, env) == b
    assert load_cluster_key(None, False, {ENV_KEY: c.to_hex()}) == c
    with pytest.raises(ClusterKeyError, match="together with a cluster key"):
        load_cluster_key(None, True, {ENV_KEY: c.to_hex()})


def test_a_key_file_others_can_read_is_refused_and_a_short_key_too(tmp_path) -> None:
    path = tmp_path / "k"
    write_key_file(path, ClusterKey.generate())
    assert (path.stat().st_mode & 0o777) == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match="readable by others"):
        load_cluster_key(str(path), False, {})
    with pytest.raises(ClusterKeyError, match="64 hex characters"):
        ClusterKey.from_hex("ab" * 16, "test")
    with pytest.raises(FileExistsError):  # never overwritten
        write_key_file(path, ClusterKey.generate())


def test_the_key_never_shows_and_each_purpose_gets_its_own_key() -> None:
    key = ClusterKey.generate()
    assert key.to_hex() not in repr(key) and key.to_hex() not in str(key.describe())
    assert len({key.derive("data-plane"), key.derive("manifest"), key.derive("control-plane/curve-server")}) == 3
    assert key.derive("manifest") == ClusterKey(key.secret).derive("manifest")
    assert key.key_id == ClusterKey(key.secret).key_id != ClusterKey.generate().key_id
    auth = PlaneAuth(key)
    assert key.to_hex() not in repr(auth) and auth.data_key.hex() not in repr(auth)


def test_kvfence_cluster_key_writes_a_private_file_and_never_overwrites(tmp_path, capsys) -> None:
    from kvfence.cli import main

    path = tmp_path / "cluster.key"
    assert main(["cluster-key", str(path)]) == 0
    key = load_cluster_key(str(path), False, {})
    assert key.key_id in capsys.readouterr().err and key.to_hex() not in capsys.readouterr().err
    assert main(["cluster-key", str(path)]) == 2  # exists: refused, one line, no traceback
    assert "never overwritten" in capsys.readouterr().err


# -- the data plane's handshake ------------------------------------------------------------------------------------


def _handshake(key_r: bytes, key_s: bytes) -> tuple[object, object]:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def receiver() -> None:
        try:
            out["r"] = handshake.accept(a, key_r, 2.0)
        except handshake.HandshakeError as e:
            out["r"] = e
            a.close()  # as the receiver does: the sender's wait ends at once

    t = threading.Thread(target=receiver)
    t.start()
    try:
        out["s"] = handshake.connect(b, key_s, 2.0)
    except handshake.HandshakeError as e:
        out["s"] = e
    t.join()
    a.close()
    b.close()
    return out["r"], out["s"]


def test_the_handshake_admits_a_holder_of_the_key_and_binds_each_frame_to_its_place() -> None:
    key = ClusterKey.generate().derive("data-plane")
    recv_mac, send_mac = _handshake(key, key)
    assert isinstance(recv_mac, handshake.FrameMac) and isinstance(send_mac, handshake.FrameMac)
    first, second = (b"\x01" * 8, b'{"t":"a"}'), (b"\x02" * 8, b'{"t":"b"}')
    tag1, tag2 = send_mac.sign(*first), send_mac.sign(*second)
    assert recv_mac.check(*first, tag1) and recv_mac.check(*second, tag2)
    assert not recv_mac.check(*second, tag2)  # the same frame again (a replay) fails: its place has passed
    _, s2 = _handshake(key, key)
    assert isinstance(s2, handshake.FrameMac) and s2.sign(*first) != tag1  # another connection, other keys


def test_a_peer_with_another_key_fails_the_handshake_on_both_sides() -> None:
    r, s = _handshake(ClusterKey.generate().derive("data-plane"), ClusterKey.generate().derive("data-plane"))
    assert isinstance(r, handshake.HandshakeError) and "does not hold" in str(r)
    assert isinstance(s, handshake.HandshakeError)


def test_a_peer_that_dribbles_its_answer_is_dropped_when_the_whole_handshake_overruns() -> None:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def receiver() -> None:
        t0 = time.monotonic()
        try:
            handshake.accept(a, ClusterKey.generate().derive("data-plane"), 1.0)
        except handshake.HandshakeError as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=receiver)
    t.start()
    try:
        end = time.monotonic() + 6
        while t.is_alive() and time.monotonic() < end:  # one byte every 0.2 s: each read alone is quick
            b.send(b"\x00")
            time.sleep(0.2)
        t.join(10)
    finally:
        a.close()
        b.close()
    assert "no handshake answer within 1s" in str(out["error"])
    assert float(out["seconds"]) < 2.0  # type: ignore[arg-type]


# -- the data-plane receiver ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def decode_side():
    auth = plane_auth()
    d_pool, d_alloc = KVPool(LAYOUT, N), PageAllocator(N)
    receiver = TcpReceiver(d_pool, auth=auth)
    ids = list(range(8))
    cap = xid()
    dec = DecodeHandoff(Expectation("victim", 8, token_hash(ids), cap), d_alloc, d_pool, receiver, HandoffConfig())
    dec.start()
    yield auth, receiver, dec, ids, cap
    receiver.close()


def test_a_stranger_gets_no_frame_read_and_its_4gib_header_costs_nothing(decode_side) -> None:
    auth, receiver, dec, _, _ = decode_side
    before = _rss_bytes()
    with socket.create_connection(parse_address(receiver.address)) as s:
        s.sendall(struct.pack("<II", 0xFFFFFFFF, 0) + b"[1, 2, 3]")  # the old wire format's 4 GiB header
        hello = s.recv(40, socket.MSG_WAITALL)
        assert hello[:8] == handshake.MAGIC  # the receiver speaks first: a challenge, nothing else
        s.settimeout(30)  # the receiver gives an answer 5 s to come
        assert s.recv(1) == b""  # then it hangs up: the 8 + 9 bytes were not a valid answer
    wait_for(lambda: auth.events.counts().get("handshake_failed") == 1)
    assert _rss_bytes() - before < 64 << 20
    assert dec.slot.status == SlotStatus.WAITING and dec.poll() == DecodeState.RESERVED


def test_a_key_holders_oversized_or_malformed_frames_are_dropped_without_allocation_or_traceback(
    decode_side, caplog
) -> None:
    auth, receiver, dec, _, _ = decode_side
    before = _rss_bytes()
    with WireClient(receiver.address, auth) as c:
        c.raw(struct.pack("<II", 0xFFFFFFFF, 0))  # a 4 GiB header length, after a valid handshake
        c.sock.settimeout(5)
        assert c.sock.recv(1) == b""
    with WireClient(receiver.address, auth) as c:
        c.send([1, 2, 3])  # type: ignore[arg-type]  # a JSON list where an object belongs
        c.sock.settimeout(5)
        assert c.sock.recv(1) == b""
    wait_for(lambda: auth.events.counts().get("header_too_large") == 1)
    wait_for(lambda: auth.events.counts().get("frame_malformed") == 1)
    assert _rss_bytes() - before < 64 << 20
    assert "Traceback" not in caplog.text
    assert dec.slot.status == SlotStatus.WAITING


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closes `sock` (read to the end: a close, or a reset when it had unread data)."""
    sock.settimeout(5)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


class RecordingProxy:
    """A TCP relay between one client and `target` that records every byte the client sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target, self.sent = target, bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client = self.listener.accept()[0]
        upstream = socket.create_connection(self.target)

        def pump(a: socket.socket, b: socket.socket, record: bool) -> None:
            try:
                while data := a.recv(65536):
                    if record:
                        self.sent += data
                    b.sendall(data)
            except OSError:
                pass
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)


def test_replayed_data_frames_are_refused_on_the_same_and_on_a_new_connection(decode_side) -> None:
    auth, receiver, dec, ids, cap = decode_side
    src = seeded_pool(LAYOUT, N, 3)
    proxy = RecordingProxy(parse_address(receiver.address))
    with WireClient(proxy.address, auth) as c:
        c.send_manifest("victim", cap, build_manifest("victim", cap, ids, src, [0, 1]))  # a real session, recorded
        wait_for(lambda: dec.slot.status == SlotStatus.RECEIVING)
        manifest_frame = bytes(proxy.sent[handshake.NONCE_BYTES + handshake.TAG_BYTES :])
        c.raw(manifest_frame)  # the same frame again on the same connection: its MAC no longer fits its place
        c.sock.settimeout(5)
        assert _hung_up(c.sock)
    wait_for(lambda: auth.events.counts().get("frame_mac_invalid") == 1)
    with socket.create_connection(parse_address(receiver.address)) as s:  # the whole session, on a new connection
        assert s.recv(40, socket.MSG_WAITALL)[:8] == handshake.MAGIC
        s.sendall(bytes(proxy.sent))
        assert _hung_up(s)
    wait_for(lambda: auth.events.counts().get("handshake_failed") == 1)
    assert dec.slot.manifest is not None and dec.slot.manifest.transfer_id == cap  # the real one, once


def test_a_manifest_sealed_with_another_key_or_for_another_transfer_leaves_the_slot_untouched(decode_side) -> None:
    auth, receiver, dec, ids, cap = decode_side
    src = seeded_pool(LAYOUT, N, 4)
    stranger = PlaneAuth(ClusterKey.generate())
    with WireClient(receiver.address, auth) as c:
        forged = build_manifest("victim", cap, ids, src, [0, 1])
        c.send({"t": "manifest", "rid": "victim", "xid": cap}, _seal(forged, stranger))
        assert c.read() == {"t": "error", "rid": "victim", "xid": cap, "reason": "manifest does not authenticate"}
        other = xid()
        c.send_manifest("victim", other, build_manifest("victim", other, ids, src, [0, 1]))
        assert "expects another transfer" in c.read()["reason"]
        c.send({"t": "manifest", "rid": "victim", "xid": cap}, b"not even sealed")
        assert c.read()["reason"] == "manifest does not authenticate"
    assert auth.events.counts() == {"manifest_unauthenticated": 2, "capability_mismatch": 1}
    assert dec.slot.status == SlotStatus.WAITING and dec.slot.manifest is None
    # the real prefill, holding the key and the capability, is not locked out by any of it
    p_alloc = PageAllocator(N)
    p_alloc.allocate("victim", 2)
    sender = TcpSender(src, auth=auth)
    pre = PrefillHandoff("victim", ids, p_alloc, src, sender, receiver.address, HandoffConfig(), transfer_id=cap)
    pre.send()
    wait_for(lambda: dec.poll() == DecodeState.VERIFIED)
    assert dec.record.status == "verified" and dec.record.authenticated is True
    assert dec.record.transfer_ref and cap not in json.dumps(dec.record.to_api())  # the capability never shows
    sender.close()


def _seal(manifest, auth: PlaneAuth) -> bytes:
    from kvfence.integrity.manifest import seal

    return seal(manifest.to_bytes(), auth.manifest_key)


def test_a_sender_refuses_a_receiver_that_cannot_prove_the_key() -> None:
    impostor = TcpReceiver(KVPool(LAYOUT, N), auth=plane_auth())  # another deployment's (or an attacker's) decode
    src = seeded_pool(LAYOUT, N, 5)
    auth = plane_auth()
    sender = TcpSender(src, auth=auth)
    handle = sender.send(impostor.address, build_manifest("r", xid(), [1, 2], src, [0]), [0])
    assert handle.wait_sender_done(10)  # the connect runs on the transfer's thread
    assert (
        handle.status.value == "error" and "cannot connect" in handle.reason and "another cluster key" in handle.reason
    )
    assert auth.events.counts() == {"handshake_failed": 1} and impostor.auth.events.counts() == {"handshake_failed": 1}
    sender.close()
    impostor.close()


# -- the control plane -------------------------------------------------------------------------------------------


def test_the_router_admits_only_holders_of_the_key_and_counts_the_others() -> None:
    key = ClusterKey.generate()
    keys = CurveKeys.from_cluster_key(key)
    hub = P.ZmqHub("127.0.0.1", 0, curve=keys)
    strangers = [
        P.ZmqChannel(hub.address, "prefill-9", CurveKeys.from_cluster_key(ClusterKey.generate()), send_timeout_s=1),
        P.ZmqChannel(hub.address, "prefill-8", None, send_timeout_s=1),  # no CURVE at all
    ]
    member = P.ZmqChannel(hub.address, "decode-0", keys)
    try:
        for ch in strangers:
            try:
                ch.send(P.Shutdown())
            except P.ControlLinkDown:
                pass  # libzmq may already have dropped a link refused for its mechanism: nothing is sent
        member.send(P.Abort("r", "hello"))
        got, end = [], time.monotonic() + 5
        while time.monotonic() < end and (not got or hub.events.total() < 2):
            m = hub.recv(timeout=0.1)
            if m is not None:
                got.append(m)
        assert got == [("decode-0", P.Abort("r", "hello"))]  # only the member's message arrived
        assert hub.events.counts().get(SecurityEvent.CONTROL_HANDSHAKE_FAILED.value, 0) >= 2
        hub.send("decode-0", P.Abort("r", "back"))
        hub.recv(timeout=0.2)  # the hub's receiving thread flushes what others queued
        assert member.recv(timeout=5) == P.Abort("r", "back")
    finally:
        for ch in (*strangers, member):
            ch.close()
        hub.close()


def test_a_worker_send_that_the_link_cannot_take_raises_instead_of_waiting_forever() -> None:
    # A listener that never speaks ZMTP: the link never comes up, so messages queue until the DEALER's queue
    # is full, and the next send has nowhere to go.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    ch = P.ZmqChannel(f"tcp://127.0.0.1:{silent.getsockname()[1]}", "prefill-0", None, send_timeout_s=0.2)
    try:
        with pytest.raises(P.ControlLinkDown, match="took no message for 0.2s"):
            for _ in range(100_000):
                ch.send(P.Abort("r", "x"))
    finally:
        ch.close()
        silent.close()


def test_stopping_a_monitor_flooded_with_refused_handshakes_does_not_freeze_the_process() -> None:
    # More refused handshakes queue up than libzmq's default monitor pipe holds; stopping the monitor then froze
    # the process with the GIL held (CI hung 11 minutes in the test above). The helper runs in its own process so
    # that a freeze shows as a timeout here instead of freezing pytest.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.monitor_flood", "4"], capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr[-2000:]
    drained = int(out.stdout.split()[-1])
    assert drained > 2_000, f"only {drained} events queued: the flood did not exceed the old pipe's 2,000"


class _UnansweredWorker:
    """What `register` needs of a worker; its registration is never answered in these tests."""

    role = "prefill"

    def attach(self, send: object) -> None:
        pass

    def registration(self) -> P.Message:
        return P.Shutdown()


def test_a_worker_told_to_stop_while_no_router_answers_stops_instead_of_waiting_out_the_timeout() -> None:
    from kvfence.disagg.worker import register

    hub = P.ZmqHub("127.0.0.1", 0)  # never pumped: the registration is never answered
    channel = P.ZmqChannel(hub.address, "prefill-0", None)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()  # SIGTERM's handler sets this event
    try:
        t0 = time.monotonic()
        assert register(_UnansweredWorker(), channel, timeout=120, stop=stop) is False  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 5
    finally:
        channel.close()
        hub.close()


def test_a_worker_with_another_key_is_told_so_at_registration_not_left_waiting() -> None:
    from kvfence.disagg.worker import register
    from kvfence.errors import CapacityConfigError

    hub = P.ZmqHub("127.0.0.1", 0, curve=CurveKeys.from_cluster_key(ClusterKey.generate()))
    channel = P.ZmqChannel(hub.address, "prefill-0", CurveKeys.from_cluster_key(ClusterKey.generate()))
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [hub.recv(timeout=0.1) for _ in iter(stop.is_set, True)], daemon=True)
    pump.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(CapacityConfigError, match="another cluster key"):
            register(_UnansweredWorker(), channel, timeout=60)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 30
    finally:
        stop.set()
        pump.join()
        channel.close()
        hub.close()


def test_a_worker_send_that_the_link_cannot_take_gives_up_when_the_worker_stops() -> None:
    """SIGTERM (the stop event) during a send the link has no room for: the message is dropped within a poll
    slice, not after the whole send timeout, so the worker's loop sees the stop and exits."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    stop = threading.Event()
    ch = P.ZmqChannel(f"tcp://127.0.0.1:{silent.getsockname()[1]}", "prefill-0", None, send_timeout_s=30, stop=stop)
    try:
        sent = 0
        t0 = time.monotonic()
        timer = threading.Timer(0.5, stop.set)
        timer.start()
        while not stop.is_set():  # the queue fills, then a send waits until the stop
            ch.send(P.Abort("r", "x"))
            sent += 1
        waited = time.monotonic() - t0
        timer.join()
        assert sent > 100 and waited < 2.0, (sent, waited)
        t0 = time.monotonic()
        ch.send(P.Abort("r", "after the stop"))  # still no room: dropped at once
        assert time.monotonic() - t0 < 0.5
    finally:
        ch.close()
        silent.close()
