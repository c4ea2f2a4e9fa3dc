"""A real `kvfence serve` process for tests: started on a free port with the Hugging Face libraries offline,
waited on until /health answers, yielded as a URL, terminated on exit. It knows nothing of what is
served or asked; a server that dies or is not healthy within 180 s fails the test with its log."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvfence.disagg.launcher import free_port

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def kvfence_serve(model_dir: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """`kvfence serve` (disaggregated unless flags say --role aggregated) on a free port; yields its URL."""
    with kvfence_serve_process(model_dir, log_path, *flags) as (url, _):
        yield url


@contextlib.contextmanager
def kvfence_serve_process(model_dir: Path, log_path: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """As `kvfence_serve`, yielding (URL, the `kvfence serve` process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--log-level", "warning", *flags]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            yield url, server
        finally:
            server.terminate()
            server.wait(timeout=60)
