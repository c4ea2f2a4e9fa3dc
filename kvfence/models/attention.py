"""Paged attention over a flat KV pool view, shared by every GQA/MHA model.

What it knows: how to write a forward's new K/V into their pool slots and how to
attend each sequence's padded queries to its gathered context under the batch's
mask (`ForwardBatch`). Plain PyTorch (SDPA; steady decode uses two batched matmuls
over the runner's context copies), so it runs on CPU and GPU alike.

What it does not know: model shapes beyond q/k/v heads and head dims, or how
pages were chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfence.models.forward_batch import ForwardBatch


def store_kv(cache: torch.Tensor, new: torch.Tensor, fb: ForwardBatch) -> None:
    """cache: [S, *shape] flat pool view; new: [T, *shape] -> written at fb.slot_mapping (and into the
    runner's context copies of a steady decode batch, which then need not read it back)."""
    new = new.to(cache.dtype)
    cache.index_copy_(0, fb.slot_mapping, new)
    if fb.context_cache is not None:
        fb.context_cache.append(cache, new, fb)


def gather_context(cache: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """cache: [S, *shape] -> each sequence's context [B, K, *shape], zero past each sequence's length.

    Whole pages are copied when the batch lists them (a few large copies instead of one
    small copy per slot), then cut to K; otherwise slot by slot. Positions past a
    sequence's length (its last page's tail, padding pages) may hold anything, NaN
    poison included, and a masked NaN still turns softmax @ V into NaN, so ragged
    batches get them zeroed.
    """
    if fb.kv_pages is None or not fb.page_size:
        ctx = cache[fb.kv_slots]  # [B, K, *shape]
    else:
        B, P = fb.kv_pages.shape
        K = fb.kv_slots.shape[1]
        pages = cache.view(-1, fb.page_size, *cache.shape[1:])  # [num_pages, page_size, *shape]
        ctx = pages.index_select(0, fb.kv_pages.view(-1))  # [B * P, page_size, *shape]
        ctx = ctx.view(B, P * fb.page_size, *cache.shape[1:])[:, :K]  # [B, K, *shape]
    if fb.mask_mode not in ("none", "causal"):  # some sequence is shorter than K
        K = ctx.shape[1]
        beyond = torch.arange(K, device=ctx.device)[None, :] >= fb.kv_lens[:, None]  # [B, K]
        ctx = ctx.masked_fill(beyond.view(*beyond.shape, *([1] * (ctx.dim() - 2))), 0)
    return ctx


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    native: bool = False,
) -> torch.Tensor:
    """Causal attention of new queries over each sequence's context in the pool.

    q: [T, H, D]; k_cache: [S, Hkv, D]; v_cache: [S, Hkv, Dv] (already holding this
    forward's K/V). Returns [T, H, Dv]. When the batch carries a `context_cache` (the
    runner's copy of a steady decode batch's context, kept across steps), K/V come
    from it instead of a fresh gather from the pool. new_kv: this forward's K [T, Hkv, D]
    and V [T, Hkv, Dv] as stored; fresh prompts of equal length (mask "causal") then read
    them instead of gathering the same values back from the pool; with `native` (the layer runs the native
    kernels) and float32 or bfloat16 K/V, models.native_kernels.causal_prefill_attention reads them in place
    instead of SDPA.
    """
    T, H, _ = q.shape
    Hkv = k_cache.shape[1]
    if fb.parts:  # mixed decode + prefill: each part attends without the other's padding
        out = q.new_empty(T, H, v_cache.shape[-1])
        for rows, part in fb.parts:
            part_kv = None if new_kv is None else (new_kv[0][rows], new_kv[1][rows])  # the part's rows, in its order
            out[rows] = paged_attention(q[rows], k_cache, v_cache, part, scale, part_kv, native)
        return out
    if (
        fb.native_decode
        and fb.kv_pages is not None
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
    ):
        from kvfence.models.native_kernels import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, fb.kv_pages, fb.kv_lens, fb.page_size, scale)
    if fb.is_decode and fb.context_cache is not None and fb.mask_mode in ("none", "bias"):
        return _decode_attention(q, k_cache, v_cache, fb, scale)
    B, Q = fb.q_index.shape
    if (
        native
        and fb.context_cache is None
        and fb.mask_mode == "causal"
        and not fb.is_decode
        and new_kv is not None
        and q.dtype == new_kv[0].dtype == new_kv[1].dtype == k_cache.dtype == v_cache.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.shape[-1] == v_cache.shape[-1]
        and q.shape[-1] % 16 == 0
        and q.device.type == "cpu"
    ):
        # fresh prompts of Q tokens each over the K/V just computed, [B, Q] row order: no copies, no SDPA
        # (a 2.3x shorter layer than SDPA at 8-32 x 128 tokens, 12/4 heads, D = 64: docs/benchmarks.md, "bf16
        # prefill attention in one native pass")
        from kvfence.models.native_kernels import causal_prefill_attention

        return causal_prefill_attention(q, new_kv[0], new_kv[1], B, scale)  # [T, H, D]
    if fb.context_cache is not None:
        k = fb.context_cache.context(k_cache, fb)  # [B, Hkv, K, D]
        v = fb.context_cache.context(v_cache, fb)  # [B, Hkv, K, Dv]
    elif (
        fb.mask_mode == "causal"
        and new_kv is not None
        and new_kv[0].dtype == k_cache.dtype
        and new_kv[1].dtype == v_cache.dtype
    ):
        # each sequence's context is exactly its Q rows of this forward (Q == K, rows of T in [B, Q] order):
        # the values just stored, contiguous for SDPA (see below)
        k = new_kv[0].view(B, Q, Hkv, -1).transpose(1, 2).contiguous()  # [B, Hkv, K, D]
        v = new_kv[1].view(B, Q, Hkv, -1).transpose(1, 2).contiguous()  # [B, Hkv, K, Dv]
    else:
        k = gather_context(k_cache, fb).transpose(1, 2)  # [B, Hkv, K, D]
        v = gather_context(v_cache, fb).transpose(1, 2)  # [B, Hkv, K, Dv]
        if not fb.is_decode:
            # contiguous for SDPA: given these transposed views, CPU SDPA (torch 2.13) keeps an 8 MiB buffer after
            # its first prefill of 8 x 128 tokens and takes ~1.6x the time; same values either way
            k, v = k.contiguous(), v.contiguous()
    dense = fb.mask_mode == "causal"  # B fresh prompts of Q tokens each: rows of T are already [B, Q] in order
    if fb.is_decode:
        # one token per sequence, row b is sequence b; query heads grouped by their KV head (h // G),
        # which is what enable_gqa would do, minus its overhead: [B, Hkv, G, D]
        qp = q.reshape(T, Hkv, H // Hkv, q.shape[-1])
    elif dense:
        qp = q.view(B, Q, H, q.shape[-1]).transpose(1, 2)  # [B, H, Q, D]
    else:
        qp = q[fb.q_index].transpose(1, 2)  # [B, H, Q, D]
    # A boolean mask sends CPU SDPA down a slow path; the batch says when none is needed
    # (equal-length decode, equal-length fresh prompts) and otherwise gives an additive one.
    mask, causal = None, False
    if fb.mask_mode == "bias":
        assert fb.attn_bias is not None, "mask_mode bias comes with attn_bias"
        mask = fb.attn_bias.to(k.dtype)  # [B, 1, Q, K]
    elif fb.mask_mode == "causal":
        causal = True
    elif fb.mask_mode == "mask":
        mask = fb.attn_mask  # [B, 1, Q, K] bool
    else:
        assert fb.mask_mode == "none", fb.mask_mode
    # GQA: SDPA maps query head h to KV head h // (H // Hkv) itself; copying K/V H // Hkv times
    # (repeat_interleave) costs more than the attention on CPU at long contexts.
    out = F.scaled_dot_product_attention(
        qp.to(k.dtype), k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=Hkv != H and not fb.is_decode
    )  # [B, H, Q, Dv] ([B, Hkv, G, Dv] for decode)
    if fb.is_decode:
        return out.reshape(T, H, out.shape[-1]).to(q.dtype)  # [T, H, Dv]
    if dense:
        return out.transpose(1, 2).reshape(T, H, out.shape[-1]).to(q.dtype)  # [T, H, Dv]
    return out.transpose(1, 2)[fb.q_valid].to(q.dtype)  # [T, H, Dv]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query per sequence over the context cache's copies, as two batched matmuls.

    q: [B, H, D]. Keys come as [B, Hkv, D, K] (the copy is kept transposed), so q @ k^T is one
    bmm over B * Hkv small GEMMs that stream each key row once; on CPU this beats SDPA's kernel
    at decode shapes, whose cost is reading the context. Returns [B, H, Dv].
    """
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    kt = fb.context_cache.context(k_cache, fb, transposed=True)  # [B, Hkv, D, K]
    v = fb.context_cache.context(v_cache, fb)  # [B, Hkv, K, Dv]
    qg = (q * scale).reshape(B, Hkv, H // Hkv, D).to(kt.dtype)  # [B, Hkv, G, D]: query heads grouped by KV head
    scores = torch.matmul(qg, kt)  # [B, Hkv, G, K], already scaled
    if fb.mask_mode == "bias":
        assert fb.attn_bias is not None, "mask_mode bias comes with attn_bias"
        scores.add_(fb.attn_bias.to(scores.dtype))  # [B, 1, 1, K]: -inf past each sequence's length
    out = torch.matmul(scores.softmax(-1), v)  # [B, Hkv, G, Dv]
    return out.reshape(B, H, out.shape[-1]).to(q.dtype)  # [B, H, Dv]
