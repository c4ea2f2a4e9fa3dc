"""Benchmark the KV handoff: our TCP transport vs a raw socket copy, and what verification costs.

What it knows: how to build a prefill and a decode pool of a given layout, fill the
source with random KV, and time, in the same run and over the same bytes:
  - raw:      one `sendall` of the pages' bytes (already contiguous) into one `recv_into`
              a preallocated buffer, over loopback, sender and receiver in two threads:
              the best a socket can do, with no framing, page mapping or bookkeeping;
  - kvfence:  `TcpSender` -> `TcpReceiver`: manifest frame, chunked page frames straight
              from the pool's views into the destination pages' views, chunk acks,
              coverage bitmap; timed from `send()` to the slot being complete;
  - manifest: per-page xxh3_64 digests + canaries on the prefill side;
  - verify:   `verify_handoff` on the decode side (digests recomputed + canaries);
and print a table with GB/s and ratios. Every repeat takes the median of `repeats`.

What it does not know: the network between real hosts; these are loopback numbers on
the machine it runs on, and the ratio to the raw copy is the figure that carries over.

Run: python -m kvfence.bench.handoff   (the CLI registers it as `kvfence bench handoff`)
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from typing import Any

import torch

from kvfence.integrity.digest import PageBytes, page_digests, token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout, dtype_from_name
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SlotStatus, TransferConfig
from kvfence.transfer.tcp import TcpReceiver, TcpSender


def _raw_copy_seconds(payload: memoryview, sink: memoryview) -> float:
    """One loopback TCP copy of `payload` into `sink` (sender thread -> receiver thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            got = 0
            while got < len(sink):
                k = conn.recv_into(sink[got:], len(sink) - got)
                if k == 0:
                    break
                got += k
        done.set()

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(payload)
        done.wait()
        elapsed = time.perf_counter() - t0
    t.join()
    listener.close()
    return elapsed


def run_handoff_bench(
    num_layers: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    dtype: str = "bfloat16",
    num_pages: int = 256,
    max_transfer_pages: int = 64,
    max_inflight_mb: int = 64,
    repeats: int = 5,
    verbose: bool = True,
) -> dict[str, Any]:
    """Time raw copy, kvfence TCP transfer, manifest and verification; returns the medians and ratios."""
    layout = KVLayout(
        "LlamaForCausalLM",
        num_layers,
        (KVBufferSpec("k", (num_kv_heads, head_dim)), KVBufferSpec("v", (num_kv_heads, head_dim))),
        page_size,
        dtype_from_name(dtype),
    )
    src, dst = KVPool(layout, num_pages), KVPool(layout, num_pages)
    g = torch.Generator().manual_seed(0)
    for layer in src.tensors:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    for layer in dst.tensors:
        for t in layer.values():
            t.fill_(1.0)  # touch every page so first-write page faults are not timed
    total = num_pages * layout.bytes_per_page
    pages = list(range(num_pages))
    dest = pages[::-1]  # a non-trivial page table
    ids = list(range(num_pages * page_size))
    expect_hash = token_hash(ids)

    contiguous = bytearray(b"".join(b for p in pages for b in PageBytes(src).views(p)))
    sink = bytearray(total)
    cfg = TransferConfig(max_transfer_pages=max_transfer_pages, max_inflight_bytes=max_inflight_mb << 20)
    receiver, sender = TcpReceiver(dst), TcpSender(src, cfg)

    raw_s, tcp_s, digest_s, manifest_s, verify_s = [], [], [], [], []
    try:
        for r in range(repeats):
            raw_s.append(_raw_copy_seconds(memoryview(contiguous), memoryview(sink)))

            t0 = time.perf_counter()
            page_digests(src, pages)
            digest_s.append(time.perf_counter() - t0)

            rid = f"bench-{r}"
            t0 = time.perf_counter()
            m = build_manifest(rid, f"x{r}", ids, src, pages)
            manifest_s.append(time.perf_counter() - t0)

            slot = receiver.expect(rid, dest)
            t0 = time.perf_counter()
            handle = sender.send(receiver.address, m, pages)
            while slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                time.sleep(0.0001)
            tcp_s.append(time.perf_counter() - t0)
            assert slot.status == SlotStatus.COMPLETE, (slot.status, slot.error)

            t0 = time.perf_counter()
            res = verify_handoff(m, Expectation(rid, len(ids), expect_hash), layout, dest, slot.coverage, dst)
            verify_s.append(time.perf_counter() - t0)
            assert res.ok, res
            receiver.verdict(rid, True)
            handle.wait(10)
            receiver.forget(rid)
        assert bytes(sink) == bytes(contiguous), "raw copy corrupted bytes"
    finally:
        sender.close()
        receiver.close()

    med = {k: statistics.median(v) for k, v in
           dict(raw=raw_s, tcp=tcp_s, digest=digest_s, manifest=manifest_s, verify=verify_s).items()}  # fmt: skip
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    result = {
        "layout": layout.describe(),
        "num_pages": num_pages,
        "bytes_per_page": layout.bytes_per_page,
        "total_bytes": total,
        "repeats": repeats,
        "seconds": med,
        "gb_per_s": gbps,
        "tcp_vs_raw": gbps["tcp"] / gbps["raw"],
        "verify_vs_transfer": med["verify"] / med["tcp"],
        "manifest_vs_transfer": med["manifest"] / med["tcp"],
        "handoff_total_vs_raw": (med["manifest"] + med["tcp"] + med["verify"]) / med["raw"],
    }
    if verbose:
        print(format_table(result))
    return result


def format_table(r: dict[str, Any]) -> str:
    lay = r["layout"]
    head = (
        f"KV handoff bench: {lay['architecture']} layout, {lay['num_layers']} layers x "
        f"{[b['name'] for b in lay['buffers']]} {lay['buffers'][0]['token_shape']} {lay['dtype']}, "
        f"page {lay['page_size']} tokens = {r['bytes_per_page'] / 1024:.0f} KiB, {r['num_pages']} pages = "
        f"{r['total_bytes'] / 2**20:.0f} MiB; median of {r['repeats']}"
    )
    rows = [
        ("raw socket copy (baseline)", "raw", "1.00"),
        ("kvfence TCP transfer", "tcp", f"{r['tcp_vs_raw']:.2f} x raw throughput"),
        ("digests only (prefill)", "digest", ""),
        ("manifest: digests+canaries", "manifest", f"{r['manifest_vs_transfer']:.2f} x transfer time"),
        ("verify on decode", "verify", f"{r['verify_vs_transfer']:.2f} x transfer time"),
    ]
    lines = [head, f"{'step':<30}{'ms':>10}{'GB/s':>10}  ratio", "-" * 78]
    for name, key, ratio in rows:
        lines.append(f"{name:<30}{r['seconds'][key] * 1e3:>10.1f}{r['gb_per_s'][key]:>10.2f}  {ratio}")
    lines.append(f"whole handoff (manifest + transfer + verify) = {r['handoff_total_vs_raw']:.2f} x raw copy time")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--max-transfer-pages", type=int, default=64)
    p.add_argument("--max-inflight-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)


def _run(args: argparse.Namespace) -> int:
    run_handoff_bench(
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=args.dtype,
        num_pages=args.num_pages,
        max_transfer_pages=args.max_transfer_pages,
        max_inflight_mb=args.max_inflight_mb,
        repeats=args.repeats,
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `handoff` to the `kvfence bench` subcommands."""
    p = subparsers.add_parser(
        "handoff",
        help="KV handoff throughput (kvfence TCP vs raw socket) and verification cost",
        description="Time a raw loopback socket copy, the kvfence TCP transport, manifest building and "
        "decode-side verification over the same KV pages, and print GB/s with ratios.",
    )
    add_arguments(p)
    p.set_defaults(func=_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvfence.bench.handoff")
    add_arguments(parser)
    raise SystemExit(_run(parser.parse_args()))
