"""Several greedy decode steps in one native call (SchedulerConfig.max_decode_steps): the tokens of one step per
forward (and transformers'), a stop token inside a call ends its request there, the requests that need Python
between tokens keep one step per forward, the time budget and the page table hold a call back, and the config
refuses nonsense. Pool conservation is checked after every step by `run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.config import ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.engine import hf_greedy, make_engine, native_unavailable, prompts_of, run

pytestmark = pytest.mark.skipif(bool(native_unavailable()), reason="no native build")

LENGTHS = [5, 17, 33, 1, 64, 9]


def _greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _engine(loaded: Any, steps: int, **kw: Any) -> LLMEngine:
    # a budget no step reaches: the step count, the requests' limits and the pool decide
    kw.setdefault("decode_steps_ms", 1e4)
    return make_engine(loaded, kernels="native", max_decode_steps=steps, **kw)


def test_several_steps_per_call_give_the_tokens_of_one_step_per_call(loaded: Any, hf_model: Any) -> None:
    prompts = prompts_of(LENGTHS)
    params = [_greedy(m) for m in (16, 3, 11, 1, 16, 7)]  # calls end at every request's own max_tokens
    one = _engine(loaded, 1)
    want = run(one, prompts, params)
    many = _engine(loaded, 8)
    assert run(many, prompts, params) == want
    assert one.num_multi_step_forwards == 0 and many.num_multi_step_forwards > 0
    assert want[0] == hf_greedy(hf_model, prompts[0], 16)


def test_bfloat16_steps_in_one_call_give_the_tokens_of_one_step_per_call(tiny_llama_dir: Path) -> None:
    def engine(steps: int) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=ModelConfig(str(tiny_llama_dir), dtype="bfloat16", kernels="native"),
                scheduler=SchedulerConfig(max_decode_steps=steps, decode_steps_ms=1e4),
            )
        )

    prompts, params = prompts_of([7, 40, 19]), [_greedy(m) for m in (16, 9, 13)]
    many = engine(8)
    assert run(many, prompts, params) == run(engine(1), prompts, params)
    assert many.num_multi_step_forwards > 0


def test_a_stop_token_inside_a_call_ends_its_request_there_and_not_its_batch_mates(loaded: Any) -> None:
    prompt, other = prompts_of([20, 9], seed=3)
    free = run(_engine(loaded, 1), [prompt], _greedy(24))[0]
    # a token first sampled late enough to come out of a multi-step call (the prefill samples token 0, the first
    # decode step of a batch size runs alone to time it)
    i = next(j for j in range(4, len(free)) if free[j] not in free[:j])
    engine = _engine(loaded, 8)
    got = run(engine, [prompt, other], [_greedy(24, stop_token_ids=(free[i],)), _greedy(24)])
    assert got[0] == free[: i + 1]
    assert got[1] == run(_engine(loaded, 1), [other], _greedy(24))[0]
    assert engine.num_multi_step_forwards > 0


@pytest.mark.parametrize(
    "special",
    [
        _greedy(logprobs=2),
        _greedy(stop=("\x00never",)),
        _greedy(presence_penalty=0.5),
        _greedy(min_tokens=3),
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
    ],
    ids=["logprobs", "stop-string", "penalty", "min-tokens", "sampled"],
)
def test_a_request_that_needs_python_between_tokens_keeps_its_batch_to_one_step(
    loaded: Any, special: SamplingParams
) -> None:
    engine = _engine(loaded, 8)
    run(engine, prompts_of([12, 30]), [_greedy(16), special])
    assert engine.num_multi_step_forwards == 0


def test_the_time_budget_holds_calls_to_one_step_when_a_step_takes_longer(loaded: Any) -> None:
    engine = _engine(loaded, 8, decode_steps_ms=1e-6)
    run(engine, prompts_of([12]), _greedy(16))
    assert engine.num_multi_step_forwards == 0
    assert engine.runner.step_seconds[1] > 0  # what the budget was measured against


def test_a_pool_without_pages_for_more_steps_runs_one_step_per_forward_and_preempts_nothing(loaded: Any) -> None:
    """Four pages of 4 tokens, the last one reserved by someone else after the prompt's three: the steps that fit
    in the request's pages run one per forward (Scheduler.grow_for_steps preempts nobody for more); once the page
    is given back, the rest run together, and the tokens are those of one step per forward."""
    prompt = prompts_of([9])[0]
    want = run(_engine(loaded, 1), [prompt], _greedy(7))[0]
    engine = _engine(loaded, 8, page_size=4, max_total_tokens=16, context_length=16, chunked_prefill_size=16)
    engine.add_request("r", prompt_token_ids=prompt, sampling_params=_greedy(7))
    got: list[int] = []
    for _ in range(4):  # the prefill, then positions 9, 10 and 11: the request's third page
        got += [t for o in engine.step() for t in o.new_token_ids]
        if len(got) == 1:
            assert engine.scheduler.reserve("squatter", 4) is not None  # the pool's last page
    assert engine.num_multi_step_forwards == 0 and engine.stats().num_preemptions == 0
    engine.scheduler.release("squatter")
    while engine.has_unfinished_requests():
        got += [t for o in engine.step() for t in o.new_token_ids]
        engine.allocator.check()
    assert got == want and engine.num_multi_step_forwards > 0
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_the_native_call_refuses_a_page_table_shorter_than_its_steps(loaded: Any) -> None:
    engine = _engine(loaded, 8)
    model = engine.runner.model
    pages = torch.tensor([[0, 1]])  # 32 tokens at page size 16
    with pytest.raises(RuntimeError, match="page table is too short"):
        model.decode_steps(torch.tensor([5]), torch.tensor([30]), pages, 16, [()], 3, engine.pool)
    out = model.decode_steps(torch.tensor([5]), torch.tensor([29]), pages, 16, [()], 3, engine.pool)
    assert out.shape == (3, 1) and out.dtype == torch.long


def test_the_config_refuses_a_step_count_or_budget_that_is_not_positive() -> None:
    with pytest.raises(ConfigError, match="max_decode_steps"):
        SchedulerConfig(max_decode_steps=0)
    with pytest.raises(ConfigError, match="decode_steps_ms"):
        SchedulerConfig(decode_steps_ms=0)
    with pytest.raises(ConfigError, match="decode_steps_ms"):
        SchedulerConfig(decode_steps_ms=float("nan"))
