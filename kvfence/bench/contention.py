"""A fixed competing CPU load for `kvfence bench offline --contention N`: N busy-loop processes.

What it knows: how to start N python processes that spin forever (no I/O, no memory) and how to end exactly
those processes, by their ids, when the run is over. What it does not know: which cores they land on (the OS
schedules them like any neighbour would be scheduled).
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

_SPIN = "while True:\n    pass\n"


class BusyLoad:
    """Context manager: N busy-loop processes for the duration of the block."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyLoad:
        self.procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(self.n)]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []
