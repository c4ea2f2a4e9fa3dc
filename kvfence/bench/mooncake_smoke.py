"""Mooncake TCP smoke test and throughput check between two processes on this machine.

Starts a receiver process that registers a buffer with its own MooncakeEndpoint and also listens on a plain TCP
socket; this process writes the same bytes into it (a) over a raw socket (the baseline) and (b) through
MooncakeEndpoint.write_pages with pieces of several sizes, laid out so that they cannot be merged, and once with
16 KiB pieces that are adjacent, so write_pages merges them. Every Mooncake result is checked by a SHA-256 of the
receiver's buffer against the expected bytes.

    python -m kvfence.bench.mooncake_smoke [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import time

import torch

from kvfence.transfer.mooncake_engine import MooncakeEndpoint, Peer, Region, mooncake_available, mooncake_version

RECEIVER = r"""
import hashlib, json, socket, sys, threading
import torch
from kvfence.transfer.mooncake_engine import MooncakeEndpoint

n = int(sys.argv[1])
buf = torch.zeros(n, dtype=torch.uint8)
ep = MooncakeEndpoint("127.0.0.1")
region = ep.register(buf)
srv = socket.create_server(("127.0.0.1", 0))

def serve():
    view = memoryview(buf.numpy()).cast("B")
    while True:
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < n:
                k = conn.recv_into(view[got:], n - got)
                if k == 0:
                    break
                got += k
            conn.sendall(b"ok")

threading.Thread(target=serve, daemon=True).start()
print(json.dumps({"session": ep.session_id, "addr": region.addr, "nbytes": region.nbytes,
                  "tcp_port": srv.getsockname()[1]}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "sha":
        print(hashlib.sha256(buf.numpy().tobytes()).hexdigest(), flush=True)
    elif cmd == "zero":
        buf.zero_()
        print("ok", flush=True)
    elif cmd == "quit":
        break
ep.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per run, in MiB")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    args = ap.parse_args()

    ok, reason = mooncake_available()
    if not ok:
        print(f"Mooncake unavailable: {reason}")
        return 2
    nbytes = args.mib << 20
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def ask(cmd: str) -> str:
        child.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return child.stdout.readline().strip()  # type: ignore[union-attr]

    hello = json.loads(child.stdout.readline())  # type: ignore[union-attr]
    peer = Peer(hello["session"], (Region(hello["addr"], hello["nbytes"]),))
    dst = hello["addr"]

    torch.manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    src_bytes = src.numpy().tobytes()
    ep = MooncakeEndpoint("127.0.0.1")
    ep.register(src)
    print(f"{mooncake_version()}, {nbytes >> 20} MiB per run, best of {args.repeat}, {torch.get_num_threads()} threads")

    def raw_tcp() -> float:
        """Baseline: one raw TCP stream over loopback, same bytes, same receiving buffer."""
        t = time.perf_counter()
        with socket.create_connection(("127.0.0.1", hello["tcp_port"])) as s:
            s.sendall(src.numpy().data.cast("B"))
            assert s.recv(2) == b"ok"
        return time.perf_counter() - t

    # (label, piece bytes, adjacent): unmergeable pieces go to slot n-1-i, so no two are back to back on both sides
    cases = [("mooncake, one entry", nbytes, True)]
    cases += [(f"mooncake, {p >> 10} KiB pieces", p, False) for p in (4 << 20, 1 << 20, 256 << 10, 64 << 10, 16 << 10)]
    cases += [("mooncake, 16 KiB pieces, adjacent", 16 << 10, True)]

    def plan(piece: int, adjacent: bool) -> tuple[list[tuple[int, int, int]], bytes]:
        n = nbytes // piece
        if adjacent:
            return [(src.data_ptr() + i * piece, dst + i * piece, piece) for i in range(n)], src_bytes
        ranges = [(src.data_ptr() + i * piece, dst + (n - 1 - i) * piece, piece) for i in range(n)]
        return ranges, b"".join(src_bytes[i * piece : (i + 1) * piece] for i in reversed(range(n)))

    plans = {label: plan(piece, adjacent) for label, piece, adjacent in cases}
    digests = {label: hashlib.sha256(expected).hexdigest() for label, (_, expected) in plans.items()}
    best: dict[str, float] = {}
    shape: dict[str, tuple[int, int]] = {}
    for _ in range(args.repeat):  # rounds outside, cases inside: load from other processes hits every case alike
        assert ask("zero") == "ok"
        best["raw"] = min(best.get("raw", float("inf")), raw_tcp())
        assert ask("sha") == digests[cases[0][0]], "raw TCP baseline bytes differ"
        for label, _, _ in cases:
            assert ask("zero") == "ok"
            result = ep.write_pages(peer, plans[label][0])
            assert ask("sha") == digests[label], f"{label}: bytes differ"
            best[label] = min(best.get(label, float("inf")), result.seconds)
            shape[label] = (result.entries, result.batches)

    raw_gbps = nbytes / best["raw"] / 1e9
    print(f"{'case':<36}{'entries':>9}{'batches':>9}{'GB/s':>8}{'vs raw TCP':>12}")
    print(f"{'raw TCP socket (baseline)':<36}{'-':>9}{'-':>9}{raw_gbps:>8.2f}{1.0:>12.2f}")
    for label, _, _ in cases:
        gbps = nbytes / best[label] / 1e9
        entries, batches = shape[label]
        print(f"{label:<36}{entries:>9}{batches:>9}{gbps:>8.2f}{gbps / raw_gbps:>12.2f}")

    ask("quit")
    child.wait(timeout=30)
    ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
