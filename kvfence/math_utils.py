"""Integer arithmetic the page-based code shares: ceiling division and rounding up to a multiple.

Knows nothing about pages, tokens or tensors; imports nothing from kvfence, so every layer may use it.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0 and b > 0, in integers (no float rounding at large a)."""
    assert a >= 0 and b > 0, (a, b)
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= a."""
    return cdiv(a, multiple) * multiple
