"""LLMEngine on a tiny random Llama: greedy tokens equal transformers' generate, and every
scheduling path (batching, chunked prefill, preemption, poisoned pages, prefill-only +
prefilled handoff) gives the same tokens; sampling, stop strings, aborts and bad input.
Pool conservation (`allocator.check()`, pages back to baseline) is checked after every scenario.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import ContextLengthExceededError, InvalidRequestError
from tests.helpers.engine import hf_greedy, make_engine, native_unavailable, prompts_of, run

MAX_NEW = 16


# the oracle tests run on both kernel paths: "auto" picks native wherever it builds, so the torch decode
# path (other devices and dtypes, batches above the native step's, --kernels torch) is named explicitly
KERNELS = pytest.mark.parametrize(
    "kernels",
    ["torch", pytest.param("native", marks=pytest.mark.skipif(bool(native_unavailable()), reason="no native build"))],
)


def count_native_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batch sizes of the one-call native decode steps run from now on (models.native_kernels)."""
    from kvfence.models import native_kernels

    calls: list[int] = []
    real = native_kernels.llama_decode_step

    def counted(weights: Any, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(ids.shape[0])
        return real(weights, ids, *args)

    monkeypatch.setattr(native_kernels, "llama_decode_step", counted)
    return calls


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [5, 17, 33, 1, 64, 9, 40, 23]


@pytest.fixture(scope="module")
def reference(hf_model: Any) -> list[list[int]]:
    """transformers generate, one prompt at a time: the oracle for every greedy test below."""
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts_of(LENGTHS)]


# --- greedy equals transformers -------------------------------------------------------------------------


@KERNELS
def test_batch_of_one_matches_transformers_generate(loaded: Any, reference: list[list[int]], kernels: str) -> None:
    engine = make_engine(loaded, kernels=kernels)
    for prompt, want in zip(prompts_of(LENGTHS)[:3], reference[:3], strict=True):
        assert run(engine, [prompt], GREEDY) == [want]


@KERNELS
def test_batch_of_eight_mixed_lengths_matches_transformers_generate(
    loaded: Any, reference: list[list[int]], kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(loaded, kernels=kernels)
    native_steps = count_native_steps(monkeypatch)
    assert run(engine, prompts_of(LENGTHS), GREEDY) == reference
    assert engine.resolved.kernels == kernels
    if kernels == "torch":
        assert engine.runner.context_cache.num_rebuilds > 0  # the steady decode steps used the context copies
        assert not native_steps
    else:
        # decode steps ran as one C++ call each (the first at each batch size, timing it), then several a call
        assert len(native_steps) > 0 and engine.num_multi_step_forwards > 0


@KERNELS
def test_chunked_prefill_on_and_off_give_the_same_tokens(loaded: Any, reference: list[list[int]], kernels: str) -> None:
    chunked = make_engine(loaded, kernels=kernels, chunked_prefill_size=8, max_num_batched_tokens=32)
    whole = make_engine(loaded, kernels=kernels, chunked_prefill_size=None, max_num_batched_tokens=2048)
    assert run(chunked, prompts_of(LENGTHS), GREEDY) == reference
    assert run(whole, prompts_of(LENGTHS), GREEDY) == reference


@KERNELS
def test_forced_preemption_gives_the_same_tokens(loaded: Any, reference: list[list[int]], kernels: str) -> None:
    # 16 pages of 8 tokens for 8 requests needing up to 10 pages each: preemption is unavoidable
    engine = make_engine(
        loaded, kernels=kernels, max_total_tokens=128, page_size=8, context_length=128, chunked_prefill_size=32
    )
    assert run(engine, prompts_of(LENGTHS), GREEDY) == reference
    assert engine.stats().num_preemptions > 0


@KERNELS
def test_pages_full_of_nan_poison_change_nothing(loaded: Any, reference: list[list[int]], kernels: str) -> None:
    """Every slot attention reads was written for the reading request; stale/poisoned bytes never leak in."""
    engine = make_engine(loaded, kernels=kernels, page_size=8, chunked_prefill_size=8, max_num_batched_tokens=40)
    engine.pool.poison(range(engine.pool.num_pages))
    assert run(engine, prompts_of(LENGTHS), GREEDY) == reference


@KERNELS
def test_requests_joining_mid_run_get_the_same_tokens(loaded: Any, reference: list[list[int]], kernels: str) -> None:
    engine = make_engine(loaded, kernels=kernels, max_num_batched_tokens=48, chunked_prefill_size=16)
    prompts = prompts_of(LENGTHS)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step, while others decode
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", sampling_params=GREEDY, prompt_token_ids=p)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.scheduler.check()
    assert [out[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


# --- disaggregation hooks: prefill-only on one engine, prefilled decode on another -----------------------


def test_prefill_only_then_prefilled_decode_equals_aggregated(loaded: Any, reference: list[list[int]]) -> None:
    # no prefix cache on prefill: `release` then gives back every page the request held
    prefill = make_engine(loaded, page_size=8, enable_prefix_caching=False)
    decode = make_engine(loaded, page_size=8)
    decode.pool.poison(range(decode.pool.num_pages))  # any page not copied over would show up as NaN
    prompts = prompts_of(LENGTHS)
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", sampling_params=GREEDY, prompt_token_ids=p, prefill_only=True)
    firsts: dict[str, int] = {}
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            assert o.finished and o.finish_reason == "prefill_done" and len(o.new_token_ids) == 1
            firsts[o.request_id] = o.new_token_ids[0]
    assert prefill.stats().num_held == len(prompts)
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        src = prefill.held_pages(rid)
        dst = decode.reserve(rid, len(p))
        assert dst is not None and len(dst) == len(src) == -(-len(p) // 8)
        for s, d in zip(src, dst, strict=True):
            decode.pool.write_page(d, prefill.pool.read_page(s))
        assert prefill.release(rid) == src
        decode.add_prefilled_request(rid, p, firsts[rid], GREEDY, page_table=dst)
    assert prefill.scheduler.num_free_pages == prefill.allocator.num_pages
    out: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        decode.scheduler.check()
    assert [out[f"r{i}"] for i in range(len(prompts))] == reference
    assert decode.scheduler.num_free_pages == decode.allocator.num_pages


def test_report_pending_gives_a_prefilled_first_token_without_a_forward(loaded: Any, monkeypatch) -> None:
    engine = make_engine(loaded, page_size=8)
    prompt = prompts_of([20])[0]
    engine.reserve("a", len(prompt))
    engine.add_prefilled_request("a", prompt, 7, dataclasses.replace(GREEDY, max_tokens=3))
    real_execute = engine.runner.execute

    def no_forward(*args: Any) -> Any:
        raise AssertionError("report_pending ran the model")

    monkeypatch.setattr(engine.runner, "execute", no_forward)
    (first,) = engine.report_pending()
    assert (first.request_id, first.new_token_ids, first.finished) == ("a", [7], False)
    assert engine.report_pending() == []  # reported once
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    rest = [t for o in engine.step() for t in o.new_token_ids]
    assert len(rest) == 1  # the next step brings only the second token, not the first again
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


def test_reserve_refuses_when_the_pool_is_short_and_release_undoes_it(loaded: Any) -> None:
    engine = make_engine(loaded, max_total_tokens=2048, page_size=16)  # 128 pages
    assert engine.reserve("a", 2000) is not None  # 125 pages
    assert engine.reserve("b", 100) is None  # 7 pages needed, 3 free
    assert len(engine.release("a")) == 125 and engine.allocator.num_free == 128
    engine.scheduler.check()


def test_a_prefill_only_request_needs_room_for_its_prompt_and_first_token_only(loaded: Any) -> None:
    """Prefill of a disaggregated pair never holds the output: its max_tokens are decode's pool's business."""
    engine = make_engine(loaded, max_total_tokens=128, page_size=16, context_length=128)
    params = SamplingParams(max_tokens=100, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="do not fit in the KV pool of 128"):
        engine.add_request("whole", prompt_token_ids=list(range(1, 101)), sampling_params=params)
    engine.add_request("prefill", prompt_token_ids=list(range(1, 101)), sampling_params=params, prefill_only=True)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["prefill_done"]
    with pytest.raises(InvalidRequestError, match="first token do not fit"):
        engine.add_request("long", prompt_token_ids=list(range(1, 129)), sampling_params=params, prefill_only=True)
    engine.release("prefill")
    engine.scheduler.check()


def test_prefilled_request_with_wrong_page_table_is_refused(loaded: Any) -> None:
    engine = make_engine(loaded)
    pages = engine.reserve("a", 20)
    with pytest.raises(InvalidRequestError, match="does not match"):
        engine.add_prefilled_request("a", list(range(10, 30)), 5, GREEDY, page_table=list(reversed(pages)))
    engine.release("a")
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


# --- sampling, stop strings, text -----------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_alone_or_batched(loaded: Any) -> None:
    prompts = prompts_of([12, 30, 7])
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, ignore_eos=True)
    sp = [SamplingParams(seed=s, **kw) for s in (1, 2, 3)]
    batched = run(make_engine(loaded), prompts, sp)
    alone = [run(make_engine(loaded), [p], [s])[0] for p, s in zip(prompts, sp, strict=True)]
    assert batched == alone
    other_seed = SamplingParams(seed=99, **kw)
    assert run(make_engine(loaded), [prompts[0]], other_seed)[0] != alone[0]


def test_text_deltas_join_to_the_decoded_tokens(loaded: Any) -> None:
    engine = make_engine(loaded)
    (c,) = engine.generate(["the cache page is"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(c.token_ids) == 20 and c.finish_reason == "length"
    assert c.text == loaded.tokenizer.decode(c.token_ids)


def test_stop_string_is_cut_from_the_text_and_finishes_the_request(loaded: Any) -> None:
    engine = make_engine(loaded)
    prompt = "the cache page is"
    (full,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    first = full.text.find(stop)
    (c,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:first]
    assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < 20
    assert loaded.tokenizer.decode(c.token_ids).startswith(c.text + stop)
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


def test_stop_token_id_and_eos(loaded: Any) -> None:
    engine = make_engine(loaded)
    (full,) = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_id = full.token_ids[5]
    (c,) = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))
    k = full.token_ids.index(stop_id)
    assert c.finish_reason == "stop" and c.stop_reason == stop_id and c.token_ids == full.token_ids[: k + 1]
    eos = next(iter(loaded.tokenizer.eos_token_ids))
    engine.scheduler.eos_token_ids = frozenset([stop_id])  # pretend it is an eos token
    (e,) = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12))
    assert e.finish_reason == "stop" and e.token_ids == full.token_ids[: k + 1]
    (i,) = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert i.token_ids == full.token_ids and eos is not None


# --- abort and bad input --------------------------------------------------------------------------------


def test_abort_at_any_time_frees_pages(loaded: Any) -> None:
    engine = make_engine(loaded, max_num_batched_tokens=32, chunked_prefill_size=16)
    for i, p in enumerate(prompts_of([40, 40, 40, 5])):
        engine.add_request(f"r{i}", sampling_params=GREEDY, prompt_token_ids=p)
    engine.step()  # r0 mid-prefill, the rest waiting
    assert engine.abort_request("r0") and engine.abort_request("r3")
    engine.scheduler.check()
    for _ in range(5):
        engine.step()
    assert engine.abort_request("r1")  # decoding now
    assert not engine.abort_request("r1") and not engine.abort_request("nope")
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "r2" for o in outs)
        engine.scheduler.check()
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_bad_requests_raise_clear_errors(loaded: Any) -> None:
    engine = make_engine(loaded, max_total_tokens=4096)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("a", "")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("a", prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("a", "hi", SamplingParams(max_tokens=0))
    with pytest.raises(ContextLengthExceededError, match="3000 tokens but the context length is 2048"):
        engine.add_request("a", prompt_token_ids=[5] * 3000)
    with pytest.raises(InvalidRequestError, match="do not fit in the KV pool of 4096 tokens"):
        engine.add_request("a", prompt_token_ids=[5] * 100, sampling_params=SamplingParams(max_tokens=5000))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("a", prompt_token_ids=[5, 10**6])
    engine.add_request("a", "hi")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", "hi")
    engine.abort_request("a")
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages


def test_prompt_of_exactly_the_context_length_gets_one_token(loaded: Any) -> None:
    engine = make_engine(loaded, context_length=64)
    (c,) = engine.generate([[7] * 64], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(c.token_ids) == 1 and c.finish_reason == "length"


def test_stats_count_requests_and_pages(loaded: Any) -> None:
    engine = make_engine(loaded, max_total_tokens=1024, page_size=16, context_length=1024, max_num_seqs=1)
    engine.add_request("a", prompt_token_ids=[5] * 20, sampling_params=GREEDY)
    engine.add_request("b", prompt_token_ids=[5] * 20, sampling_params=GREEDY)
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_pages) == (1, 1, 64)
    assert s.num_used_pages == 2 and s.num_free_pages == 62
