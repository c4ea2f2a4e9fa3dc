"""DeepSeek-style mixture of experts: sigmoid router with group-limited top-k, routed + shared experts.

What it knows: the router (sigmoid scores; a per-expert correction bias that only
affects which experts are chosen; experts split into `n_group` groups, each group
scored by the sum of its two best biased scores, only the `topk_group` best groups
eligible; top-k experts among those; weights optionally renormalised, then scaled by
`routed_scaling_factor`), experts stored stacked as in transformers 5
(gate_up_proj [E, 2I, H], down_proj [E, H, I]), and the always-on shared experts.
Also the dense gated MLP used by the first layers and by the shared experts.

What it does not know: attention, expert parallelism, or checkpoint names beyond its
own parameters (the model maps per-expert checkpoint tensors onto the stacks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.models.linear import Linear


def _check_act(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    assert act == "silu", f"only silu MLPs are implemented, config has {act!r}"


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); names follow the checkpoints."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] float32
    experts: torch.Tensor  # [T, k] int64


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] and e_score_correction_bias [E], both float32."""

    e_score_correction_bias: torch.Tensor  # a buffer

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        c = hf_config
        self.num_experts = c.n_routed_experts
        self.top_k = c.num_experts_per_tok
        self.n_group = c.n_group or 1
        self.topk_group = c.topk_group or 1
        self.norm_topk_prob = bool(c.norm_topk_prob)
        self.routed_scaling_factor = float(c.routed_scaling_factor)
        assert self.num_experts % self.n_group == 0, (self.num_experts, self.n_group)
        assert self.num_experts // self.n_group >= 2, "groups are scored by their two best experts"
        assert self.topk_group <= self.n_group, (self.topk_group, self.n_group)
        self.weight = nn.Parameter(torch.empty(self.num_experts, c.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.empty(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [T, H] -> top-k experts and weights per token."""
        T, E, G = x.shape[0], self.num_experts, self.n_group
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias  # [T, E]; used for choosing only
        group_scores = biased.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
        groups = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
        group_ok = torch.zeros(T, G, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
        expert_ok = group_ok[:, :, None].expand(T, G, E // G).reshape(T, E)  # [T, E]
        experts = biased.masked_fill(~expert_ok, float("-inf")).topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(weights * self.routed_scaling_factor, experts)


class Experts(nn.Module):
    """`mlp.experts`: stacked expert weights, the layout transformers 5 uses in memory."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H], sum over each token's chosen experts (in expert order)."""
        out = torch.zeros_like(x)
        for e in routing.experts.unique().tolist():
            tok, slot = torch.where(routing.experts == e)  # tokens routed to e, and which of their k slots
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, H]
            out.index_add_(0, tok, (y * routing.weights[tok, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """Routed experts plus always-on shared experts."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        _check_act(c)
        self.gate = Router(c)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, dtype)
        self.shared_experts = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        return self.experts(x, self.gate(x)) + self.shared_experts(x)
