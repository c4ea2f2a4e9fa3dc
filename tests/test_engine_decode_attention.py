"""Decode attention over the runner's transposed key copies equals SDPA over a fresh gather."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvfence.engine.request import Request
from kvfence.engine.runner import DecodeContextCache
from kvfence.engine.sampling_params import SamplingParams
from kvfence.models.attention import gather_context, paged_attention, store_kv
from kvfence.models.forward_batch import SeqChunk, build_forward_batch


def test_transposed_key_copy_and_decode_attention_match_a_fresh_gather() -> None:
    g = torch.Generator().manual_seed(0)
    page, Hkv, H, D = 4, 2, 4, 8
    k_cache = torch.full((64 * page, Hkv, D), float("nan"))  # unwritten slots are NaN
    v_cache = torch.full((64 * page, Hkv, D), float("nan"))
    reqs = tuple(Request(f"r{i}", [1] * n, SamplingParams()) for i, n in enumerate([5, 9, 2]))
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    lens = [5, 9, 2]
    cc = DecodeContextCache(bytes_per_token=1)
    for n, t in zip(lens, tables, strict=True):
        for pos in range(n):
            slot = t[pos // page] * page + pos % page
            k_cache[slot], v_cache[slot] = torch.randn(2, Hkv, D, generator=g)
    used = []
    for _ in range(5):
        fb = build_forward_batch([SeqChunk([3], n, t) for n, t in zip(lens, tables, strict=True)], page)
        use = cc.prepare(reqs, fb)
        used.append(use)
        fbc = dataclasses.replace(fb, context_cache=cc) if use else fb
        store_kv(k_cache, torch.randn(fb.num_tokens, Hkv, D, generator=g), fbc)  # this step's K/V, stored first
        store_kv(v_cache, torch.randn(fb.num_tokens, Hkv, D, generator=g), fbc)
        q = torch.randn(fb.num_tokens, H, D, generator=g)
        want = paged_attention(q, k_cache, v_cache, fb, 0.3)  # SDPA over a gather from the pool
        if use:
            kt = cc.context(k_cache, fb, transposed=True)  # [B, Hkv, D, K]
            assert torch.equal(kt.transpose(-1, -2), gather_context(k_cache, fb).transpose(1, 2))
            got = paged_attention(q, k_cache, v_cache, fbc, 0.3)
            assert fb.mask_mode == "bias"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            ref = F.scaled_dot_product_attention(
                q.view(3, Hkv, 2, D), kt.transpose(-1, -2), cc.context(v_cache, fb), attn_mask=fb.attn_bias, scale=0.3
            )
            torch.testing.assert_close(got, ref.reshape(3, H, D), rtol=1e-5, atol=1e-6)
        lens = [n + 1 for n in lens]
    assert used == [False, True, True, True, True]
