"""cdiv and round_up against the float formula on small ranges and exactly at large values."""

from __future__ import annotations

import math

import pytest

from kvfence.math_utils import cdiv, round_up


def test_cdiv_matches_ceil_on_small_values() -> None:
    for a in range(0, 200):
        for b in range(1, 20):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)


def test_cdiv_is_exact_where_floats_round() -> None:
    a = 2**60 + 1  # float(a) == 2**60: a float ceil would give 2**59 pages, one short
    assert cdiv(a, 2) == 2**59 + 1


def test_round_up_to_a_multiple() -> None:
    assert [round_up(a, 64) for a in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]


def test_cdiv_refuses_a_zero_divisor() -> None:
    with pytest.raises(AssertionError):
        cdiv(5, 0)
