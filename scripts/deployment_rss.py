"""Memory of a whole `kvfence serve` deployment (aggregated or --disagg) on one host: every process of it.

What it knows: how to start `python -m kvfence serve <flags>` on a free loopback port, wait for /health, send N
concurrent greedy completions (random prompt token ids, ignore_eos), then read each process's RSS and PSS
(/proc/<pid>/smaps_rollup: PSS splits a page shared by k processes into k parts, so a file of weights mapped by
two workers counts once in the sum) and VmHWM, before stopping the deployment (SIGINT, then SIGKILL).
Prints one JSON line. PYTHONPATH chooses the checkout measured.

What it does not know: anything of the answers beyond their status; it is a measuring script, not a test.

usage: python scripts/deployment_rss.py [--requests 8] -- --disagg --model DIR
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/smaps_rollup", encoding="ascii"):
        parts = line.split()
        if parts[0] in ("Rss:", "Pss:"):
            out[parts[0][:-1].lower()] = int(parts[1])
    for line in open(f"/proc/{pid}/status", encoding="ascii"):
        if line.startswith("VmHWM:"):
            out["hwm"] = int(line.split()[1])
    return out


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        return int(r.status)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    port = _free_port()
    serve_args = [a for a in args.serve_args if a != "--"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvfence serve did not come up (exit {proc.poll()})")
            time.sleep(0.5)
        time.sleep(2)  # workers registered and idle

        def tree() -> list[psutil.Process]:
            root = psutil.Process(proc.pid)
            return [root, *root.children(recursive=True)]

        start = {p.pid: _rollup(p.pid) for p in tree()}
        rng = random.Random(0)
        bodies = [
            {
                "model": "m",
                "prompt": [rng.randrange(10, 2000) for _ in range(args.input_len)],
                "max_tokens": args.output_len,
                "temperature": 0,
                "ignore_eos": True,
            }
            for _ in range(args.requests)
        ]
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))
        for b in bodies:
            b["model"] = models["data"][0]["id"]
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            statuses = list(pool.map(lambda b: _post(base + "/v1/completions", b), bodies))
        steady = {p.pid: _rollup(p.pid) for p in tree()}
        names = {p.pid: " ".join(p.cmdline()[2:5]) for p in tree()}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def mib(kib: int) -> float:
        return round(kib / 1024, 1)

    print(
        json.dumps(
            {
                "kvfence": os.environ.get("PYTHONPATH", ""),
                "serve": " ".join(serve_args),
                "statuses": sorted(set(statuses)),
                "processes": {names.get(pid, str(pid)): mib(v["rss"]) for pid, v in steady.items()},
                "start_rss_mib": mib(sum(v["rss"] for v in start.values())),
                "start_pss_mib": mib(sum(v["pss"] for v in start.values())),
                "steady_rss_mib": mib(sum(v["rss"] for v in steady.values())),
                "steady_pss_mib": mib(sum(v["pss"] for v in steady.values())),
                "sum_of_peaks_mib": mib(sum(v["hwm"] for v in steady.values())),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
