"""Starting `kvfence serve` for a benchmark, and watching it: the shared piece of `bench serve` and `bench soak`.

What it knows: the deployment kinds a benchmark can launch (`LAUNCH_ARGS`: agg is
`kvfence serve --role aggregated`, disagg is plain `kvfence serve`, a router plus one
prefill and one decode worker; disagg-noverify adds `--no-verify`; disagg-PxD runs P
prefill and D decode workers), how to start one on a free loopback port with its log in a
file and wait for /health, how to stop it (its whole process group; both `server_process`), the resident memory
of its processes (from /proc), the flags both benchmarks share for launching (--model,
--server-args, --launch-timeout, --model-name, --i-am-authorised), and the vocabulary size
a local model directory declares.

What it does not know: what the benchmark sends, or what the server does inside.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfence.disagg.launcher import free_port
from kvfence.server_process import ServerProcess

# `kvfence serve` flags per launch kind: `--role aggregated` is one process; plain `kvfence serve` is a router plus
# one prefill and one decode worker on loopback; `--no-verify` has decode admit handoffs without checking them;
# disagg-PxD runs P prefill and D decode worker processes behind the router.
LAUNCH_ARGS: dict[str, tuple[str, ...]] = {
    "agg": ("--role", "aggregated"),
    "disagg": (),
    "disagg-noverify": ("--no-verify",),
    **{
        f"disagg-{p}x{d}": ("--prefill-workers", str(p), "--decode-workers", str(d))
        for p, d in ((1, 1), (2, 1), (1, 2), (2, 2))
    },
}
LAUNCH_KINDS = tuple(LAUNCH_ARGS)


def descendants(pid: int) -> list[int]:
    """pid and every live descendant (read from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_bytes(pids: Sequence[int]) -> int | None:
    """Sum of VmRSS over `pids` and their descendants, from /proc/<pid>/status; None when unreadable."""
    total, seen = 0, False
    for root in pids:
        for pid in descendants(root):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        seen = True
                        break
            except (OSError, ValueError):
                continue
    return total if seen else None


@dataclass
class LaunchedServer(ServerProcess):
    """A `kvfence serve` this tool started: its URL, its process (disagg: the parent of three), and its log."""

    label: str
    kind: str
    url: str
    how: str  # the command line, for the report
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    @property
    def title(self) -> str:
        return f"{self.label}: server"

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(
    kind: str,
    *,
    label: str | None = None,
    model: str | None = None,
    server_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    ready_timeout_s: float = 300.0,
    log_dir: str | os.PathLike[str] | None = None,
) -> LaunchedServer:
    """Start `kvfence serve` as deployment `kind` (see LAUNCH_ARGS) on a free port of `host`; wait for /health.

    Raises RuntimeError when the server dies or never answers /health.
    """
    label = label or kind
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvfence-bench-")) / f"{label}.log"
    port = free_port(host)
    model_args = ["--model", str(model)] if model else []
    args = [*model_args, "--host", host, "--port", str(port), *LAUNCH_ARGS[kind], *server_args]
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence", "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    server = LaunchedServer(label, kind, f"http://{host}:{port}", "kvfence serve " + shlex.join(args), proc, log_path)
    server.wait_ready(ready_timeout_s)
    return server


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `bench serve` and `bench soak` share: how `--launch` starts servers, what to send, where to."""
    p.add_argument("--model", dest="model_dir", help="model directory for --launch (default: the server's default)")
    p.add_argument("--server-args", default="", help="extra arguments for every launched server (one quoted string)")
    p.add_argument("--launch-timeout", type=float, default=300.0, help="seconds a launched server may take to start")
    p.add_argument("--model-name", help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--i-am-authorised",
        "--i-am-authorized",
        dest="allow_remote",
        action="store_true",
        help="allow a non-loopback target you are authorised to load",
    )


def vocab_size_of(model_dir: str | os.PathLike[str] | None) -> int | None:
    """vocab_size from a local model's config.json (None when there is no such file or field)."""
    if model_dir is None:
        return None
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
