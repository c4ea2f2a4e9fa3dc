"""Sampler: greedy, temperature, top-k, top-p, and seeds that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.sampler import Sampler
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import InvalidRequestError

V = 50


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_per_row() -> None:
    logits = _logits(4)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 4, [None] * 4).token_ids
    assert out == logits.argmax(-1).tolist()


def test_greedy_ties_pick_the_first_index() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7] = logits[0, 3] = 1.0
    assert Sampler()(logits, [SamplingParams(temperature=0)], [None]).token_ids == [3]


def test_same_seed_same_tokens_regardless_of_batch_composition() -> None:
    logits = _logits(6)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20)
    alone = [Sampler()(logits[i : i + 1], [p], [_gen(100 + i)]).token_ids[0] for i in range(6)]
    # the same rows batched, mixed with a greedy row and an unfiltered row in between
    mixed_logits = torch.cat([logits[:3], _logits(2, seed=9), logits[3:]])
    params = [p] * 3 + [SamplingParams(temperature=0), SamplingParams(temperature=1.5)] + [p] * 3
    gens = [_gen(100 + i) for i in range(3)] + [None, _gen(5)] + [_gen(103 + i) for i in range(3)]
    batched = Sampler()(mixed_logits, params, gens).token_ids
    assert batched[:3] + batched[5:] == alone


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    p = SamplingParams(temperature=1.0)
    g1, g2 = _gen(1), _gen(2)
    s1 = [Sampler()(logits, [p], [g1]).token_ids[0] for _ in range(20)]
    s2 = [Sampler()(logits, [p], [g2]).token_ids[0] for _ in range(20)]
    assert s1 != s2
    assert len(set(s1)) > 5  # a uniform distribution really is sampled


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(8, seed=3)
    out = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=1)] * 8, [_gen(i) for i in range(8)]).token_ids
    assert out == logits.argmax(-1).tolist()


def test_top_k_only_samples_among_the_k_most_likely() -> None:
    logits = _logits(1, seed=4)
    allowed = set(logits[0].topk(3).indices.tolist())
    g = _gen(0)
    seen = {Sampler()(logits, [SamplingParams(temperature=5.0, top_k=3)], [g]).token_ids[0] for _ in range(200)}
    assert seen == allowed


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    g = _gen(0)
    p = SamplingParams(temperature=1.0, top_p=0.75)  # 0.5 < 0.75 <= 0.8: tokens 0 and 1
    seen = {Sampler()(logits, [p], [g]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_temperature_sampling_matches_the_distribution() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    g = _gen(0)
    draws = torch.tensor([Sampler()(probs.log(), [SamplingParams(temperature=1.0)], [g]).token_ids[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, probs[0], atol=0.04), freq


def test_low_temperature_concentrates_on_the_mode() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    g = _gen(0)
    draws = [Sampler()(logits, [SamplingParams(temperature=0.01)], [g]).token_ids[0] for _ in range(200)]
    assert draws.count(0) > 190


def test_never_picks_a_masked_token_even_at_the_top_of_the_cdf() -> None:
    logits = torch.full((1, V), -30.0)
    logits[0, :2] = 10.0
    p = SamplingParams(temperature=1.0, top_k=2)
    g = _gen(0)
    assert {Sampler()(logits, [p], [g]).token_ids[0] for _ in range(500)} <= {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_stop_accepts_a_single_string_and_lists() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
