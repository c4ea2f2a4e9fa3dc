"""Explicit checks of configuration values, for the frozen config dataclasses of the disaggregated workers.

What it knows: how to refuse a value that must be positive or one of a few choices, with a
`KvfenceError` naming the config, the field and the value (the CLI prints it; an `assert`
would vanish under `python -O`). What it does not know: which flag set the value.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfence.errors import KvfenceError


def require_positive(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise KvfenceError(f"{type(config).__name__}.{name} must be a number > 0, got {value!r}")


def require_choice(config: object, name: str, choices: Iterable[str]) -> None:
    value, allowed = getattr(config, name), tuple(choices)
    if value not in allowed:
        raise KvfenceError(f"{type(config).__name__}.{name} must be one of {', '.join(allowed)}, got {value!r}")
