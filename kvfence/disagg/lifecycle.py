"""A request's lifecycle: a state enum, its table of allowed transitions, and the checked step between them.

What it knows: how to hold one state of a table `{state: frozenset(next states)}`, move to a
next one only if the table allows it (else `IllegalTransition`, an internal error naming
the machine, both states and the allowed ones), and remember when each state was entered.
The tables themselves live next to the code they describe: `disagg.handoff` (the KV handoff
on each side), `disagg.router` (a request's flight through the router), `disagg.decode`
and `disagg.prefill` (a request on each worker); docs/handoff.md draws each one.

What it does not know: what any state means, threads (callers hold their own locks) or time
(the clock is passed in).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A state machine was asked for a transition its table does not allow: a bug in kvfence, not bad input."""


def check_table(table: Mapping[S, frozenset[S]]) -> None:
    """Raise unless `table` names every state of its enum exactly once and only points at states it names."""
    states = set(table)
    enum_type = type(next(iter(table)))
    if states != set(enum_type):
        raise IllegalTransition(f"{enum_type.__name__} table misses {sorted(s.name for s in set(enum_type) - states)}")
    for s, nexts in table.items():
        if not nexts <= states:
            raise IllegalTransition(f"{enum_type.__name__}.{s.name} points outside the table")


class Lifecycle(Generic[S]):
    """The current state of one request on one side, moved only along `table`."""

    def __init__(
        self, name: str, initial: S, table: Mapping[S, frozenset[S]], clock: Callable[[], float] = time.monotonic
    ):
        self.name = name  # for the error message: "decode request r1", "flight r1", ...
        self._table = table
        self._clock = clock
        self.state: S = initial
        self.history: list[tuple[S, float]] = [(initial, clock())]

    def can(self, new: S) -> bool:
        return new in self._table[self.state]

    def advance(self, new: S) -> None:
        """Move to `new`; raise `IllegalTransition` when the table does not allow it from the current state."""
        if new not in self._table[self.state]:
            allowed = ", ".join(sorted(s.value for s in self._table[self.state])) or "none (final state)"
            raise IllegalTransition(
                f"{self.name}: {self.state.value} -> {new.value} is not allowed (allowed from {self.state.value}: "
                f"{allowed})"
            )
        self.state = new
        self.history.append((new, self._clock()))

    @property
    def final(self) -> bool:
        return not self._table[self.state]
