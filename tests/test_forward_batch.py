"""build_forward_batch: the decode fast path lays out exactly what the general path does."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from kvfence.models.forward_batch import SeqChunk, _build_decode, _build_general, build_forward_batch

FIELDS = (
    "input_ids positions slot_mapping q_index q_valid kv_slots kv_lens attn_mask logits_index kv_pages attn_bias"
).split()


def _decode_chunks(rng: random.Random, page_size: int, equal: bool) -> list[SeqChunk]:
    chunks = []
    length = rng.randint(1, 70)
    for _ in range(rng.randint(1, 9)):
        start = length if equal else rng.randint(0, 70)
        pages = rng.sample(range(200), (start + page_size) // page_size + rng.randint(0, 3))  # may list spare pages
        chunks.append(SeqChunk([rng.randrange(1000)], start, pages, rng.choice(["last", "last", "none"])))
    return chunks


@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_path_matches_general_path(page_size: int, equal: bool) -> None:
    rng = random.Random(page_size * 2 + equal)
    for _ in range(25):
        chunks = _decode_chunks(rng, page_size, equal)
        fast, general = _build_decode(chunks, page_size, "cpu"), _build_general(chunks, page_size, "cpu")
        assert fast.is_decode and general.is_decode
        assert fast.mask_mode == general.mask_mode
        for name in FIELDS:
            a, b = getattr(fast, name), getattr(general, name)
            if a is None or b is None:
                assert a is None and b is None, name
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
            assert torch.equal(a, b), name


def test_dispatch_takes_decode_path_only_for_one_token_chunks() -> None:
    decode = [SeqChunk([3], 5, [0, 1]), SeqChunk([4], 2, [2])]
    mixed = [SeqChunk([3], 5, [0, 1]), SeqChunk([4, 5], 2, [2])]
    assert build_forward_batch(decode, 4).is_decode
    assert not build_forward_batch(mixed, 4).is_decode


def test_decode_path_rejects_a_short_page_table() -> None:
    with pytest.raises(AssertionError, match="cannot hold"):
        build_forward_batch([SeqChunk([3], 8, [0, 1])], 4)  # 9 tokens need 3 pages of 4


def test_mixed_batch_is_split_into_decode_and_prefill_parts() -> None:
    chunks = [SeqChunk([1], 6, [0, 1]), SeqChunk([2, 3, 4], 0, [2]), SeqChunk([5], 2, [3]), SeqChunk([6, 7], 4, [4, 5])]
    fb = build_forward_batch(chunks, 4)
    assert [rows.tolist() for rows, _ in fb.parts] == [[0, 4], [1, 2, 3, 5, 6]]
    decode, prefill = (part for _, part in fb.parts)
    assert decode.is_decode and decode.batch_size == 2 and not decode.parts
    assert not prefill.is_decode and prefill.batch_size == 2 and not prefill.parts
    assert not build_forward_batch(chunks[1::2], 4).parts  # prefill chunks only: nothing to split


def _mixed_attention_case(seed: int, last: SeqChunk, poison: bool = False) -> tuple[Any, ...]:
    """Decode rows beside prefill chunks (the last one given) over 32 slots, 2 KV heads, 4 query heads, D = 8,
    this forward's K/V stored (after NaN in their slots, with `poison`): fb, k_cache, v_cache, k, v, q."""
    from kvfence.models.attention import store_kv

    g = torch.Generator().manual_seed(seed)
    chunks = [SeqChunk([1], 9, [3, 0, 5]), SeqChunk([2] * 6, 0, [1, 7]), SeqChunk([3], 3, [2]), last]
    fb = build_forward_batch(chunks, 4)
    assert fb.parts
    k_cache, v_cache = torch.randn(32, 2, 8, generator=g), torch.randn(32, 2, 8, generator=g)
    if poison:
        k_cache[fb.slot_mapping] = float("nan")  # this forward's slots are written before attention
    k, v = torch.randn(fb.num_tokens, 2, 8, generator=g), torch.randn(fb.num_tokens, 2, 8, generator=g)
    store_kv(k_cache, k, fb)
    store_kv(v_cache, v, fb)
    return fb, k_cache, v_cache, k, v, torch.randn(fb.num_tokens, 4, 8, generator=g)


def test_split_attention_equals_padded_attention() -> None:
    from kvfence.models.attention import paged_attention

    fb, k_cache, v_cache, _, _, q = _mixed_attention_case(0, SeqChunk([4] * 3, 5, [4, 6]), poison=True)
    split = paged_attention(q, k_cache, v_cache, fb, 0.3)
    padded = paged_attention(q, k_cache, v_cache, dataclasses.replace(fb, parts=()), 0.3)
    torch.testing.assert_close(split, padded, rtol=1e-6, atol=1e-6)


def test_a_mixed_batchs_fresh_prompts_read_their_own_rows_of_the_new_kv() -> None:
    """Decode rows beside two fresh prompts: each part gets its own rows of this forward's K/V (the prompts' part
    is mask "causal" and reads them as given), with the bits of gathering everything from the pool."""
    from kvfence.models.attention import paged_attention

    fb, k_cache, v_cache, k, v, q = _mixed_attention_case(2, SeqChunk([4] * 6, 0, [4, 6]))
    assert [part.mask_mode for _, part in fb.parts][1] == "causal"
    gathered = paged_attention(q, k_cache, v_cache, fb, 0.3)
    assert torch.equal(paged_attention(q, k_cache, v_cache, fb, 0.3, (k, v)), gathered)
    wrong = (k.flip(0), v.flip(0))  # another order of the same rows: the prompts' part must not read these as its own
    assert not torch.equal(paged_attention(q, k_cache, v_cache, fb, 0.3, wrong), gathered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_attend_over_the_new_kv_with_the_pools_bits(dtype: torch.dtype) -> None:
    """Fresh prompts of equal length (mask "causal") read this forward's K/V as given instead of gathering
    them back from the pool: the same bits, on scattered pages; a prompt with a cached prefix still gathers."""
    from kvfence.models.attention import paged_attention, store_kv

    g = torch.Generator().manual_seed(1)
    chunks = [SeqChunk([1] * 6, 0, [5, 2]), SeqChunk([2] * 6, 0, [0, 7]), SeqChunk([3] * 6, 0, [3, 6])]
    fb = build_forward_batch(chunks, 4)
    assert fb.mask_mode == "causal"
    k_cache = torch.full((32, 2, 8), float("nan")).to(dtype)
    v_cache = torch.full((32, 2, 8), float("nan")).to(dtype)
    k, v = torch.randn(18, 2, 8, generator=g).to(dtype), torch.randn(18, 2, 8, generator=g).to(dtype)
    store_kv(k_cache, k, fb)
    store_kv(v_cache, v, fb)
    q = torch.randn(18, 4, 8, generator=g).to(dtype)
    gathered = paged_attention(q, k_cache, v_cache, fb, 0.3)
    given = paged_attention(q, k_cache, v_cache, fb, 0.3, (k, v))
    assert torch.equal(given, gathered)
    assert not given.isnan().any()
    with_prefix = build_forward_batch([SeqChunk([1] * 2, 4, [5, 2])], 4)  # 4 tokens already in the pool
    assert with_prefix.mask_mode != "causal"  # so new_kv (2 rows) is not its context: ignored
    store_kv(k_cache, k[:2], with_prefix)
    store_kv(v_cache, v[:2], with_prefix)
    torch.testing.assert_close(
        paged_attention(q[:2], k_cache, v_cache, with_prefix, 0.3, (k[:2], v[:2])),
        paged_attention(q[:2], k_cache, v_cache, with_prefix, 0.3),
        rtol=0,
        atol=0,
    )
