"""Benchmark `kvfence audit logs` on a large synthetic SGLang PD log pair.

What it knows: how to write a realistic prefill and decode log (DP/TP rank prefixes, millisecond
timestamps, Prefill/Decode batch lines, request time-stats lines, uvicorn access lines, and rare
too-long / transfer-failure / checksum lines) of a requested size quickly, and how to time the
scanner against two baselines on the same files in the same run: `wc -l` and a plain Python
`for line in file` loop. What it does not know: real traffic mixes; the ratio is what matters.

Run: python -m kvfence.bench.logscan --size-mb 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from kvfence.audit.logs import iter_lines_baseline, scan_logs

_MINUTE = "2026-03-02 10:00"


def _prefill_minute_block() -> bytes:
    lines = []
    for s in range(60):
        for k in range(40):
            ts = f"{_MINUTE}:{s:02d}.{(k * 25) % 1000:03d}"
            dp = k % 8
            lines.append(
                f"[{ts} DP{dp} TP{dp} EP{dp}] Prefill batch, #new-seq: {1 + k % 3}, #new-token: {512 + 37 * k}, "
                f"#cached-token: {64 * (k % 5)}, token usage: 0.{(k * 7) % 100:02d}, #running-req: {k % 4}, "
                f"#queue-req: {k % 3}, #pending-token: 0, #bootstrap-req: {k % 2}, #inflight-req: {k % 3}, "
                f"cuda graph: False, input throughput (token/s): {9000 + 13 * k}.{k % 100:02d}"
            )
            if k % 4 == 0:
                lines.append(
                    f"[{ts} DP{dp} TP{dp} EP{dp}] Req Time Stats(rid=RIDBLOCK{s:02d}{k:02d}p, "
                    f"bootstrap_room=BLOCKROOM{s:02d}{k:02d}, input len={512 + 37 * k}, output len=1, type=prefill): "
                    "bootstrap_duration=3.12ms, queue_duration=0.41ms, forward_duration=91.02ms"
                )
            if k % 10 == 0:
                lines.append(f'[{ts}] INFO:     10.0.0.5:{40000 + k} - "POST /generate HTTP/1.1" 200 OK')
        if s == 17:
            lines.append(
                f"[{_MINUTE}:{s:02d}.500 DP0 TP0 EP0] Input length (140000 tokens) exceeds the maximum allowed "
                "length (98298 tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='RIDBLOCKlong'"
            )
        if s == 41:
            lines.append(
                f"[{_MINUTE}:{s:02d}.900 DP3 TP3 EP3] Prefill transfer failed for request rank=3 "
                "req.rid='RIDBLOCKfail' req.bootstrap_room=BLOCKROOM9999 with exception "
                "KVTransferError(bootstrap_room=BLOCKROOM9999): Decode instance could be dead"
            )
    return ("\n".join(lines) + "\n").encode()


def _decode_minute_block() -> bytes:
    lines = []
    for s in range(60):
        for k in range(40):
            ts = f"{_MINUTE}:{s:02d}.{(k * 25) % 1000:03d}"
            dp = k % 8
            lines.append(
                f"[{ts} DP{dp} TP{dp} EP{dp}] Decode batch, #running-req: {20 + k}, #token: {52000 + 911 * k}, "
                f"token usage: 0.{(k * 3) % 100:02d}, pre-allocated usage: 0.0{k % 10}, #prealloc-req: {k % 3}, "
                f"#transfer-req: {k % 5}, #retracted-req: 0, cuda graph: True, "
                f"gen throughput (token/s): {1100 + k}.{k % 100:02d}, #queue-req: 0"
            )
            if k % 4 == 0:
                lines.append(
                    f"[{ts} DP{dp} TP{dp} EP{dp}] Req Time Stats(rid=RIDBLOCK{s:02d}{k:02d}d, "
                    f"bootstrap_room=BLOCKROOM{s:02d}{k:02d}, input len={512 + 37 * k}, output len=64, type=decode): "
                    "bootstrap_duration=3.40ms, alloc_wait_duration=0.12ms, transfer_duration=18.77ms"
                )
        if s == 41:
            lines.append(
                f"[{_MINUTE}:{s:02d}.950 DP3 TP3 EP3] Decode transfer failed for request rank=3 "
                "decode_req.req.rid='RIDBLOCKdfail' decode_req.req.bootstrap_room=BLOCKROOM9999 with exception "
                "KVTransferError(bootstrap_room=BLOCKROOM9999): Failed to get kvcache from prefill instance"
            )
    return ("\n".join(lines) + "\n").encode()


def _header(mode: str) -> bytes:
    return (
        f"[2026-03-02 09:58:01] server_args=ServerArgs(model_path='/models/DeepSeek-V3-0324', "
        f"context_length=131072, page_size=64, tp_size=8, allow_auto_truncate=False, disaggregation_mode='{mode}', "
        "disaggregation_transfer_backend='mooncake', disaggregation_enable_kv_checksum=True, kv_canary='none')\n"
        "[2026-03-02 09:59:52 DP0 TP0 EP0] max_total_num_tokens=98304, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=2048, context_len=131072, available_gpu_mem=9.87 GB\n"
    ).encode()


def write_log(path: str, mode: str, target_bytes: int) -> int:
    """Write a synthetic log of about target_bytes; each minute reuses a template with a new timestamp."""
    block = _prefill_minute_block() if mode == "prefill" else _decode_minute_block()
    template = _MINUTE.encode()
    written = 0
    minute = 0
    with open(path, "wb", buffering=8 << 20) as f:
        written += f.write(_header(mode))
        while written < target_bytes:
            day, rem = divmod(minute, 24 * 60)
            stamp = f"2026-03-{2 + day % 27:02d} {rem // 60:02d}:{rem % 60:02d}".encode()
            tag = f"{minute:07d}".encode()
            data = block.replace(template, stamp).replace(b"BLOCKROOM", tag).replace(b"RIDBLOCK", b"r" + tag)
            written += f.write(data)
            minute += 1
    return written


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfence.bench.logscan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1024.0, help="total size of the prefill + decode logs")
    ap.add_argument("--dir", default=None, help="where to write the logs (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")
    args = ap.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="kvfence-logscan-")
    os.makedirs(work, exist_ok=True)
    p_path, d_path = os.path.join(work, "prefill.log"), os.path.join(work, "decode.log")
    half = int(args.size_mb * 1e6 / 2)
    try:
        t_gen, _ = _timed(lambda: (write_log(p_path, "prefill", half), write_log(d_path, "decode", half)))
        total = os.path.getsize(p_path) + os.path.getsize(d_path)
        print(f"generated {total / 1e9:.3f} GB in {t_gen:.1f} s under {work}")
        # Warm the page cache for everyone alike.
        for p in (p_path, d_path):
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        results = []
        if shutil.which("wc"):
            t_wc, _ = _timed(lambda: subprocess.run(["wc", "-l", p_path, d_path], check=True, capture_output=True))
            results.append(("wc -l", t_wc))

        def py_lines() -> int:
            n = 0
            for p in (p_path, d_path):
                for _ in iter_lines_baseline(p):
                    n += 1
            return n

        t_lines, n_lines = _timed(py_lines)
        results.append(("python 'for line in f' (baseline)", t_lines))
        t_scan, report = _timed(lambda: scan_logs(p_path, d_path, window="hour"))
        results.append(("kvfence audit logs (scan_logs)", t_scan))
        print(f"{n_lines} lines; scanner matched {report.lines_matched} lines, {len(report.requests)} noted requests")
        print(f"{'method':40s} {'seconds':>8s} {'GB/s':>7s}")
        for name, t in results:
            print(f"{name:40s} {t:8.2f} {total / 1e9 / t:7.2f}")
        print(f"scan / python-line-iteration time ratio: {t_scan / t_lines:.2f}")
        if shutil.which("wc"):
            print(f"scan / wc -l time ratio: {t_scan / results[0][1]:.2f}")
        per_gb = t_scan / (total / 1e9)
        print(f"scan time per GB: {per_gb:.1f} s (target: under 60 s per GB on one core)")
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
