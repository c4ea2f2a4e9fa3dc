"""Benchmark the KV handoff: our TCP transport vs a raw socket copy, and what verification costs.

What it knows: how to build a prefill and a decode pool of a given layout, fill the
source with random KV, and time, in the same run and over the same bytes, with the
sender (prefill) in a child process and the receiver (decode) in this one (or both on
threads of this process with --threads):
  - raw:      one `sendall` of the pages' bytes (already contiguous) into `recv_into` a
              preallocated buffer over loopback: the best a socket does, with no framing,
              page mapping or bookkeeping;
  - kvfence:  `TcpSender` -> `TcpReceiver`: manifest frame, chunked page frames straight
              from the pool's views into the destination pages' views, chunk acks,
              coverage bitmap; timed from the send command to the slot being complete;
  - manifest: per-page digests + canaries on the prefill side, with the pool's algorithm (xxh3_64 for a
              CPU pool, mlh62 for a device pool); the digests alone too, with each algorithm;
  - verify:   `verify_handoff` on the decode side (digests recomputed + canaries), with each algorithm;
and print a table with GB/s and ratios; each figure is the median of `repeats` runs. At
the end the destination pages must hold exactly the bytes the raw copy delivered.

With `--device cuda` both pools live on the GPU: the transfer goes through pinned host staging
(`transfer.staging`), digests and canaries are computed on the device, and the raw copy's
bytes are read from the GPU once before timing (it stays a host-to-host socket copy).
`--device-paths` runs those device paths on CPU pools.

What it does not know: the network between real hosts; these are loopback numbers on
the machine it runs on, and the ratio to the raw copy is the figure that carries over.

Run: python -m kvfence.bench.handoff   (the CLI registers it as `kvfence bench handoff`)
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import socket
import statistics
import threading
import time
from typing import Any

import torch

from kvfence.auth.keys import ClusterKey
from kvfence.auth.plane import PlaneAuth
from kvfence.errors import KvfenceError
from kvfence.integrity.algorithms import MLH_ALGORITHM
from kvfence.integrity.digest import DIGEST_ALGORITHM, page_digests, token_hash
from kvfence.integrity.manifest import HandoffManifest, build_manifest
from kvfence.integrity.verify import Expectation, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout, dtype_from_name
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SendHandle, SlotStatus, TransferConfig, new_transfer_id
from kvfence.transfer.tcp import TcpReceiver, TcpSender


def _make_layout(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str) -> KVLayout:
    return KVLayout(
        "LlamaForCausalLM",
        num_layers,
        (KVBufferSpec("k", (num_kv_heads, head_dim)), KVBufferSpec("v", (num_kv_heads, head_dim))),
        page_size,
        dtype_from_name(dtype),
    )


def _pool(layout: KVLayout, num_pages: int, device: str, device_paths: bool) -> KVPool:
    """A pool on `device`; `device_paths`: a CPU pool that integrity and transfer code treat as device memory."""
    return KVPool(layout, num_pages, device=device, host_visible=False if device_paths else None)


def _source_pool(layout: KVLayout, num_pages: int, device: str = "cpu", device_paths: bool = False) -> KVPool:
    src = _pool(layout, num_pages, device, device_paths)
    g = torch.Generator().manual_seed(0)
    for layer in src.tensors:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return src


ALGORITHMS = (DIGEST_ALGORITHM, MLH_ALGORITHM)


class _Prefill:
    """The sending side, in this process: raw copy, manifest, kvfence send."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        cfg: TransferConfig,
        key_hex: str,
        device: str = "cpu",
        device_paths: bool = False,
    ) -> None:
        self.src = _source_pool(layout, num_pages, device, device_paths)
        self.pages = list(range(num_pages))
        self.ids = list(range(num_pages * layout.page_size))
        self.contiguous = bytearray(b"".join(self.src.read_page(p) for p in self.pages))  # host bytes, once
        self.sender = TcpSender(self.src, cfg, auth=PlaneAuth(ClusterKey.from_hex(key_hex, "bench")))
        self.manifest: HandoffManifest | None = None
        self.handle: SendHandle | None = None

    def raw(self, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(self.contiguous)

    def manifest_for(self, rid: str, xid: str) -> tuple[bytes, dict[str, float], float]:
        """Build the manifest; returns (its bytes, digest-only seconds per algorithm, manifest seconds)."""
        digest_s = {}
        for algorithm in ALGORITHMS:  # the same pages, one algorithm after the other
            t0 = time.perf_counter()
            page_digests(self.src, self.pages, algorithm)
            digest_s[algorithm] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.manifest = build_manifest(rid, xid, self.ids, self.src, self.pages)
        return self.manifest.to_bytes(), digest_s, time.perf_counter() - t0

    def send(self, address: str) -> None:
        assert self.manifest is not None
        self.handle = self.sender.send(address, self.manifest, self.pages)

    def wait(self) -> str:
        assert self.handle is not None
        self.handle.wait(30)
        return self.handle.status.value

    def close(self) -> None:
        self.sender.close()


def _prefill_process(conn: Any, args: tuple) -> None:
    """Child process: a `_Prefill` driven by (verb, *args) commands on a pipe."""
    layout_desc, num_pages, cfg, key_hex, device, device_paths = args
    prefill = _Prefill(KVLayout.from_description(layout_desc), num_pages, cfg, key_hex, device, device_paths)
    conn.send("ready")
    while True:
        verb, *rest = conn.recv()
        if verb == "quit":
            prefill.close()
            conn.send("bye")
            return
        conn.send(getattr(prefill, verb)(*rest))


class _ChildPrefill:
    """The same verbs as `_Prefill`, run in a child process (no GIL shared with the receiver)."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        cfg: TransferConfig,
        key_hex: str,
        device: str = "cpu",
        device_paths: bool = False,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        desc = (layout.describe(), num_pages, cfg, key_hex, device, device_paths)
        self.proc = ctx.Process(target=_prefill_process, args=(child, desc))
        self.proc.start()
        assert self.conn.recv() == "ready"

    def __getattr__(self, verb: str) -> Any:
        def call(*args: Any) -> Any:
            self.conn.send((verb, *args))
            return self.conn.recv() if verb not in ("raw", "send") else None

        return call

    def done(self) -> Any:  # the reply of the last raw/send
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("quit",))
        self.conn.recv()
        self.proc.join(10)


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
    processes: bool = True,
    verbose: bool = True,
    device: str = "cpu",
    device_paths: bool = False,
) -> dict[str, Any]:
    """Time raw copy, kvfence TCP transfer, manifest and verification; returns the medians and ratios.

    processes=True: the sender (prefill) runs in a child process, the receiver (decode) here;
    processes=False: both in this process, on threads (they then share the GIL).
    device: where both pools live; device_paths: CPU pools that take the device paths (staging, mlh62).
    """
    layout = _make_layout(num_layers, num_kv_heads, head_dim, page_size, dtype)
    cfg = TransferConfig(max_transfer_pages=max_transfer_pages, max_inflight_bytes=max_inflight_mb << 20)
    dst = _pool(layout, num_pages, device, device_paths)
    for layer in dst.tensors:
        for t in layer.values():
            t.fill_(1.0)  # touch every page so first-write page faults are not timed
    total = num_pages * layout.bytes_per_page
    dest = list(range(num_pages))[::-1]  # a non-trivial page table
    expect_hash = token_hash(list(range(num_pages * page_size)))
    sink = bytearray(total)
    key = ClusterKey.generate()  # the pair authenticates as a deployment does (handshake, frame MACs, sealed manifest)
    prefill: Any = (_ChildPrefill if processes else _Prefill)(
        layout, num_pages, cfg, key.to_hex(), device, device_paths
    )
    receiver = TcpReceiver(dst, auth=PlaneAuth(key))
    listener = socket.create_server(("127.0.0.1", 0))

    raw_s: list[float] = []
    tcp_s: list[float] = []
    manifest_s: list[float] = []
    digest_s: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
    verify_s: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
    algorithm = ""
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            if processes:
                prefill.raw(listener.getsockname()[1])
            else:
                threading.Thread(target=prefill.raw, args=(listener.getsockname()[1],), daemon=True).start()
            conn, _ = listener.accept()
            with conn:
                view, got = memoryview(sink), 0
                while got < total:
                    k = conn.recv_into(view[got:], total - got)
                    assert k > 0, "raw sender closed early"
                    got += k
            raw_s.append(time.perf_counter() - t0)
            if processes:
                prefill.done()

            rid = f"bench-{r}"
            xid = new_transfer_id()
            mbytes, d_s, m_s = prefill.manifest_for(rid, xid)
            for a in ALGORITHMS:
                digest_s[a].append(d_s[a])
            manifest_s.append(m_s)
            m = HandoffManifest.from_bytes(mbytes)
            algorithm = m.digest_algorithm
            slot = receiver.expect(rid, dest, xid)
            t0 = time.perf_counter()
            prefill.send(receiver.address)
            while slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                time.sleep(0.0005)
            tcp_s.append(time.perf_counter() - t0)
            assert slot.status == SlotStatus.COMPLETE, (slot.status, slot.error)
            if processes:
                prefill.done()

            expect = Expectation(rid, m.num_tokens, expect_hash, xid)
            for a in sorted(ALGORITHMS, key=lambda a: a != algorithm):  # the manifest's algorithm first
                ma = m
                if a != algorithm:  # the same manifest with the other algorithm's digests (of the landed pages)
                    ma = dataclasses.replace(m, digest_algorithm=a, page_digests=tuple(page_digests(dst, dest, a)))
                t0 = time.perf_counter()
                res = verify_handoff(ma, expect, layout, dest, slot.coverage, dst)
                verify_s[a].append(time.perf_counter() - t0)
                assert res.ok, res
            receiver.verdict(rid, True)
            assert prefill.wait() == "verified"
            receiver.forget(rid)
        landed = b"".join(dst.read_page(p) for p in dest)
        assert landed == bytes(sink), "kvfence and the raw copy did not deliver the same bytes"
    finally:
        prefill.close()
        receiver.close()
        listener.close()

    med = {
        "raw": statistics.median(raw_s),
        "tcp": statistics.median(tcp_s),
        "manifest": statistics.median(manifest_s),
        "digest": statistics.median(digest_s[algorithm]),
        "verify": statistics.median(verify_s[algorithm]),
        **{f"digest_{a}": statistics.median(v) for a, v in digest_s.items()},
        **{f"verify_{a}": statistics.median(v) for a, v in verify_s.items()},
    }
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    result = {
        "mode": "two processes" if processes else "two threads",
        "device": device + (" (device paths)" if device_paths else ""),
        "digest_algorithm": algorithm,
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
        "mlh_vs_xxh3_digest": med[f"digest_{MLH_ALGORITHM}"] / med[f"digest_{DIGEST_ALGORITHM}"],
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
        f"{r['total_bytes'] / 2**20:.0f} MiB; pools on {r.get('device', 'cpu')}; sender and receiver in "
        f"{r['mode']}; median of {r['repeats']}"
    )
    algo = r.get("digest_algorithm", DIGEST_ALGORITHM)
    rows = [
        ("raw socket copy (baseline)", "raw", "1.00"),
        ("kvfence TCP transfer", "tcp", f"{r['tcp_vs_raw']:.2f} x raw throughput"),
        *[(f"digests only, {a} (prefill)", f"digest_{a}", "") for a in ALGORITHMS if f"digest_{a}" in r["seconds"]],
        (f"manifest ({algo}): digests+canaries", "manifest", f"{r['manifest_vs_transfer']:.2f} x transfer time"),
        *[
            (
                f"verify on decode, {a}",
                f"verify_{a}",
                f"{r['seconds'][f'verify_{a}'] / r['seconds']['tcp']:.2f} x transfer time",
            )
            for a in ALGORITHMS
            if f"verify_{a}" in r["seconds"]
        ],
    ]
    lines = [head, f"{'step':<36}{'ms':>10}{'GB/s':>10}  ratio", "-" * 84]
    for name, key, ratio in rows:
        lines.append(f"{name:<36}{r['seconds'][key] * 1e3:>10.1f}{r['gb_per_s'][key]:>10.2f}  {ratio}")
    if "mlh_vs_xxh3_digest" in r:
        lines.append(f"digest time, mlh62 / xxh3_64 = {r['mlh_vs_xxh3_digest']:.2f}")
    lines.append(
        f"whole handoff (manifest + transfer + verify, {algo}) = {r['handoff_total_vs_raw']:.2f} x raw copy time"
    )
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
    p.add_argument("--threads", action="store_true", help="run sender and receiver as threads of one process")
    p.add_argument("--device", default="cpu", help="torch device of both KV pools (e.g. cuda; default cpu)")
    p.add_argument(
        "--device-paths",
        action="store_true",
        help="treat CPU pools as device memory: host staging for the transfer, mlh62 digests in the manifest",
    )
    p.add_argument(
        "--e2e-rounds",
        type=int,
        default=0,
        metavar="N",
        help="also run N alternating rounds of end-to-end serving with verification on and off on real "
        "router/prefill/decode processes (kvfence.bench.handoff_e2e; default 0: skip)",
    )
    p.add_argument("--e2e-model", default=None, metavar="DIR", help="model for --e2e-rounds (default: built-in)")


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, in one line (KvfenceError: exit 2)."""
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise KvfenceError(f"--device {device!r} is not a torch device: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise KvfenceError(f"--device {device}: no CUDA device is available here (torch {torch.__version__})")


def _run(args: argparse.Namespace) -> int:
    check_device(args.device)
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
        processes=not args.threads,
        device=args.device,
        device_paths=args.device_paths,
    )
    if args.e2e_rounds > 0:
        from kvfence.bench import handoff_e2e

        return handoff_e2e.main(
            ["--rounds", str(args.e2e_rounds), *(["--model", args.e2e_model] if args.e2e_model else [])]
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
