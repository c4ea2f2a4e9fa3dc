"""CPU seconds each process of a launched `kvfence serve` spends while `kvfence bench serve` drives it.

Launches each deployment kind in turn (`kvfence.bench.launch.LAUNCH_ARGS`: agg, disagg-1x1, disagg-2x1, ...),
reads utime + stime of every process under it from /proc before and after one `kvfence bench serve --url`
run, and prints the wall time of the run and the CPU seconds per process (named by its --worker-id or
--role). Linux only (/proc). Everything after the kinds goes to `kvfence bench serve`:

    python scripts/serve_cpu_split.py disagg-1x1,disagg-1x2 --num-prompts 64 --input-len 16:32 --output-len 96:128
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfence.bench.launch import LaunchedServer, descendants, launch_server


def cpu_seconds(server: LaunchedServer) -> dict[str, float]:
    """Process name -> CPU seconds so far, for the server's process and every descendant."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in descendants(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "launcher"
        for flag in (b"--worker-id", b"--role"):
            if flag in cmd:
                name = cmd[cmd.index(flag) + 1].decode()
                break
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def main(argv: list[str]) -> int:
    kinds, bench_args = argv[0].split(","), argv[1:]
    for kind in kinds:
        with launch_server(kind, ready_timeout_s=300) as server:
            before = cpu_seconds(server)
            run = subprocess.run(
                [sys.executable, "-m", "kvfence", "bench", "serve", "--url", server.url, *bench_args],
                capture_output=True,
                text=True,
            )
            after = cpu_seconds(server)
        if run.returncode != 0:
            print(f"{kind}: kvfence bench serve failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}", file=sys.stderr)
            return 1
        wall = next(line.split()[2] for line in run.stdout.splitlines() if line.startswith("duration"))
        used = {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}
        print(f"{kind} {wall} s; cpu s: {used} total {round(sum(used.values()), 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
