"""LLMEngine's log probabilities and logits processors against transformers on the same tiny random Llama.

Oracle: log_softmax of transformers' own float32 logits over the whole sequence (prompt + what
the engine generated). Prompt logprobs are checked across chunked prefill and preemption;
penalised greedy generation is checked against a loop that applies the reference processors
of tests/helpers/reference_sampler.py to transformers' logits one step at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvfence.engine.llm_engine import Completion, LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.reference_sampler import reference_processed

K = 5


def make_engine(loaded: Any, max_total_tokens: int | None = None, page_size: int = 16, **sched: Any) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(loaded.model_dir)),
        cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(**sched),
        context_length=128,
    )
    return LLMEngine(config, loaded=loaded)


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32: row i is transformers' logits for the token after ids[: i + 1]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def check_against_transformers(hf_model: Any, c: Completion, k: int = K) -> None:
    ids = c.prompt_token_ids + c.token_ids
    lp = hf_logits(hf_model, ids).log_softmax(-1)  # [T, V]
    P = len(c.prompt_token_ids)
    assert c.prompt_logprobs is not None and len(c.prompt_logprobs) == P and c.prompt_logprobs[0] is None
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    positions = [(i - 1, e) for i, e in enumerate(c.prompt_logprobs) if e is not None]
    positions += [(P - 1 + j, e) for j, e in enumerate(c.logprobs)]
    for row, entry in positions:
        assert entry.token_id == ids[row + 1]
        assert entry.logprob == pytest.approx(lp[row, ids[row + 1]].item(), abs=1e-4)
        want = lp[row].topk(k)
        assert [t for t, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)


SCORED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=K)


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(loaded: Any, hf_model: Any) -> None:
    engine = make_engine(loaded, chunked_prefill_size=8, max_num_batched_tokens=40)  # prompts span several chunks
    batch = prompts([1, 2, 9, 23, 40])
    outs = engine.generate(batch, [SCORED] * 3 + [dataclasses.replace(SCORED, max_tokens=1)] * 2)
    for c in outs:
        check_against_transformers(hf_model, c)
    assert outs[0].prompt_logprobs == [None]  # a one-token prompt has nothing to score


def test_prompt_logprobs_survive_preemption_without_duplicates(loaded: Any, hf_model: Any) -> None:
    # 16 pages of 8 tokens for requests needing up to 6 pages each: some are preempted and recompute their prompt
    engine = make_engine(loaded, max_total_tokens=128, page_size=8, chunked_prefill_size=32)
    params = dataclasses.replace(SCORED, max_tokens=16)
    outs = engine.generate(prompts([30, 25, 33, 20, 31]), params)
    assert engine.stats().num_preemptions > 0
    for c in outs:
        check_against_transformers(hf_model, c)


def test_sampled_tokens_logprobs_are_from_the_logits_that_sampled_them(loaded: Any, hf_model: Any) -> None:
    engine = make_engine(loaded)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    for c in engine.generate(prompts([7, 12]), params):
        check_against_transformers(hf_model, c, k=2)


GREEDY12 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    ("params", "without"),
    [
        (dataclasses.replace(GREEDY12, repetition_penalty=1.8), GREEDY12),
        (dataclasses.replace(GREEDY12, frequency_penalty=1.1, presence_penalty=0.6), GREEDY12),
        (dataclasses.replace(GREEDY12, logit_bias={42: 6.0, 43: 6.0}, repetition_penalty=1.3), GREEDY12),
        (  # the biased stop id wins at once unless min_tokens holds it back
            SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[100], logit_bias={100: 30.0}),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[100], logit_bias={100: 30.0}),
        ),
    ],
)
def test_penalised_greedy_generation_follows_the_reference_processors(
    loaded: Any, hf_model: Any, params: SamplingParams, without: SamplingParams
) -> None:
    engine = make_engine(loaded)
    eos = tuple(sorted(engine.tokenizer.eos_token_ids))
    prompt = prompts([15])[0] + [42, 42, 100]
    got = engine.generate([prompt], params)[0]
    out: list[int] = []
    for _ in range(params.max_tokens):  # the reference: transformers' logits, processed in plain Python
        row = hf_logits(hf_model, prompt + out)[-1].tolist()
        x = reference_processed(row, prompt, out, params, eos)
        out.append(max(range(len(x)), key=lambda t: x[t]))
        if (out[-1] in eos and not params.ignore_eos) or out[-1] in params.stop_token_ids:
            break
    assert got.token_ids == out
    assert engine.generate([prompt], without)[0].token_ids != out  # the processor under test changed the picks
