"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and GLM-5) over the paged KV pool.

What it knows: MLA's projections (optionally low-rank queries, a shared low-rank
key/value latent plus one decoupled RoPE key per token), the rotary table for the
rope slice (plain or interleaved pair layout, any static rope type transformers
defines, with yarn's softmax-scale correction), and how to attend new queries to a
sequence's cached context. The pool keeps per token only the normalised latent
("latent", [kv_lora_rank]) and the rotated rope key ("rope", [qk_rope_head_dim]),
never per-head keys or values: the per-head key/value up-projection (kv_b_proj) is
absorbed into the query and the output, so attention runs in latent space:

    score_h(i, j) = (W_UK_h^T q_nope_h,i) . latent_j + q_rope_h,i . rope_j
    out_h,i       = W_UV_h (sum_j p_h(i, j) latent_j)

What it does not know: which keys a sparse layer may see (the caller passes an extra
mask; see `models.dsa`), MLPs, or how pages were chosen (`ForwardBatch`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from kvfence.errors import UnsupportedArchitectureError
from kvfence.models.attention import gather_context, store_kv
from kvfence.models.forward_batch import ForwardBatch
from kvfence.models.linear import Linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# -- rotary embedding on the rope slice ---------------------------------------------


class RopeTable(NamedTuple):
    cos: torch.Tensor  # [T, D/2] float32, already multiplied by the rope type's attention factor
    sin: torch.Tensor  # [T, D/2]


class Rotary:
    """Inverse frequencies of the rope slice, from `hf_config.rope_parameters`.

    Static rope types are computed by transformers' own parameter functions (the
    config is theirs); rope types whose frequencies change with the sequence length
    (dynamic NTK, longrope) are refused rather than silently served wrong.
    """

    _REFUSED = ("dynamic", "longrope")

    def __init__(self, hf_config: Any, rope_dim: int) -> None:
        params = dict(hf_config.rope_parameters or {})
        rope_type = params.get("rope_type", "default")
        if rope_type in self._REFUSED:
            raise UnsupportedArchitectureError(f"rope type {rope_type!r} is not supported for MLA models")
        if rope_type == "default":
            theta = float(params["rope_theta"])
            inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
            attention_factor = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedArchitectureError(f"unknown rope type {rope_type!r}")
            inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        assert inv_freq.shape == (rope_dim // 2,), (inv_freq.shape, rope_dim)
        self.inv_freq = inv_freq.float()  # [D/2]
        self.attention_factor = float(attention_factor)
        self.rope_type = rope_type
        self.rope_params = params

    def table(self, positions: torch.Tensor) -> RopeTable:
        """positions: [T] int64 -> cos/sin [T, D/2]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, D/2]
        return RopeTable(freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """1/sqrt(d), times yarn's mscale(all_dim)^2 when the rope type scales (DeepSeek convention)."""
        scale = qk_head_dim**-0.5
        mscale_all_dim = self.rope_params.get("mscale_all_dim", 0)
        factor = self.rope_params.get("factor", 1.0) or 1.0
        if self.rope_type != "default" and mscale_all_dim and factor > 1:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
        return scale


def apply_rope(x: torch.Tensor, rope: RopeTable, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of x: [T, ..., D] with cos/sin [T, D/2].

    Pairs are (x[i], x[i + D/2]) (plain) or (x[2i], x[2i+1]) (interleaved); either way
    the result is laid out as [rotated firsts, rotated seconds], the layout both the
    queries and the cached rope keys use, so their dot products are those of the
    checkpoint's convention.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    cos = rope.cos.view(shape).to(x.dtype)
    sin = rope.sin.view(shape).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# -- the attention block -------------------------------------------------------------


class Query(NamedTuple):
    q: torch.Tensor  # [T, H, qk_nope_head_dim + qk_rope_head_dim], before rope
    q_resid: torch.Tensor | None  # [T, q_lora_rank]: the normalised query latent (the DSA indexer reads it)


class MLAttention(nn.Module):
    """One layer's MLA. Parameter names follow the Hugging Face checkpoints."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, rotary: Rotary, interleaved: bool) -> None:
        super().__init__()
        c = hf_config
        self.num_heads = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.interleaved = interleaved  # rope pair layout of this checkpoint family
        self.scale = rotary.softmax_scale(self.qk_head_dim)
        bias = bool(getattr(c, "attention_bias", False))
        H, R = self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, H * self.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(c.hidden_size, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)  # fixed eps, as in the checkpoints' code
            self.q_b_proj = Linear(self.q_lora_rank, H * self.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, R + self.qk_rope_head_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(R, 1e-6, dtype)
        self.kv_b_proj = Linear(R, H * (self.qk_nope_head_dim + self.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = Linear(H * self.v_head_dim, c.hidden_size, bias=bias, dtype=dtype)

    def project_query(self, x: torch.Tensor) -> Query:
        """x: [T, hidden] -> q [T, H, qk_head_dim], q_resid [T, q_lora_rank] or None."""
        T = x.shape[0]
        if self.q_lora_rank is None:
            return Query(self.q_proj(x).view(T, self.num_heads, self.qk_head_dim), None)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
        return Query(self.q_b_proj(q_resid).view(T, self.num_heads, self.qk_head_dim), q_resid)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTable,
        fb: ForwardBatch,
        cache: dict[str, torch.Tensor],
        key_mask: torch.Tensor | None = None,
        query: Query | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. cache: this layer's flat pool views {"latent": [S, R],
        "rope": [S, Dr], ...}; key_mask: optional [B, Q, K] bool, keys a query may see on top of
        fb.attn_mask (sparse layers); query: `project_query(x)` if the caller already has it."""
        T = x.shape[0]
        H, R, Dn, Dv = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        q = (query or self.project_query(x)).q  # [T, H, Dn + Dr]
        q_nope, q_rope = q.split([Dn, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope, self.interleaved)  # [T, H, Dr]

        latent, k_rope = self.kv_a_proj_with_mqa(x).split([R, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        k_rope = apply_rope(k_rope, rope, self.interleaved)  # [T, Dr]
        store_kv(cache["latent"], latent, fb)
        store_kv(cache["rope"], k_rope, fb)

        # Absorb the per-head key/value up-projection into query and output.
        w_kv = self.kv_b_proj.weight.view(H, Dn + Dv, R)
        w_uk, w_uv = w_kv[:, :Dn, :], w_kv[:, Dn:, :]  # [H, Dn, R], [H, Dv, R]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, R]

        # zero past each sequence's length: padding slots point into other pages, whose bytes (NaN poison
        # included) would otherwise reach this sequence through probs (0) x value (NaN) = NaN
        ctx_latent = gather_context(cache["latent"], fb).to(x.dtype)  # [B, K, R]
        ctx_rope = gather_context(cache["rope"], fb).to(x.dtype)  # [B, K, Dr]
        qb_latent = q_latent[fb.q_index]  # [B, Q, H, R]
        qb_rope = q_rope[fb.q_index]  # [B, Q, H, Dr]
        scores = torch.einsum("bqhr,bkr->bhqk", qb_latent, ctx_latent)
        scores = scores + torch.einsum("bqhd,bkd->bhqk", qb_rope, ctx_rope)  # [B, H, Q, K]
        mask = fb.attn_mask  # [B, 1, Q, K]
        if key_mask is not None:
            mask = mask & key_mask[:, None]
        scores = (scores.float() * self.scale).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(x.dtype)  # [B, H, Q, K]
        out_latent = torch.einsum("bhqk,bkr->bqhr", probs, ctx_latent)[fb.q_valid]  # [T, H, R]
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv).reshape(T, H * Dv)  # [T, H * Dv]
        return self.o_proj(out)  # [T, hidden]
