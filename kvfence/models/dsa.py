"""The DeepSeek sparse attention (DSA) indexer, as GLM-5 (GlmMoeDsa) uses it.

What it knows: the indexer's own small projections (query heads from the MLA query
latent, one key per token from the hidden state, a per-head weight per query), the
index key it keeps per token in the pool ("index_k", [index_head_dim]: the
LayerNorm-ed, rope-rotated key), and the selection rule: for each query, score every
context key it may see as sum_h w_h * relu(q_h . k / sqrt(d)), keep the
`index_topk` highest, and let attention see only those. A query with at most
`index_topk` visible keys sees all of them.

Selection is batch-invariant: keys often score exactly equal (relu makes whole
rows 0.0), and `torch.topk` breaks such ties by an order that depends on the
row's length, i.e. on how far the batch is padded (transformers' reference
indexer calls `topk` and so inherits this). Here ties go to the earlier key
position (a stable sort), and a key the query may not see is never selected,
so a request picks the same keys alone, in any batch, and in any chunking.

What it does not know: the attention itself (`models.mla`), nor which layers run an
indexer: on GLM-5 "shared" layers reuse the selection of the last "full" layer
(the model passes it along).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.models.attention import gather_context, store_kv
from kvfence.models.forward_batch import ForwardBatch
from kvfence.models.linear import Linear
from kvfence.models.mla import RopeTable, apply_rope


class Indexer(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (`self_attn.indexer.*`)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        assert c.q_lora_rank is not None, "the DSA indexer reads the query latent; q_lora_rank is required"
        self.n_heads = c.index_n_heads
        self.head_dim = c.index_head_dim
        self.rope_dim = c.qk_rope_head_dim
        self.topk = c.index_topk
        assert self.head_dim >= self.rope_dim, (self.head_dim, self.rope_dim)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = Linear(c.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        # kept in float32, as the reference implementation keeps it
        self.weights_proj = Linear(c.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        self.softmax_scale = self.head_dim**-0.5

    def _rotate(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x: [T, ..., D]: the first rope_dim features are rotated (interleaved pairs), the rest pass."""
        x_rot, x_pass = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(x_rot, rope, interleaved=True), x_pass], dim=-1)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: RopeTable, fb: ForwardBatch, index_k: torch.Tensor
    ) -> torch.Tensor:
        """Store this forward's index keys and select keys per query.

        x: [T, hidden]; q_resid: [T, q_lora_rank]; index_k: [S, index_head_dim] flat pool view.
        Returns key_mask [B, Q, K] bool: True where the query selected the key.
        """
        T = x.shape[0]
        k = self._rotate(self.k_norm(self.wk(x)), rope)  # [T, Di]
        store_kv(index_k, k, fb)
        q = self._rotate(self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), rope)  # [T, Hi, Di]
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5  # [T, Hi]

        ctx_k = gather_context(index_k, fb).float()  # [B, K, Di], zero past each sequence
        qb = q.float()[fb.q_index]  # [B, Q, Hi, Di]
        per_head = F.relu(torch.einsum("bqhd,bkd->bqhk", qb, ctx_k) * self.softmax_scale)  # [B, Q, Hi, K]
        scores = torch.einsum("bqh,bqhk->bqk", weights[fb.q_index], per_head)  # [B, Q, K]
        return select_top_keys(scores, fb.attn_mask[:, 0], self.topk)


def select_top_keys(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores, visible: [B, Q, K] -> [B, Q, K] bool, the k best visible keys of each query.

    Ties are broken by key position (the earlier key wins) and invisible keys are never
    chosen, so the answer for one query depends only on its own visible scores: not on
    the padding to K, nor on the other rows.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(k, scores.shape[-1])
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, Q, k]
    return torch.zeros_like(visible).scatter_(-1, order, True) & visible  # [B, Q, K]
