"""Benchmark `kvfence audit logs` on a large synthetic SGLang PD log pair (`kvfence bench logscan`).

What it knows: how to write a prefill and a decode log of a requested size quickly in the line formats
SGLang 0.5.23 writes (the templates of kvfence.audit.logs.FORMATS: DP/TP/EP rank prefixes, millisecond
timestamps, `Prefill batch` / `Decode batch` lines, `ReqTimeStats(...)` lines, uvicorn access lines, and rare
too-long / transfer-failure lines), and how to time the scanner against baselines on the same files in the
same run: `wc -l`, `grep -c ReqTimeStats`, a plain Python `for line in file` loop, and Python importing the
scanner without scanning (the memory floor). Every method runs in a child process of its own, in `--repeat`
interleaved rounds, and is measured from that child's own rusage: wall time, CPU time (the scanner is
single-threaded, so MB per CPU-second is its throughput per core, and stays meaningful on a shared machine where
wall time is inflated by other load) and peak resident memory (ru_maxrss), so the scanner's memory is shown next
to its throughput. What it does not know: real traffic mixes.

Run: kvfence bench logscan --size-mb 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

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
                f"#optimistic-req: 0, cuda graph: False, input throughput (token/s): {9000 + 13 * k}.{k % 100:02d}"
            )
            if k % 4 == 0:
                lines.append(
                    f"[{ts} DP{dp} TP{dp} EP{dp}] ReqTimeStats(rid=RIDBLOCK{s:02d}{k:02d}p, "
                    f"bootstrap_room=BLOCKROOM{s:02d}{k:02d}, input_len={512 + 37 * k}, cached_input_len=0, "
                    "output_len=1, attempts=1, type=prefill): bootstrap_duration=3.12ms, queue_duration=0.41ms, "
                    "forward_duration=91.02ms, entry_time=1772445605.112, transfer_speed=12.31 GB/s, "
                    "transfer_total=70.31 MB"
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
                    f"[{ts} DP{dp} TP{dp} EP{dp}] ReqTimeStats(rid=RIDBLOCK{s:02d}{k:02d}d, "
                    f"bootstrap_room=BLOCKROOM{s:02d}{k:02d}, input_len={512 + 37 * k}, cached_input_len=0, "
                    "output_len=64, attempts=1, type=decode): bootstrap_duration=3.40ms, alloc_wait_duration=0.12ms, "
                    "transfer_duration=18.77ms, queue_duration=0.20ms, forward_duration=2210.31ms, "
                    "entry_time=1772445606.201"
                )
        if s == 41:
            lines.append(
                f"[{_MINUTE}:{s:02d}.950 DP3 TP3 EP3] Decode transfer failed for request rank=3 "
                "decode_req.req.rid='RIDBLOCKdfail' decode_req.req.bootstrap_room=BLOCKROOM9999 with exception "
                "KVTransferError(bootstrap_room=BLOCKROOM9999): Failed to get kvcache from prefill instance"
            )
    return ("\n".join(lines) + "\n").encode()


def _header(mode: str) -> bytes:
    """A start-up pair; the server_args dict carries only the fields the scanner reads (real ones hold ~540)."""
    args = {
        "model_path": "/models/DeepSeek-V3-0324", "context_length": 131072, "page_size": 64, "tp_size": 8,
        "allow_auto_truncate": False, "disaggregation_mode": mode, "disaggregation_transfer_backend": "mooncake",
        "disaggregation_enable_kv_checksum": True, "kv_canary": "none", "enable_request_time_stats_logging": True,
    }  # fmt: skip
    return (
        f"[2026-03-02 09:58:01] server_args={args!r}\n"
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


# Runs argv[1:] as a child and prints that child's wall time, CPU time and peak RSS from its own rusage. The bench
# runs every method through this small launcher: a child's ru_maxrss starts from the memory of the process that
# spawned it (Linux carries the pre-exec high-water mark over exec), so it must be spawned by a small process, not
# by the bench, which holds the generator's memory. The launcher's own ~10 MiB are the floor of every method.
_LAUNCHER = (
    "import json, os, subprocess, sys, time\n"
    "t0 = time.perf_counter()\n"
    "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)\n"
    "out = p.stdout.read()\n"
    "_, status, ru = os.wait4(p.pid, 0)\n"
    "print(json.dumps({'wall': time.perf_counter() - t0, 'cpu': ru.ru_utime + ru.ru_stime,\n"
    "                  'maxrss': ru.ru_maxrss * 1024, 'rc': os.waitstatus_to_exitcode(status),\n"
    "                  'out': out.decode(errors='replace')}))\n"
)


def child_usage(argv: list[str]) -> tuple[float, float, int, str]:
    """(wall s, CPU s, peak RSS in bytes, stdout) of one command, measured from its own rusage by a small launcher."""
    r = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"launcher failed: {r.stderr[-500:]}")
    doc = json.loads(r.stdout)
    if doc["rc"] not in (0, 1, 2):  # grep -c exits 1 on no match; a crash is a crash
        raise RuntimeError(f"{argv[:3]} exited {doc['rc']}")
    return doc["wall"], doc["cpu"], doc["maxrss"], doc["out"]


_SCAN = (
    "import json, sys\n"
    "from kvfence.audit.logs import scan_logs\n"
    "r = scan_logs(sys.argv[1], sys.argv[2], window='hour')\n"
    "print(json.dumps({'lines': r.lines_matched, 'noted': len(r.requests) + sum(r.requests_not_listed.values()),\n"
    "                  'decoded': sum(r.coverage.values())}))\n"
)
_PY_LINES = "import sys\nprint(sum(1 for p in sys.argv[1:] for _ in open(p, 'rb', buffering=1 << 20)))\n"
_FLOOR = "import kvfence.audit.logs\n"  # the interpreter and the imports, no scan: what every scan starts from


def run(size_mb: float, repeat: int, work_dir: str | None, keep: bool) -> int:
    work = work_dir or tempfile.mkdtemp(prefix="kvfence-logscan-")
    os.makedirs(work, exist_ok=True)
    p_path, d_path = os.path.join(work, "prefill.log"), os.path.join(work, "decode.log")
    half = int(size_mb * 1e6 / 2)
    try:
        t0 = time.perf_counter()
        write_log(p_path, "prefill", half)
        write_log(d_path, "decode", half)
        total = os.path.getsize(p_path) + os.path.getsize(d_path)
        print(f"generated {total / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s under {work}")
        for p in (p_path, d_path):  # warm the page cache for everyone alike
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        py = sys.executable
        methods: list[tuple[str, list[str]]] = []
        if shutil.which("wc"):
            methods.append(("wc -l", ["wc", "-l", p_path, d_path]))
        if shutil.which("grep"):
            methods.append(("grep -c ReqTimeStats", ["grep", "-c", "ReqTimeStats", p_path, d_path]))
        methods.append(("python 'for line in f'", [py, "-c", _PY_LINES, p_path, d_path]))
        methods.append(("python + imports, no scan", [py, "-c", _FLOOR]))
        methods.append(("kvfence audit logs (scan_logs)", [py, "-c", _SCAN, p_path, d_path]))
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in methods}
        summary = ""
        for _ in range(repeat):  # interleaved rounds: every method once per round
            for name, argv in methods:
                wall, cpu, rss, out = child_usage(argv)
                results[name].append((wall, cpu, rss))
                if name.startswith("kvfence"):
                    summary = out.strip()
        print(f"scanner summary: {summary}")
        print(f"{'method':32s} {'wall s (min-max)':>18s} {'cpu s (min-max)':>17s} {'MB/s wall':>10s} {'MB/cpu-s':>9s}"
              f" {'peak RSS MiB':>13s}")  # fmt: skip
        mb = total / 1e6
        med: dict[str, tuple[float, float, float]] = {}
        for name, rows in results.items():
            walls, cpus, rsss = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
            w, c, m = statistics.median(walls), statistics.median(cpus), max(rsss) / 2**20
            med[name] = (w, c, m)
            print(f"{name:32s} {w:6.2f} ({min(walls):.2f}-{max(walls):.2f}) {c:6.2f} ({min(cpus):.2f}-{max(cpus):.2f})"
                  f" {mb / w:10.1f} {mb / max(c, 1e-9):9.1f} {m:13.1f}")  # fmt: skip
        scan_w, scan_c, scan_m = med["kvfence audit logs (scan_logs)"]
        for name in ("wc -l", "grep -c ReqTimeStats", "python 'for line in f'"):
            if name in med:
                print(f"scan / {name}: wall ratio {scan_w / med[name][0]:.1f}, "
                      f"cpu ratio {scan_c / max(med[name][1], 1e-9):.1f}")  # fmt: skip
        floor = med["python + imports, no scan"][2]
        print(
            f"scanner throughput per core: {mb / scan_c:.1f} MB per CPU-second (target >= 100); "
            f"{mb / scan_w:.1f} MB/s wall; peak RSS {scan_m:.1f} MiB ({scan_m - floor:.1f} MiB above the "
            f"{floor:.1f} MiB of the interpreter and imports) for {total / 2**30:.2f} GiB of logs; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
    finally:
        if not keep and work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--size-mb", type=float, default=1024.0, help="total size of the prefill + decode logs")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of every method (median, min-max)")
    ap.add_argument("--dir", default=None, help="where to write the logs (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("logscan", help="throughput of `kvfence audit logs` on a synthetic SGLang log pair",
                              description=__doc__.split("\n\n")[0])  # fmt: skip
    _add_args(p)
    p.set_defaults(func=lambda a: run(a.size_mb, a.repeat, a.dir, a.keep))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfence.bench.logscan", description=__doc__.split("\n\n")[0])
    _add_args(ap)
    a = ap.parse_args(argv)
    return run(a.size_mb, a.repeat, a.dir, a.keep)


if __name__ == "__main__":
    sys.exit(main())
