"""A router clock the test moves, and declaring one worker dead by its silence on that clock.

What it knows: that the router judges worker silence, handoff deadlines and orders in transit
by the clock it was given (`Router(..., clock=)`), so a test that moves the clock itself decides
how long a worker was silent, whatever the machine's load does to the worker threads' real
timing. `advance_until_dead` moves it only after every other up worker was heard at the current
time: however long a healthy thread is starved, it is never judged silent for more than one
step, while the silent one's silence grows by a step each time.

What it does not know: real time. Blocking waits (a request's own timeout, registration at
start, polls) still run on it, and so do the workers' own deadlines.
"""

from __future__ import annotations

import time
from typing import Any


class ManualClock:
    """Monotonic time that moves only when told (starts at 1000 s: the router compares ages against 0 at start)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds > 0, seconds
        self.now += seconds


def wait_heard(router: Any, worker_ids: list[str], timeout: float = 30.0) -> None:
    """Block until the router has had a message from each of `worker_ids` at its clock's current time."""
    deadline = time.monotonic() + timeout
    while True:
        workers = router.stats()["workers"]
        quiet = [w for w in worker_ids if workers[w]["silent_s"] > 0]
        if not quiet:
            return
        assert time.monotonic() < deadline, f"the router heard nothing from {quiet} for {timeout:g}s of real time"
        time.sleep(0.005)


def advance_until_dead(router: Any, clock: ManualClock, victim: str, step: float, within_s: float = 1.0) -> float:
    """Move `router`'s clock by `step` at a time until it declares `victim` dead; return how far it moved.

    Each step waits until every other up worker was heard at the current time, so only `victim`
    (which must have stopped sending) grows silent. Fails unless the death comes within the
    router's worker timeout plus `within_s` of router time. Use a `step` that is a power of two
    fraction of a second (0.125, 0.25) so the sums are exact.
    """
    start = clock()
    limit = router.config.worker_timeout_s + within_s
    while router.stats()["workers"][victim]["up"]:
        assert clock() - start <= limit, f"{victim} was not declared dead after {clock() - start:g}s of silence"
        clock.advance(step)
        workers = router.stats()["workers"]
        wait_heard(router, [w for w, d in workers.items() if d["up"] and w != victim])
    return clock() - start
