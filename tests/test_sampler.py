"""Sampler: greedy, temperature, top-k, top-p, seeds that do not depend on the batch; logits processors and
logprobs against the plain-Python reference of vLLM's semantics in tests/helpers/reference_sampler.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfence.engine.sampler import History, Sampler, argmax_rows
from kvfence.engine.sampling_params import SamplingParams, StructuredOutputs
from kvfence.errors import InvalidRequestError
from tests.helpers.reference_sampler import log_softmax, reference_processed

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


def test_argmax_rows_is_torchs_argmax_on_ties_nans_infinities_and_signed_zeros() -> None:
    # small integers make ties common; then NaN, +-inf and -0.0 sprinkled in (a NaN row, an all -inf row)
    g = _gen(3)
    for trial in range(400):
        n, v = 1 + trial % 5, 1 + (trial * 37) % 300
        x = torch.randint(-3, 4, (n, v), generator=g).float()
        u = torch.rand(n, v, generator=g)
        x[u < 0.03] = float("nan")
        x[(u >= 0.03) & (u < 0.08)] = float("inf")
        x[(u >= 0.08) & (u < 0.15)] = -float("inf")
        x[(u >= 0.15) & (u < 0.3)] = -0.0
        if trial % 50 == 0:
            x[0] = -float("inf")
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (trial, x, got)
    strided = torch.arange(12.0).view(3, 4).t()  # [4, 3], not contiguous
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))


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
    draws = torch.tensor(
        [Sampler()(probs.log(), [SamplingParams(temperature=1.0)], [g]).token_ids[0] for _ in range(3000)]
    )
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


# --- logits processors and logprobs (vLLM semantics), against tests/helpers/reference_sampler.py


PENALTY_CASES = [
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0, frequency_penalty=1.5),
    SamplingParams(temperature=0, presence_penalty=-1.2),
    SamplingParams(temperature=0, logit_bias={7: 5.0, 11: -100.0}),
    SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[3, 9]),
    SamplingParams(
        temperature=0,
        repetition_penalty=0.6,
        frequency_penalty=0.7,
        presence_penalty=0.9,
        logit_bias={2: 3.0},
        min_tokens=2,
    ),
]


@pytest.mark.parametrize("params", PENALTY_CASES)
def test_processors_match_the_reference(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(11)
    N = 5
    logits = _logits(N, seed=5)
    histories = []
    for i in range(N):
        prompt = torch.randint(0, V, (6,), generator=g).tolist()
        output = torch.randint(0, V, (i * 2,), generator=g).tolist() + [7, 7]  # repeats: counts > 1
        histories.append(History(prompt, output[: i + 1]))
    eos = (1,)
    want_rows = [
        reference_processed(logits[i].tolist(), list(h.prompt_token_ids), list(h.output_token_ids), params, eos)
        for i, h in enumerate(histories)
    ]
    processed = dataclasses.replace(params, logprobs=2, logprobs_mode="processed_logprobs")
    raw = dataclasses.replace(params, logprobs=2)
    out = Sampler(eos)(logits.clone(), [processed] * N, [None] * N, histories)
    out_raw = Sampler(eos)(logits.clone(), [raw] * N, [None] * N, histories)
    for i, want in enumerate(want_rows):
        best = max(range(V), key=lambda t: want[t])
        assert out.token_ids[i] == out_raw.token_ids[i] == best
        want_lp = log_softmax(want)
        assert out.logprobs[i].logprob == pytest.approx(want_lp[best], abs=1e-4)
        assert [t for t, _ in out.logprobs[i].top] == sorted(range(V), key=lambda t: -want[t])[:2]
        # raw logprobs describe the model's row before any processing
        assert out_raw.logprobs[i].logprob == pytest.approx(log_softmax(logits[i].tolist())[best], abs=1e-4)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1] = logits[0, 4] = 50.0  # eos (1) and a stop id (4) would always win
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    sampler = Sampler(eos_token_ids=(1,))
    early = sampler(logits.clone(), [p], [None], [History([0], [5, 6])]).token_ids[0]
    late = sampler(logits.clone(), [p], [None], [History([0], [5, 6, 7])]).token_ids[0]
    assert early not in (1, 4) and late == 1
    ignoring = dataclasses.replace(p, ignore_eos=True)
    assert sampler(logits.clone(), [ignoring], [None], [History([0], [5])]).token_ids[0] == 1  # only stop ids banned


def test_processed_logprobs_are_the_distribution_sampled_from() -> None:
    logits = _logits(1, seed=8)
    p = SamplingParams(temperature=0.5, top_k=4, seed=1, logprobs=6, logprobs_mode="processed_logprobs")
    out = Sampler()(logits.clone(), [p], [_gen(1)])
    scaled = logits[0] / 0.5
    keep = scaled.topk(4).indices
    want = torch.full((V,), float("-inf"))
    want[keep] = scaled[keep].log_softmax(-1)
    entry = out.logprobs[0]
    assert entry.token_id in keep.tolist() and entry.logprob == pytest.approx(want[entry.token_id].item(), abs=1e-5)
    assert [t for t, _ in entry.top[:4]] == keep.tolist()
    assert all(lp == float("-inf") for _, lp in entry.top[4:])  # the 5th and 6th best were cut by top-k


def test_asking_for_logprobs_does_not_change_seeded_tokens() -> None:
    logits = _logits(4, seed=2)
    plain = SamplingParams(temperature=0.8, top_p=0.9)
    scored = dataclasses.replace(plain, logprobs=3, frequency_penalty=0.0)
    for seed in range(5):
        a = Sampler()(logits.clone(), [plain] * 4, [_gen(seed + i) for i in range(4)]).token_ids
        b = Sampler()(logits.clone(), [scored] * 4, [_gen(seed + i) for i in range(4)]).token_ids
        assert a == b


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"structured_outputs": StructuredOutputs(json_object=True), "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_invalid_processor_params_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_params_round_trip_through_json() -> None:
    import json

    sp = SamplingParams(
        logit_bias={5: 1.5, 2: -3.0},
        stop_token_ids=[9],
        logprobs=2,
        structured_outputs=StructuredOutputs(json={"type": "object"}),
        min_tokens=2,
        repetition_penalty=1.2,
    )
    assert SamplingParams.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp
