"""Paged attention over a flat KV pool view, shared by every GQA/MHA model.

What it knows: how to write a forward's new K/V into their pool slots and how to
attend each sequence's padded queries to its gathered context under the batch's
mask (`ForwardBatch`). Plain PyTorch (SDPA), so it runs on CPU and GPU alike.

What it does not know: model shapes beyond q/k/v heads and head dims, or how
pages were chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfence.engine.forward_batch import ForwardBatch


def store_kv(cache: torch.Tensor, new: torch.Tensor, fb: ForwardBatch) -> None:
    """cache: [S, *shape] flat pool view; new: [T, *shape] -> written at fb.slot_mapping."""
    cache.index_copy_(0, fb.slot_mapping, new.to(cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """Causal attention of new queries over each sequence's context in the pool.

    q: [T, H, D]; k_cache: [S, Hkv, D]; v_cache: [S, Hkv, Dv] (already holding this
    forward's K/V). Returns [T, H, Dv].
    """
    H = q.shape[1]
    Hkv = k_cache.shape[1]
    qp = q[fb.q_index].transpose(1, 2)  # [B, H, Q, D]
    k = k_cache[fb.kv_slots].transpose(1, 2)  # [B, Hkv, K, D]
    v = v_cache[fb.kv_slots].transpose(1, 2)  # [B, Hkv, K, Dv]
    # GQA: SDPA maps query head h to KV head h // (H // Hkv) itself; copying K/V H // Hkv times
    # (repeat_interleave) costs more than the attention on CPU at long contexts.
    out = F.scaled_dot_product_attention(
        qp.to(k.dtype), k, v, attn_mask=fb.attn_mask, scale=scale, enable_gqa=Hkv != H
    )  # [B, H, Q, Dv]
    return out.transpose(1, 2)[fb.q_valid].to(q.dtype)  # [T, H, Dv]
