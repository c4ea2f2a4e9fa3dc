"""An HTTP server this process started as a child: the shared piece of `bench.launch` and `integrations.vllm.launch`.

What it knows: `ServerProcess`, what a started server has (its process, which leads its own session, its URL and
its log file) and the three things done with one: the end of its log, waiting until its /health answers 200 (or it
exits, or the time runs out, which stops it and raises RuntimeError with the log's end), and stopping its whole
process group (SIGTERM, SIGKILL after a grace period, then whatever of the group outlived its leader).

What it does not know: how a server is started or what it serves (the launchers build the command lines).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


class ServerProcess:
    """A started server; a launcher's (data)class supplies the fields below and may set the class constants."""

    proc: subprocess.Popen[bytes]  # started with start_new_session=True: its pid is its process group
    url: str
    log_path: Path
    tail_lines = 20  # the log lines a failure quotes
    poll_s = 0.25  # how often wait_ready asks /health
    grace_s = 10.0  # how long stop waits after SIGTERM

    @property
    def title(self) -> str:
        """How messages name this server."""
        raise NotImplementedError

    def log_tail(self, lines: int | None = None) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-(lines or self.tail_lines) :])

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health answers 200; stops the server and raises RuntimeError if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"{self.title} exited with code {self.proc.returncode} before it was ready\n"
                    f"--- {self.log_path} ---\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        self.stop()
        raise RuntimeError(f"{self.title}: {self.url}/health not ready within {timeout_s:.0f} s\n{self.log_tail()}")

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the server's process group (a parent stops its children), SIGKILL after `grace_s` (default: the
        class's); then SIGKILL whatever of the group outlived its leader."""
        for sig, wait_s in ((signal.SIGTERM, self.grace_s if grace_s is None else grace_s), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
