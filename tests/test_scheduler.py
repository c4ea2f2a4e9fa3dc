"""Scheduler: token budget, chunked prefill, page growth, preemption, stop rules and disaggregation hooks.

The unit tests drive `Scheduler` directly with made-up sampled tokens. The end-to-end
tests at the bottom run `LLMEngine` over `PoolEchoModel`, a fake model that follows the
registry contract and computes each next token from the context it reads back out of
the KV pool, so a wrong page, slot or mask changes the tokens (and a stale slot trips
an assertion). It is fast enough to run many scheduling scenarios in a second.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import Request, RequestStatus
from kvfence.engine.runner import DecodeContextCache
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.scheduler import Scheduler, SchedulerOutput
from kvfence.errors import InvalidRequestError
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.models.attention import gather_context, paged_attention, store_kv
from kvfence.models.forward_batch import ForwardBatch, SeqChunk, build_forward_batch

PAGE = 4


def _sched(num_pages: int = 64, context_length: int = 1000, eos: tuple[int, ...] = (), **cfg: Any) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("chunked_prefill_size", 16)
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages), PAGE, context_length, eos)


def _req(rid: str, n: int = 5, **params: Any) -> Request:
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 100)
    return Request(rid, list(range(1, n + 1)), SamplingParams(**params))


def _run(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step with a fake forward that samples `token` for every chunk that samples."""
    out = s.schedule()
    s.update_from_output(out, [token if c.sample else None for c in out.chunks])
    s.allocator.check()
    return out


def _owned_pages_match(s: Scheduler) -> None:
    for r in s.running + list(s.waiting):
        assert s.allocator.pages_of(r.request_id) == r.page_table, r


# --- budget and chunking ------------------------------------------------------------------------------


def test_prefill_is_chunked_and_only_the_last_chunk_samples() -> None:
    s = _sched(chunked_prefill_size=16)
    r = _req("a", 40)
    s.add_request(r)
    sizes, samples = [], []
    for _ in range(3):
        out = _run(s)
        sizes += [c.num_tokens for c in out.chunks]
        samples += [c.sample for c in out.chunks]
    assert sizes == [16, 16, 8] and samples == [False, False, True]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 40
    assert len(r.page_table) == 10  # 40 tokens / page 4


def test_step_token_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    s = _sched(max_num_batched_tokens=20, chunked_prefill_size=16)
    for i in range(3):
        s.add_request(_req(f"d{i}", 3))
    _run(s)  # three short prefills
    s.add_request(_req("long", 50))
    out = _run(s)
    assert [c.num_tokens for c in out.chunks] == [1, 1, 1, 16]
    assert out.num_batched_tokens <= 20
    out = _run(s)  # 3 decodes + the rest of the budget (17) capped at the chunk size 16
    assert [c.num_tokens for c in out.chunks] == [1, 1, 1, 16]


def test_without_chunking_a_prompt_waits_until_it_fits_whole() -> None:
    s = _sched(max_num_batched_tokens=32, chunked_prefill_size=None)
    s.add_request(_req("a", 20))
    s.add_request(_req("b", 20))
    out = _run(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 20)]
    out = _run(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 20)]


def test_max_num_seqs_limits_running_requests() -> None:
    s = _sched(max_num_seqs=2)
    for i in range(4):
        s.add_request(_req(f"r{i}", 2))
    _run(s)
    assert s.num_running == 2 and s.num_waiting == 2


def test_pages_grow_on_demand_one_page_per_page_size_tokens() -> None:
    s = _sched()
    r = _req("a", 4)  # exactly one page
    s.add_request(r)
    _run(s)
    assert len(r.page_table) == 1
    _run(s)  # decode of token 5 needs a second page
    assert len(r.page_table) == 2
    for _ in range(3):
        _run(s)
    assert r.num_computed_tokens == 8 and len(r.page_table) == 2
    _owned_pages_match(s)


# --- preemption ---------------------------------------------------------------------------------------


def test_when_pages_run_out_the_most_recently_admitted_request_is_preempted() -> None:
    s = _sched(num_pages=5)
    a, b = _req("a", 8), _req("b", 8)  # two pages each after prefill
    s.add_request(a)
    s.add_request(b)
    _run(s)
    assert s.allocator.num_free == 1
    _run(s)  # a's 9th token takes the last page; b then needs one more page -> b (admitted last) preempted
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.PREEMPTED
    assert s.allocator.pages_of("b") == [] and b.page_table == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and b.num_preemptions == 1 and s.num_preemptions == 1
    assert b.num_output_tokens == 1  # its sampled token is kept and will be recomputed


def test_preempted_request_recomputes_prompt_and_outputs_before_sampling_again() -> None:
    s = _sched(num_pages=5, max_num_batched_tokens=64)
    a, b = _req("a", 8, max_tokens=2), _req("b", 8)
    s.add_request(a)
    s.add_request(b)
    _run(s)
    _run(s)  # b preempted, a finishes (max_tokens=2) and frees its pages
    assert a.finish_reason == "length" and b.status is RequestStatus.PREEMPTED
    out = _run(s)
    (chunk,) = out.chunks
    assert chunk.request is b and chunk.start == 0 and chunk.num_tokens == 9 and chunk.sample
    assert b.num_output_tokens == 2


def test_a_request_alone_that_cannot_grow_preempts_itself() -> None:
    s = _sched(num_pages=3)
    r = _req("a", 8)
    s.add_request(r)
    _run(s)
    s.allocator.allocate("someone-else", 1)  # pages taken outside the scheduler
    _run(s)  # token 9 needs a third page; nobody else to preempt
    assert r.status is RequestStatus.PREEMPTED and s.allocator.num_free == 2


# --- stop rules ---------------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length_and_frees_pages() -> None:
    s = _sched()
    r = _req("a", 5, max_tokens=3)
    s.add_request(r)
    for _ in range(3):
        _run(s)
    assert r.finish_reason == "length" and r.num_output_tokens == 3
    assert s.allocator.num_free == 64 and not s.has_unfinished()


def test_eos_stops_unless_ignore_eos() -> None:
    s = _sched(eos=(7,))
    r, keep = _req("a"), _req("b", ignore_eos=True)
    s.add_request(r)
    s.add_request(keep)
    _run(s, token=7)
    assert r.finish_reason == "stop" and r.stop_reason == 7
    assert keep.status is RequestStatus.RUNNING


def test_stop_token_ids_stop() -> None:
    s = _sched()
    r = _req("a", stop_token_ids=[9])
    s.add_request(r)
    _run(s, token=3)
    _run(s, token=9)
    assert r.finish_reason == "stop" and r.stop_reason == 9 and r.output_token_ids == [3, 9]


def test_context_length_finishes_with_length() -> None:
    s = _sched(context_length=7)
    r = _req("a", 5)
    s.add_request(r)
    _run(s)
    assert not r.is_finished
    _run(s)
    assert r.finish_reason == "length" and r.num_tokens == 7


# --- abort --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_frees_pages_in_every_state(when: str) -> None:
    s = _sched(num_pages=5, chunked_prefill_size=4)
    r = _req("a", 8)
    s.add_request(r)
    if when in ("prefilling", "decoding"):
        _run(s)
    if when == "decoding":
        _run(s)
        _run(s)
        assert r.num_output_tokens == 2  # two prefill chunks of 4, then one decode
    if when == "preempted":
        s.allocator.allocate("hog", 4)
        _run(s)  # 1 page holds the first chunk; the hog leaves nothing for the second
        _run(s)
        assert r.status is RequestStatus.PREEMPTED
        s.allocator.free("hog")
    assert s.abort_request("a")
    assert r.finish_reason == "abort" and s.allocator.num_free == 5 and not s.has_unfinished()
    s.allocator.check()
    assert not s.abort_request("a")


# --- disaggregation hooks -----------------------------------------------------------------------------


def test_prefill_only_request_finishes_as_prefill_done_and_keeps_its_pages_until_release() -> None:
    s = _sched()
    r = Request("p", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=50), prefill_only=True)
    s.add_request(r)
    _run(s)
    assert r.finish_reason == "prefill_done" and r.output_token_ids == [7]
    assert s.allocator.pages_of("p") == r.page_table and len(r.page_table) == 3  # 10 prompt tokens
    assert not s.has_unfinished() and "p" in s.held
    assert s.release("p") is not None and s.allocator.num_free == 64 and "p" not in s.held


def test_release_with_quarantine_keeps_pages_out_of_circulation() -> None:
    s = _sched()
    r = Request("p", [1, 2, 3, 4, 5], SamplingParams(temperature=0), prefill_only=True)
    s.add_request(r)
    _run(s)
    pages = s.release("p", quarantine=True)
    assert pages and s.allocator.num_quarantined == len(pages) and s.allocator.num_free == 64 - len(pages)
    s.allocator.release_quarantine("p")
    assert s.allocator.num_free == 64


def test_reserve_returns_none_when_the_pool_is_short() -> None:
    s = _sched(num_pages=3)
    assert s.reserve("x", 13) is None  # 4 pages
    pages = s.reserve("x", 12)
    assert pages is not None and len(pages) == 3 and s.allocator.pages_of("x") == pages


def test_reserved_ids_cannot_be_reused() -> None:
    s = _sched()
    s.reserve("x", 4)
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request(_req("x"))


def test_prefilled_request_decodes_from_its_reserved_pages() -> None:
    s = _sched()
    pages = s.reserve("d", 10)
    r = s.add_prefilled(_req("d", 10), first_token=42)
    assert r.output_token_ids == [42] and r.num_computed_tokens == 10 and r.page_table == pages
    out = _run(s)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.sample) == (10, 1, True)
    assert r.output_token_ids == [42, 7] and r.page_table == pages  # token 11 still fits page 3


def test_prefilled_request_finished_by_its_first_token_frees_the_reservation() -> None:
    s = _sched(eos=(42,))
    s.reserve("d", 10)
    r = s.add_prefilled(_req("d", 10), first_token=42)
    assert r.finish_reason == "stop" and s.allocator.num_free == 64 and not s.has_unfinished()


def test_prefilled_request_needs_a_big_enough_reservation() -> None:
    s = _sched()
    s.reserve("d", 4)
    with pytest.raises(InvalidRequestError, match="reserved pages for 4 tokens"):
        s.add_prefilled(_req("d", 10), first_token=1)
    with pytest.raises(InvalidRequestError, match="no reserved pages"):
        s.add_prefilled(_req("e", 10), first_token=1)


# --- end to end over a fake model that reads its context back from the pool -----------------------------

V = 97


class PoolEchoModel(torch.nn.Module):
    """Registry-contract model whose next token is a hash of the context read back from the pool."""

    @classmethod
    def kv_layout(cls, hf_config: Any, page_size: int, dtype: torch.dtype) -> KVLayout:
        return KVLayout("PoolEcho", 1, (KVBufferSpec("tok", (2,)),), page_size, dtype)

    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        cache = pool.flat(0, "tok")  # [S, 2]: (token id, position + 1)
        new = torch.stack([fb.input_ids.float(), (fb.positions + 1).float()], dim=1)  # [T, 2]
        cache.index_copy_(0, fb.slot_mapping, new)
        ctx = cache[fb.kv_slots]  # [B, K, 2]
        B, K = fb.kv_slots.shape
        real = torch.arange(K)[None, :] < fb.kv_lens[:, None]  # [B, K]
        # every context slot must hold the token written for that very position (right page, no stale slot)
        assert torch.equal(ctx[..., 1][real], (torch.arange(K) + 1).expand(B, K)[real].float())
        weight = ctx[..., 0] * (ctx[..., 1] % 13 + 1)  # [B, K]
        mask = fb.attn_mask[:, 0].float()  # [B, Q, K]
        h = (mask * weight[:, None, :]).sum(-1) + mask.sum(-1) * 5  # [B, Q]
        rows = h[fb.q_valid][fb.logits_index].long() % V  # [N]
        logits = torch.zeros(rows.shape[0], V)
        logits[torch.arange(rows.shape[0]), rows] = 1.0
        return logits


class CharTokenizer:
    """a..z for ids 0..25 (and modulo beyond); eos is id 0 when asked."""

    def __init__(self, eos: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = frozenset(eos)

    def encode(self, text: str) -> list[int]:
        return [(ord(c) - 97) % V for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def fake_loaded(context_length: int = 256, tokenizer: Any = None) -> SimpleNamespace:
    return SimpleNamespace(
        model=PoolEchoModel(),
        hf_config=SimpleNamespace(vocab_size=V),
        tokenizer=tokenizer,
        context_length=context_length,
        kv_layout=lambda page_size, dtype: PoolEchoModel.kv_layout(None, page_size, dtype),
    )


def fake_engine(
    max_total_tokens: int = 4096, page_size: int = PAGE, tokenizer: Any = None, context_length: int = 256, **sched: Any
) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig("fake"),
        cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(**sched),
    )
    return LLMEngine(cfg, loaded=fake_loaded(context_length, tokenizer))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(0, V, (n_i,), generator=g).tolist() for n_i in lengths]


def _run_all(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    """Run to completion, checking pool conservation after every step."""
    free0 = engine.scheduler.num_free_pages
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        engine.add_request(f"r{i}", sampling_params=sp, prompt_token_ids=p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.scheduler.check()
    assert engine.scheduler.num_free_pages == free0
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_fake_model_outputs_do_not_depend_on_batching_chunking_or_preemption() -> None:
    prompts = _prompts(8)
    alone = [_run_all(fake_engine(), [p])[0] for p in prompts]
    batched = _run_all(fake_engine(chunked_prefill_size=None), prompts)
    chunked = _run_all(fake_engine(chunked_prefill_size=7, max_num_batched_tokens=24), prompts)
    tiny = fake_engine(max_total_tokens=84, context_length=84, chunked_prefill_size=8)  # 21 pages: preemptions
    preempted = _run_all(tiny, prompts)
    assert tiny.stats().num_preemptions > 0
    assert batched == alone and chunked == alone and preempted == alone
    assert all(len(o) == 20 for o in alone) and len({tuple(o) for o in alone}) == 8


def test_engine_requests_join_and_leave_between_steps() -> None:
    e = fake_engine()
    sp = SamplingParams(temperature=0, max_tokens=3)
    e.add_request("a", sampling_params=sp, prompt_token_ids=[1, 2, 3])
    e.step()
    e.add_request("b", sampling_params=sp, prompt_token_ids=[4, 5])
    outs = {o.request_id: o for o in e.step()}
    assert set(outs) == {"a", "b"} and e.stats().num_running == 2
    e.step()
    outs = {o.request_id: o for o in e.step()}
    assert outs["b"].finished and not e.has_unfinished_requests()


# --- the forward batch the runner builds: vectorised layout == per-sequence reference -------------------


def _reference_layout(chunks: list[SeqChunk], page_size: int) -> dict[str, torch.Tensor]:
    """The per-sequence definition of a forward's layout (what build_forward_batch must vectorise)."""
    B, Q = len(chunks), max(len(c.token_ids) for c in chunks)
    K = max(c.start + len(c.token_ids) for c in chunks)
    ids, pos, slot_map, logits_rows = [], [], [], []
    q_index, q_valid = torch.zeros(B, Q, dtype=torch.long), torch.zeros(B, Q, dtype=torch.bool)
    kv_slots, mask = torch.zeros(B, K, dtype=torch.long), torch.zeros(B, Q, K, dtype=torch.bool)
    for b, c in enumerate(chunks):
        slots = [p * page_size + o for p in c.page_table for o in range(page_size)]
        row0, n, total = len(ids), len(c.token_ids), c.start + len(c.token_ids)
        ids += c.token_ids
        pos += range(c.start, total)
        slot_map += slots[c.start : total]
        kv_slots[b, :total] = torch.tensor(slots[:total])
        for i in range(n):
            q_index[b, i], q_valid[b, i] = row0 + i, True
            mask[b, i, : c.start + i + 1] = True
        mask[b, n:, 0] = True
        logits_rows += {"last": [row0 + n - 1], "all": list(range(row0, row0 + n)), "none": []}[c.logits]
    return {
        "input_ids": torch.tensor(ids),
        "positions": torch.tensor(pos),
        "slot_mapping": torch.tensor(slot_map),
        "q_index": q_index,
        "q_valid": q_valid,
        "kv_slots": kv_slots,
        "attn_mask": mask[:, None],
        "logits_index": torch.tensor(logits_rows, dtype=torch.long),
    }


_chunk_spec = st.tuples(
    st.integers(0, 40), st.integers(1, 20), st.integers(0, 2), st.sampled_from(["last", "all", "none"])
)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(_chunk_spec, min_size=1, max_size=5), page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99)
)
def test_forward_batch_matches_the_per_sequence_reference(
    specs: list[tuple[int, int, int, str]], page_size: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    pool_pages = torch.randperm(400, generator=g).tolist()
    chunks = []
    for start, n, extra_pages, logits in specs:
        need = -(-(start + n) // page_size) + extra_pages  # page tables may hold more pages than needed
        table, pool_pages = pool_pages[:need], pool_pages[need:]
        chunks.append(SeqChunk(torch.randint(0, 1000, (n,), generator=g).tolist(), start, table, logits))
    fb = build_forward_batch(chunks, page_size)
    for name, want in _reference_layout(chunks, page_size).items():
        assert torch.equal(getattr(fb, name), want), name
    # the fast mask forms mean the same as the boolean mask
    if fb.mask_mode == "bias":
        assert torch.equal(fb.attn_bias == 0, fb.attn_mask)
    elif fb.mask_mode == "none":
        assert bool(fb.attn_mask.all())
    elif fb.mask_mode == "causal":
        Q = fb.attn_mask.shape[-1]
        assert torch.equal(fb.attn_mask, torch.ones(Q, Q, dtype=torch.bool).tril().expand_as(fb.attn_mask))


@pytest.mark.parametrize(
    "chunks",
    [
        [SeqChunk([1], 9, [3, 1, 4]), SeqChunk([2], 9, [5, 9, 2])],  # equal decode: no mask
        [SeqChunk([1], 9, [3, 1, 4]), SeqChunk([2], 3, [5])],  # ragged decode
        [SeqChunk([1, 2, 3], 0, [7]), SeqChunk([4, 5, 6], 0, [8])],  # equal fresh prompts: causal
        [SeqChunk([1, 2, 3, 4, 5], 6, [3, 1, 4]), SeqChunk([2], 3, [5])],  # chunk after context + decode
    ],
)
def test_paged_attention_fast_paths_equal_the_boolean_mask_path(chunks: list[SeqChunk]) -> None:
    fb = build_forward_batch(chunks, 4)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    q = torch.randn(fb.num_tokens, 4, 8, generator=g)
    slow = dataclasses.replace(fb, mask_mode="mask", kv_pages=None)
    got = paged_attention(q, k_cache, v_cache, fb, 0.3)
    want = paged_attention(q, k_cache, v_cache, slow, 0.3)
    assert got.shape == (fb.num_tokens, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- the runner's decode context cache: same context as a fresh gather, built only for steady batches ---


def test_decode_context_cache_equals_a_fresh_gather_and_rebuilds_on_change() -> None:
    g = torch.Generator().manual_seed(0)
    page = 4
    cache = torch.full((64 * page, 2, 8), float("nan"))  # [S, Hkv, D] flat pool view; unwritten slots are NaN
    reqs = tuple(Request(f"r{i}", [1] * n, SamplingParams()) for i, n in enumerate([5, 9, 2]))
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    lens = [5, 9, 2]
    cc = DecodeContextCache(bytes_per_token=1)
    used = []
    for step in range(6):
        if step == 4:  # the batch changes: one request leaves
            reqs, tables, lens = reqs[:2], tables[:2], lens[:2]
        chunks = [SeqChunk([3], n, t) for n, t in zip(lens, tables, strict=True)]
        fb = build_forward_batch(chunks, page)
        if step == 0:  # context written by earlier steps
            for n, t in zip(lens, tables, strict=True):
                for pos in range(n):
                    cache[t[pos // page] * page + pos % page] = torch.randn(2, 8, generator=g)
        use = cc.prepare(reqs, fb)
        used.append(use)
        # this step's K, stored first; into the copies too once they exist
        store_kv(cache, torch.randn(fb.num_tokens, 2, 8, generator=g), dataclasses.replace(fb, context_cache=cc))
        want = gather_context(cache, fb).transpose(1, 2)  # [B, Hkv, K, D], zero past each length
        if use:
            got = cc.context(cache, fb)
            assert torch.equal(got, want), step
        assert not want.isnan().any()
        lens = [n + 1 for n in lens]
    assert used == [False, True, True, True, False, True]
    assert cc.num_rebuilds == 2


def test_decode_context_cache_capacity_doubles_when_the_budget_allows() -> None:
    reqs = tuple(Request(f"r{i}", [1] * 100, SamplingParams()) for i in range(2))
    tables = [list(range(0, 30)), list(range(30, 60))]

    def steady(cc: DecodeContextCache, n: int) -> bool:
        cc.prepare(reqs, build_forward_batch([SeqChunk([3], n, t) for t in tables], 4))
        return cc.prepare(reqs, build_forward_batch([SeqChunk([3], n + 1, t) for t in tables], 4))

    roomy = DecodeContextCache(bytes_per_token=1)  # default budget: 2 x 102 tokens, rounded to 64
    assert steady(roomy, 100) and roomy.cap == 256
    tight = DecodeContextCache(bytes_per_token=1, max_bytes=2 * 192)  # only K + 32 fits
    assert steady(tight, 100) and tight.cap == 192
    none = DecodeContextCache(bytes_per_token=1, max_bytes=2 * 64)  # not even that: attention gathers
    assert not steady(none, 100) and none.cap == 0 and not none.bufs
