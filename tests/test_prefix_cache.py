"""The prefix cache on a tiny random Llama: pages are shared only under the same cache_salt, a corrupted cached
page is found and recomputed, eviction never frees a page a request reads, greedy outputs with the cache equal
those without it and transformers', and conservation (allocator + cache + refcounts) holds after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import InvalidRequestError
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.prefix_cache import CACHE_OWNER, PrefixCache, chain_keys

PAGE = 8
NEW = 6


def make_engine(
    loaded: Any, cache: bool = True, max_total_tokens: int | None = None, context_length: int | None = None
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(loaded.model_dir), kernels="torch"),
        cache=CacheConfig(page_size=PAGE, max_total_tokens=max_total_tokens, enable_prefix_caching=cache),
        context_length=context_length,
    )
    return LLMEngine(config, loaded=loaded)


def greedy(salt: str | None = None, n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, cache_salt=salt)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> tuple[list[int], list[int]]:
    """(output tokens, the page table the request read at its first forward), checking conservation every step."""
    engine.add_request(rid, sampling_params=params, prompt_token_ids=ids)
    out: list[int] = []
    table: list[int] = []
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests.get(rid)
        for o in engine.step():
            out += o.new_token_ids
        if not table and req is not None:
            table = list(req.page_table)
        engine.scheduler.check()
    return out, table


def test_same_salt_shares_pages_and_output_is_unchanged(loaded: Any) -> None:
    engine = make_engine(loaded)
    ids = prompt(40)
    first, t1 = run(engine, "a", ids, greedy("tenant-1"))
    second, t2 = run(engine, "b", ids, greedy("tenant-1"))
    assert second == first
    # 40 tokens: 4 full pages could be shared, but the last token must run, so (40 - 1) // 8 = 4 pages hit
    assert t2[:4] == t1[:4]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 4 * PAGE and stats.prefix_cache_queries == 2 * 40
    engine.scheduler.check()


def test_different_salts_never_share_a_page(loaded: Any) -> None:
    engine = make_engine(loaded)
    ids = prompt(40)
    out_a, t_a = run(engine, "a", ids, greedy("tenant-a"))
    out_b, t_b = run(engine, "b", ids, greedy("tenant-b"))
    out_n, t_n = run(engine, "n", ids, greedy(None))
    assert out_a == out_b == out_n
    assert not set(t_a[:4]) & (set(t_b) | set(t_n))  # a's pages are still cached, yet b and n got their own
    assert engine.stats().prefix_cache_hits == 0  # three tenants, same prompt: nothing served across them
    keys = {s: chain_keys(s, ids, PAGE, 4) for s in ("tenant-a", "tenant-b", None)}
    assert not set(keys["tenant-a"]) & set(keys["tenant-b"]) and not set(keys[None]) & set(keys["tenant-a"])


def test_key_is_a_chain_from_the_start_of_the_sequence() -> None:
    a = prompt(32, seed=1)
    b = prompt(8, seed=2) + a[8:]  # same second page, different first page
    assert chain_keys("s", a, PAGE, 4)[1] != chain_keys("s", b, PAGE, 4)[1]
    assert chain_keys("s", a, PAGE, 2) == chain_keys("s", a + [1, 2, 3], PAGE, 2)


def test_corrupted_cached_page_is_detected_dropped_and_recomputed(loaded: Any) -> None:
    engine = make_engine(loaded, cache=False)
    ids = prompt(40)
    want, _ = run(engine, "ref", ids, greedy("t"))
    engine = make_engine(loaded)
    first, t1 = run(engine, "a", ids, greedy("t"))
    assert first == want
    bad = t1[1]
    assert engine.prefix_cache is not None and engine.prefix_cache.is_cached(bad)
    engine.pool.tensors[0]["k"][bad, 0].add_(1.0)  # a bit flip's worth of change in one cached page
    again, t2 = run(engine, "b", ids, greedy("t"))
    assert again == want
    assert t2[0] == t1[0] and bad not in t2  # the page before it served, the corrupt one not
    assert engine.stats().prefix_cache_corrupt == 1
    assert not engine.prefix_cache.is_cached(bad) or engine.prefix_cache.refcount(bad) == 0
    engine.scheduler.check()


def test_greedy_with_cache_equals_without_and_transformers(loaded: Any, hf_model: Any) -> None:
    from transformers import GenerationConfig

    base = prompt(36, seed=3)
    prompts = [base + prompt(5, seed=10 + i) for i in range(3)]  # 36 of 41 tokens shared
    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf = [
            hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)), generation_config=gc)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    off = make_engine(loaded, cache=False)
    on = make_engine(loaded)
    without = [run(off, f"r{i}", p, greedy())[0] for i, p in enumerate(prompts)]
    with_cache = [run(on, f"r{i}", p, greedy())[0] for i, p in enumerate(prompts)]
    assert with_cache == without == hf
    assert on.stats().prefix_cache_hits == 2 * 4 * PAGE  # the 2nd and 3rd prompts hit the 4 shared pages
    assert off.allocator.num_free == off.allocator.num_pages


def test_eviction_under_pressure_never_frees_a_page_a_request_reads(loaded: Any) -> None:
    engine = make_engine(loaded, max_total_tokens=128, context_length=128)  # 16 pages of 8 tokens
    assert engine.prefix_cache is not None
    shared = prompt(48, seed=5)
    run(engine, "warm", shared, greedy("t"))  # 6 full pages cached (48 prompt + 5 computed outputs), unreferenced
    engine.add_request("reader", sampling_params=greedy("t", n=20), prompt_token_ids=shared + [7])
    for i in range(3):  # other tenants' prompts: together they need more pages than are free
        engine.add_request(f"p{i}", sampling_params=greedy(f"o{i}", n=4), prompt_token_ids=prompt(30, seed=20 + i))
    seen: dict[tuple[str, int], bytes] = {}  # (request, cached page it reads) -> the page's bytes when first read
    reads = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check()
        reading = {(r.request_id, p) for r in engine.scheduler.running for p in r.page_table}
        for rid, p in reading:
            if engine.prefix_cache.is_cached(p):
                assert engine.allocator.owner[p] == CACHE_OWNER  # not freed, not handed to anyone
                assert engine.pool.read_page(p) == seen.setdefault((rid, p), engine.pool.read_page(p))
                reads += 1
        for key in [k for k in seen if k not in reading]:
            del seen[key]  # that request no longer reads it (finished or preempted)
    assert reads > 0 and engine.prefix_cache.num_evicted > 0  # pages were read and pressure evicted others
    engine.scheduler.check()


def test_cache_unit_refcounts_and_lru_keep_conservation() -> None:
    alloc = PageAllocator(4)
    contents = {p: p for p in range(4)}
    cache = PrefixCache(alloc, 2, lambda pages: [contents[p] for p in pages])
    table = alloc.allocate("r", 3)
    assert cache.insert("r", "s", [1, 2, 3, 4, 5], table, 0, 2, None) == chain_keys("s", [1, 2, 3, 4], 2, 2)[-1]
    assert cache.num_cached == 2 and alloc.pages_of("r") == [table[2]]
    alloc.check()
    cache.check()
    cache.release(table)
    alloc.free("r")
    assert cache.num_evictable == 2
    m = cache.match("s", [1, 2, 3, 4, 9], 2)
    assert m.pages == table[:2] and cache.num_evictable == 0
    assert m.key == chain_keys("s", [1, 2, 3, 4], 2, 2)[-1]
    assert cache.evict(2) == 0  # both are read: nothing may go
    cache.release(m.pages)
    assert cache.evict(2) == 2 and alloc.num_free == 4
    alloc.check()
    cache.check()


def test_cache_salt_is_validated() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(cache_salt="")
    with pytest.raises(InvalidRequestError):
        SamplingParams(cache_salt="x" * 5000)
    assert SamplingParams.from_dict(SamplingParams(cache_salt="t").to_dict()).cache_salt == "t"


def test_the_cache_owner_id_is_refused_as_a_request_id(loaded: Any) -> None:
    engine = make_engine(loaded)
    with pytest.raises(InvalidRequestError):
        engine.add_request(CACHE_OWNER, sampling_params=greedy(), prompt_token_ids=[1, 2, 3])


class CountingHash:
    """Stands in for the xxhash module in kv.prefix_cache, counting the digests made."""

    def __init__(self) -> None:
        import xxhash

        self.count, self._digest = 0, xxhash.xxh3_128_digest

    def xxh3_128_digest(self, data: bytes) -> bytes:
        self.count += 1
        return self._digest(data)


def test_a_prompt_cached_a_chunk_at_a_time_hashes_each_page_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk by chunk, each insert continues the chain from the key the last one returned: the same keys as
    hashing the whole prompt at once, and one digest per page (before, every chunk rehashed the whole prefix:
    quadratic in the prompt, ~0.1 s per chunk at 1M tokens)."""
    import kvfence.kv.prefix_cache as prefix_cache

    pages, page_size, chunk = 64, 4, 5
    ids = prompt(pages * page_size)
    alloc = PageAllocator(pages)
    cache = PrefixCache(alloc, page_size, lambda ps: list(ps))
    table = alloc.allocate("r", pages)
    counting = CountingHash()
    monkeypatch.setattr(prefix_cache, "xxhash", counting)
    key = None
    for first in range(0, pages, chunk):
        key = cache.insert("r", None, ids, table, first, min(first + chunk, pages), key)
    assert counting.count == pages + 1  # one per page, and the salt's seed once
    monkeypatch.undo()
    want = chain_keys(None, ids, page_size, pages)
    assert key == want[-1] and sorted(cache._index) == sorted(want)
    assert [cache._index[k] for k in want] == table
    cache.check()
    alloc.check()


def test_chain_keys_continue_from_a_given_key() -> None:
    from kvfence.kv.prefix_cache import iter_chain_keys

    ids = prompt(40)
    whole = chain_keys("t", ids, 4, 10)
    assert list(iter_chain_keys("t", ids, 4, 10, 6, whole[5])) == whole[6:]
    assert list(iter_chain_keys("u", ids, 4, 10)) != whole  # another tenant, other keys
    with pytest.raises(ValueError, match="needs the key of page 5"):
        list(iter_chain_keys("t", ids, 4, 10, 6))  # a chain cannot start mid-prompt without its key
    with pytest.raises(ValueError):
        list(iter_chain_keys("t", ids, 4, 10, 0, whole[0]))
