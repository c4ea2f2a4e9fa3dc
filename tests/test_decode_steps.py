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


def _record_calls(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """The tokens each native multi-step call of `engine` returns from now on ([step][chunk])."""
    calls: list[list[list[int]]] = []
    real = engine.runner.execute_steps

    def recorded(*args: Any) -> list[list[int]]:
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(engine.runner, "execute_steps", recorded)
    return calls


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


def test_a_stop_token_inside_a_call_ends_its_request_there_and_not_its_batch_mates(
    loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, other = prompts_of([20, 9], seed=3)
    free = run(_engine(loaded, 1), [prompt], _greedy(24))[0]
    # a token first sampled late enough to come out of a multi-step call (the prefill samples token 0, the first
    # decode step of a batch size runs alone to time it)
    i = next(j for j in range(4, len(free)) if free[j] not in free[:j])
    engine = _engine(loaded, 8)
    calls = _record_calls(engine, monkeypatch)
    got = run(engine, [prompt, other], [_greedy(24, stop_token_ids=(free[i],)), _greedy(24)])
    assert got[0] == free[: i + 1]
    assert got[1] == run(_engine(loaded, 1), [other], _greedy(24))[0]
    # the stop token was the last step of a call that ran several, for the first request (chunk 0)
    assert any(len(rows) > 1 and rows[-1][0] == free[i] for rows in calls), calls


def test_eos_inside_a_call_ends_its_request_there(loaded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = prompts_of([11], seed=5)[0]
    free = run(_engine(loaded, 1), [prompt], _greedy(24))[0]
    i = next(j for j in range(4, len(free)) if free[j] not in free[:j])
    engine = _engine(loaded, 8)
    engine.scheduler.eos_token_ids = frozenset({free[i]})  # this model's eos, as far as the stop rules go
    calls = _record_calls(engine, monkeypatch)
    engine.add_request("r", prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=24))
    outs = [o for _ in range(64) if engine.has_unfinished_requests() for o in engine.step()]
    assert [t for o in outs for t in o.new_token_ids] == free[: i + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert any(len(rows) > 1 and rows[-1][0] == free[i] for rows in calls), calls
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


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
    plain = _engine(loaded, 8)
    run(plain, prompts_of([12, 30]), [_greedy(16), _greedy(16)])
    assert plain.num_multi_step_forwards > 0  # the same pair, both plain greedy
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
        engine.scheduler.check()
    assert got == want and engine.num_multi_step_forwards > 0
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


def test_growing_pages_for_several_steps_takes_all_or_nothing_and_preempts_no_one(loaded: Any) -> None:
    """Two requests in a pool of four pages of 4 tokens, the first stopping early: several steps a call take
    pages ahead only when every request's shortfall fits, so they preempt no more than one step per forward
    (which preempts no one here) and give the same tokens."""
    a, b = prompts_of([2, 2], seed=8)
    free = run(_engine(loaded, 1), [a], _greedy(14))[0]
    # taking pages ahead for the first request alone (it stops early and never uses them) left the second none
    params = [_greedy(14, stop_token_ids=(free[3],)), _greedy(8)]
    one = _engine(loaded, 1, page_size=4, max_total_tokens=16, context_length=16, chunked_prefill_size=16)
    want = run(one, [a, b], params)
    many = _engine(loaded, 8, page_size=4, max_total_tokens=16, context_length=16, chunked_prefill_size=16)
    assert run(many, [a, b], params) == want
    assert many.stats().num_preemptions == one.stats().num_preemptions == 0


def test_several_steps_a_call_with_the_prefix_cache_keep_its_refcounts(loaded: Any) -> None:
    """Prompts sharing a prefix, through an engine with the prefix cache: the tokens of one step per forward,
    and the scheduler's check (allocator conservation, each cached page's refcount its readers) after every
    step."""
    shared = prompts_of([40], seed=9)[0]
    prompts = [shared + tail for tail in prompts_of([3, 9, 17], seed=10)]
    params = [_greedy(m) for m in (12, 7, 16)]
    got = []
    for steps in (1, 8):
        engine = _engine(loaded, steps, enable_prefix_caching=True)
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):  # one after another, so the later ones hit the cache
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params[i])
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
                engine.scheduler.check()
        got.append([out[f"r{i}"] for i in range(len(prompts))])
        assert engine.prefix_cache is not None and engine.prefix_cache.num_hits > 0
    assert got[0] == got[1] and engine.num_multi_step_forwards > 0


def test_the_native_argmax_takes_the_first_maximum_and_the_first_nan(make_model: Any) -> None:
    """numpy's rule (the sampler's greedy path): with every logit equal the token is 0; with two NaN logits it is
    the first of them."""
    from kvfence.models.loader import load_model

    lm = load_model(make_model(seed=2), progress=False)
    engine = make_engine(lm, kernels="native")
    model: Any = engine.runner.model
    head = model._native_head  # float32 panels [V / 32, E, 32]: column v is head[v // 32, :, v % 32]
    head.zero_()  # every logit 0
    pages = torch.tensor([[0, 1]])
    out = model.decode_steps(torch.tensor([5]), torch.tensor([3]), pages, 16, [()], 2, engine.pool)
    assert out.tolist() == [[0], [0]]
    for v in (1000, 77):
        head[v // 32, :, v % 32] = float("nan")
    out = model.decode_steps(torch.tensor([5]), torch.tensor([3]), pages, 16, [()], 2, engine.pool)
    assert out.tolist() == [[77], [77]]
    logits = torch.zeros(1, 2048)
    logits[0, [77, 1000]] = float("nan")
    from kvfence.engine.sampler import argmax_rows

    assert argmax_rows(logits).tolist() == [77]  # the sampler's answer on the same row


def test_the_native_call_refuses_a_page_table_shorter_than_its_steps(loaded: Any) -> None:
    engine = _engine(loaded, 8)
    model = engine.runner.model
    pages = torch.tensor([[0, 1]])  # 32 tokens at page size 16
    with pytest.raises(RuntimeError, match="page table is too short"):
        model.decode_steps(torch.tensor([5]), torch.tensor([30]), pages, 16, [()], 3, engine.pool)
    with pytest.raises(RuntimeError, match="outside the pool"):
        model.decode_steps(torch.tensor([5]), torch.tensor([29]), torch.tensor([[0, -1]]), 16, [()], 3, engine.pool)
    with pytest.raises(RuntimeError, match="outside the pool"):
        outside = torch.tensor([[0, engine.pool.num_pages]])
        model.decode_steps(torch.tensor([5]), torch.tensor([29]), outside, 16, [()], 3, engine.pool)
    out = model.decode_steps(torch.tensor([5]), torch.tensor([29]), pages, 16, [()], 3, engine.pool)
    assert out.shape == (3, 1) and out.dtype == torch.long


def test_the_config_refuses_a_step_count_or_budget_that_is_not_positive() -> None:
    with pytest.raises(ConfigError, match="max_decode_steps"):
        SchedulerConfig(max_decode_steps=0)
    with pytest.raises(ConfigError, match="decode_steps_ms"):
        SchedulerConfig(decode_steps_ms=0)
    with pytest.raises(ConfigError, match="decode_steps_ms"):
        SchedulerConfig(decode_steps_ms=float("nan"))
