"""The suite's watchdog (tests/conftest.py): a test stuck where pytest-timeout's signal cannot reach it is ended.

A child pytest runs one test that blocks SIGALRM (as a main thread waiting in native code, or for a GIL a native
thread holds, never runs the handler) and sleeps; its timeout is 1 s, the watchdog's grace 1 s. The child must end
within seconds, print the stuck test's stack, and fail; a second test in the same file never runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

STUCK = """
import signal, time

import pytest


@pytest.mark.timeout(1)
def test_stuck_where_no_signal_reaches() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(120)


def test_never_reached() -> None:
    pass
"""


def test_a_test_stuck_beyond_its_timeout_ends_the_run_with_every_threads_stack(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "KVFENCE_TEST_WATCHDOG_GRACE_S": "1", "PYTHONPATH": str(root)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-s",
         str(tmp_path / "test_stuck.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout
    assert "Timeout (0:00:02)!" in proc.stderr, proc.stderr[-2000:]
    assert "test_stuck_where_no_signal_reaches" in proc.stderr, proc.stderr[-2000:]
    assert "passed" not in proc.stdout, proc.stdout  # the process ended before the second test
    assert took < 30, took
