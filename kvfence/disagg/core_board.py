"""The cores of one host, pooled among the worker processes that one `kvfence serve` started on it.

What it knows: a small shared file (the board) that the launcher makes and every co-located worker maps:
a header (magic, the thread budget of all workers together, the number of slots) and one int32 slot per
worker holding the torch threads it claims right now (0 while it has no work). Before each engine step a
worker with work claims its own share plus whatever the others leave unclaimed:

    threads = max(share, budget - sum(claims of the other slots))

so a lone prefill of a fresh prompt computes on the cores an idle decode worker would have used, while
two busy workers fall back to their fixed shares. A worker made with `borrow=False` (decode, as the
workers are set up) only publishes: it runs on its share and tells the others when it has work. Two
workers that turn busy at the same instant may both claim the whole budget for one step; each sees the
other's claim on its next step and drops back, so an overlap lasts one step at most.

What it does not know: other processes on the host, workers on other hosts (a worker started by hand
with `--role` has no board and keeps its fixed `--torch-threads`), or which cores the threads land on.
Claims are hints between cooperating processes, not locks: a stale claim of a dead worker only keeps
the others at their shares until its slot's replacement writes a fresh one.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

MAGIC = 0x6B766662  # "kvfb"
_HEADER = 3  # int32 words: magic, budget, number of slots


def default_budget(num_cpus: int, shares: list[int]) -> int:
    """Threads all co-located workers may run together: every core but one (the router's HTTP front end
    needs a little), never less than the workers' shares added up (on two cores: both cores)."""
    return max(sum(shares), num_cpus - 1)


class CoreBoard:
    """One worker's view of the board: its slot, its fixed share, and the thread count it runs with now."""

    def __init__(self, path: str | Path, slot: int, share: int, borrow: bool = True) -> None:
        self.borrow = borrow
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("i")  # aligned int32: a store is one machine write
        magic, self.budget, self.num_slots = self._words[:_HEADER]
        if magic != MAGIC or len(self._words) != _HEADER + self.num_slots:
            raise ValueError(f"{path} is not a kvfence core board")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"core board slot {slot} is outside 0..{self.num_slots - 1}")
        assert 1 <= share <= self.budget, (share, self.budget)
        self.slot, self.share = slot, share
        self.threads = share  # what torch runs with after the last claim
        self.steps_borrowing = 0  # steps run with more threads than the share
        self._set(0)

    @staticmethod
    def create(path: str | Path, num_slots: int, budget: int) -> None:
        """Write an empty board (no claims) for `num_slots` workers sharing `budget` threads."""
        assert num_slots >= 1 and budget >= 1, (num_slots, budget)
        words = [MAGIC, budget, num_slots] + [0] * num_slots
        Path(path).write_bytes(struct.pack(f"={len(words)}i", *words))  # native order, as memoryview reads it

    def claims(self) -> list[int]:
        """Every slot's claim, this worker's included."""
        return list(self._words[_HEADER:])

    def claim(self, busy: bool) -> int:
        """Publish whether this worker has work and, if it has, pick its thread count for the next step
        (set in torch when it changes). Returns the threads claimed (0 when idle)."""
        if not busy:
            self._set(0)
            return 0
        others = sum(self._words[_HEADER:]) - self._words[_HEADER + self.slot]
        threads = max(self.share, self.budget - others) if self.borrow else self.share
        self._set(threads)
        if threads != self.threads:
            import torch  # imported by then in every worker; the launcher, which only makes boards, never needs it

            torch.set_num_threads(threads)
            self.threads = threads
        self.steps_borrowing += threads > self.share
        return threads

    def close(self) -> None:
        self._set(0)
        self._words.release()
        self._map.close()

    def _set(self, threads: int) -> None:
        self._words[_HEADER + self.slot] = threads
