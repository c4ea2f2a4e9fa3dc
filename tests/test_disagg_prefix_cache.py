"""Disaggregated serving with the prefix cache on the prefill role (one process, local transport, real tiny
model): a request whose prompt prefill partly serves from its cache still hands decode every page of the prompt
with its digest, decode verifies it like any other, and the output equals the aggregated engine's; a byte
corrupted in flight on a reused page is caught by decode and leaves the cached page itself intact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg.router import RouterConfig
from kvfence.engine.engine_client import GenerationChunk
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.faults import FaultInjector
from tests.helpers.inprocess import InProcessDeployment

PAGE = 16


def cfg(loaded: Any, prefix_caching: bool) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(loaded.model_dir)),
        CacheConfig(page_size=PAGE, max_total_tokens=1024, enable_prefix_caching=prefix_caching),
        context_length=256,
    )


def deploy(loaded: Any, faults: Any = None) -> InProcessDeployment:
    return InProcessDeployment(
        cfg(loaded, True),
        cfg(loaded, False),
        RouterConfig(handoff_deadline_s=30.0, request_timeout_s=60),
        loaded=loaded,
        model_fingerprint="test-model",
        strict=True,  # prefill poisons the pages it frees: never the shared cached ones
        faults=faults,
    )


def run_one(dep: InProcessDeployment, rid: str, prompt: list[int], sp: SamplingParams) -> list[GenerationChunk]:
    async def main() -> list[GenerationChunk]:
        return [c async for c in dep.router.generate(rid, prompt, sp)]

    return asyncio.run(main())


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False, cache_salt="tenant")
rng = random.Random(3)
SHARED = [rng.randrange(10, 2000) for _ in range(48)]
PROMPTS = {rid: SHARED + [rng.randrange(10, 2000) for _ in range(7)] for rid in ("a", "b", "c")}


def reference(loaded: Any) -> dict[str, list[int]]:
    engine = LLMEngine(cfg(loaded, False), loaded=loaded)
    outs = engine.generate(list(PROMPTS.values()), dataclasses.replace(SP, cache_salt=None))
    return {rid: o.token_ids for rid, o in zip(PROMPTS, outs, strict=True)}


def assert_pools(dep: InProcessDeployment) -> None:
    assert dep.wait_idle(15), (dep.prefill.stats(), dep.decode.stats())
    dep.prefill_engine.scheduler.check()  # allocator + cache conservation, refcounts = readers (none now)
    pc = dep.prefill_engine.prefix_cache
    assert pc is not None and pc.num_evictable == pc.num_cached  # nobody reads a cached page any more
    a = dep.prefill_engine.allocator
    assert a.num_free + pc.num_cached == a.num_pages
    dep.decode_engine.allocator.check()
    assert dep.decode_engine.allocator.num_free == dep.decode_engine.allocator.num_pages
    assert not dep.errors


def test_prefill_reuses_cached_pages_and_decode_verifies_them(loaded: Any) -> None:
    want = reference(loaded)
    with deploy(loaded) as dep:
        got = {rid: run_one(dep, rid, p, SP) for rid, p in PROMPTS.items()}  # one after another: b, c hit a's pages
        assert_pools(dep)
        stats = dep.prefill_engine.stats()
    assert stats.prefix_cache_hits == 2 * 3 * PAGE  # 48 shared tokens = 3 pages, for b and c
    for rid in PROMPTS:
        assert tokens(got[rid]) == want[rid]
        record = got[rid][-1].integrity
        assert record is not None and record["status"] == "verified"


def test_a_corrupted_reused_page_in_flight_is_caught_and_the_cache_stays_good(loaded: Any) -> None:
    want = reference(loaded)
    faults = FaultInjector().enable("corrupt_byte", request_id="b", page=1)  # page 1 of b is a reused page
    with deploy(loaded, faults=faults) as dep:
        got = {rid: run_one(dep, rid, p, SP) for rid, p in PROMPTS.items()}
        assert_pools(dep)
        stats = dep.prefill_engine.stats()
    assert faults.fired["corrupt_byte"] >= 1
    bad = got["b"][-1].integrity
    assert got["b"][-1].finish_reason == "error" and bad is not None and bad["status"] != "verified"
    assert stats.prefix_cache_hits == 2 * 3 * PAGE and stats.prefix_cache_corrupt == 0
    for rid in ("a", "c"):  # c read the same cached pages after b's failed handoff: still right
        record = got[rid][-1].integrity
        assert tokens(got[rid]) == want[rid] and record is not None and record["status"] == "verified"


def test_a_cached_page_corrupted_in_prefills_pool_is_not_served_and_outputs_stay_right(loaded: Any) -> None:
    from kvfence.kv.prefix_cache import CACHE_OWNER

    want = reference(loaded)
    with deploy(loaded) as dep:
        first = run_one(dep, "a", PROMPTS["a"], SP)
        assert dep.wait_idle(15)
        cached = dep.prefill_engine.allocator.pages_of(CACHE_OWNER)
        assert cached
        for p in cached:  # every cached page changes under the cache (a stray write, a bad DIMM)
            dep.prefill_engine.pool.tensors[0]["k"][p].add_(0.5)
        rest = {rid: run_one(dep, rid, PROMPTS[rid], SP) for rid in ("b", "c")}
        assert_pools(dep)
        stats = dep.prefill_engine.stats()
    assert stats.prefix_cache_corrupt >= 1
    for rid, chunks in {"a": first, **rest}.items():
        record = chunks[-1].integrity
        assert tokens(chunks) == want[rid] and record is not None and record["status"] == "verified"


def test_strict_prefill_poisons_cached_pages_when_it_evicts_them(loaded: Any) -> None:
    from kvfence.kv.prefix_cache import CACHE_OWNER

    with deploy(loaded) as dep:  # strict
        run_one(dep, "a", PROMPTS["a"], SP)
        assert dep.wait_idle(15)
        engine = dep.prefill_engine
        cached = engine.allocator.pages_of(CACHE_OWNER)
        assert cached and not engine.pool.tensors[0]["k"][cached].isnan().any()  # live cache: never poisoned
        assert engine.prefix_cache is not None and engine.prefix_cache.clear() == len(cached)
        assert engine.pool.tensors[0]["k"][cached].isnan().all()  # evicted: wiped before reuse, as a request's are
        engine.scheduler.check()
        assert engine.allocator.num_free == engine.allocator.num_pages
