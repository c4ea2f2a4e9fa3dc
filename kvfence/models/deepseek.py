"""DeepSeek-V3 (MLA + MoE) and GLM-5 (MLA + MoE + DSA sparse attention) over the paged KV pool.

What it knows: the decoder stack of `DeepseekV3ForCausalLM` and
`GlmMoeDsaForCausalLM` (attention in `models.mla`, experts in `models.moe`, the
sparse-attention indexer in `models.dsa`), their KV layouts, and how their Hugging
Face checkpoints name each tensor: routed experts either one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, what save_pretrained writes) or stacked
(`mlp.experts.gate_up_proj`, the in-memory layout of transformers 5); multi-token
prediction layers past `num_hidden_layers` are skipped.

KV layout, per layer and token (what the verifier hashes and transfers):
    DeepseekV3ForCausalLM: latent [kv_lora_rank], rope [qk_rope_head_dim]
    GlmMoeDsaForCausalLM:  latent, rope, index_k [index_head_dim]
Layers whose indexer is "shared" (they reuse the previous full layer's selection)
have no index key of their own; they write zeros into their index_k slots so every
byte of a page is defined and covered by the same digests as the rest.

What it does not know: scheduling, sampling, or where the checkpoint files are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from kvfence.errors import ModelLoadError
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.models.attention import store_kv
from kvfence.models.dsa import Indexer
from kvfence.models.forward_batch import ForwardBatch
from kvfence.models.linear import Linear
from kvfence.models.mla import MLAttention, RMSNorm, Rotary
from kvfence.models.moe import GatedMLP, MoE

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderLayer(nn.Module):
    """Pre-norm block: MLA (+ indexer on DSA "full" layers), then a dense MLP or the MoE. Names follow HF."""

    def __init__(
        self, hf_config: Any, dtype: torch.dtype, rotary: Rotary, interleaved: bool, sparse_mlp: bool, indexer: bool
    ) -> None:
        super().__init__()
        c = hf_config
        self.self_attn = MLAttention(c, dtype, rotary, interleaved)
        if indexer:
            self.self_attn.indexer = Indexer(c, dtype)  # checkpoint name: self_attn.indexer.*
        self.mlp = MoE(c, dtype) if sparse_mlp else GatedMLP(c.hidden_size, c.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)


class _Body(nn.Module):
    """`model.*`: the embedding, the decoder layers and the final norm (named as the checkpoint names them)."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm


class _MLAForCausalLM(nn.Module):
    """Shared body of both architectures; a subclass names its architecture and config class and says
    whether it has a DSA indexer. Parameters are laid out under HF names (model.layers.{i}.self_attn...)."""

    architecture: str = ""
    config_class: str = ""
    has_indexer: bool = False

    # -- contract -----------------------------------------------------------------
    @classmethod
    def parse_config(cls, hf_config: Any) -> Any:
        """Accept a transformers config object or a config.json dict."""
        if isinstance(hf_config, dict):
            import transformers

            d = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
            return getattr(transformers, cls.config_class)(**d)
        return hf_config

    @classmethod
    def kv_layout(cls, hf_config: Any, page_size: int, dtype: torch.dtype) -> KVLayout:
        c = cls.parse_config(hf_config)
        buffers = [KVBufferSpec("latent", (c.kv_lora_rank,)), KVBufferSpec("rope", (c.qk_rope_head_dim,))]
        if cls.has_indexer:
            buffers.append(KVBufferSpec("index_k", (c.index_head_dim,)))
        return KVLayout(cls.architecture, c.num_hidden_layers, tuple(buffers), page_size, dtype)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        c = self.parse_config(hf_config)
        self.config = c
        self.dtype = dtype
        self.num_layers = c.num_hidden_layers
        self.rotary = Rotary(c, c.qk_rope_head_dim)
        self.indexer_types = list(getattr(c, "indexer_types", None) or []) if self.has_indexer else []
        if self.has_indexer:
            assert len(self.indexer_types) == self.num_layers, self.indexer_types
            assert self.indexer_types[0] == "full", "the first layer must run its own indexer"
        with torch.device("meta"):  # weights come from load_weights; skip random init
            self.model = _Body()
            self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.model.layers = nn.ModuleList(
                DecoderLayer(
                    c,
                    dtype,
                    self.rotary,
                    self.rope_interleaved(c),
                    sparse_mlp=self._is_sparse_mlp(i),
                    indexer=self.has_indexer and self.indexer_types[i] == "full",
                )
                for i in range(self.num_layers)
            )
            self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device="cpu")
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def rope_interleaved(hf_config: Any) -> bool:
        """DeepSeek-V3 checkpoints say whether their rope pairs are interleaved (default yes)."""
        return bool(getattr(hf_config, "rope_interleave", True))

    def _is_sparse_mlp(self, layer: int) -> bool:
        types = getattr(self.config, "mlp_layer_types", None)
        if types is not None:
            return types[layer] == "sparse"
        return self.config.n_routed_experts is not None and layer >= self.config.first_k_dense_replace

    # -- weights ------------------------------------------------------------------
    def _expert_modules(self) -> dict[str, Any]:
        """prefix ("model.layers.{i}.mlp.experts") -> Experts module, for the MoE layers."""
        return {name: m for name, m in self.named_modules() if name.endswith("mlp.experts")}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model needs, with its shape, named as save_pretrained writes them
        (routed experts one tensor per expert and projection)."""
        experts = self._expert_modules()
        shapes: dict[str, tuple[int, ...]] = {}
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            prefix = name.rsplit(".", 1)[0]
            if prefix in experts:
                continue
            shapes[name] = tuple(t.shape)
        for prefix, m in experts.items():
            hidden = m.gate_up_proj.shape[-1]
            for e in range(m.num_experts):
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (m.intermediate, hidden)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (m.intermediate, hidden)
                shapes[f"{prefix}.{e}.down_proj.weight"] = (hidden, m.intermediate)
        if self.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        return shapes

    def is_ignored_weight(self, name: str) -> bool:
        """Tensors we do not use: multi-token-prediction layers past num_hidden_layers, rotary caches,
        a tied head's copy."""
        layer = _LAYER_RE.match(name)
        if layer and int(layer.group(1)) >= self.num_layers:
            return True
        return name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (hf_name, tensor) pairs into place, casting to our dtypes; returns the `weight_shapes`
        names now loaded. Experts may come per expert (as save_pretrained writes them) or stacked
        (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]). Raises ModelLoadError on
        an unknown or misshapen tensor, or if any needed tensor never came."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        expected = self.weight_shapes()
        experts = self._expert_modules()
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.is_ignored_weight(name):
                continue
            m = _EXPERT_RE.match(name)
            if m and m.group(1) in experts:
                prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
                if not 0 <= e < experts[prefix].num_experts:
                    raise ModelLoadError(f"checkpoint tensor {name!r}: expert {e} out of range")
                inter = experts[prefix].intermediate
                if proj == "down_proj":
                    dst = params[f"{prefix}.down_proj"][e]
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    dst = params[f"{prefix}.gate_up_proj"][e, rows]
                self._copy(dst, tensor, name)
                loaded.add(name)
                continue
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.architecture}")
            self._copy(params[name], tensor, name)
            prefix, leaf = name.rsplit(".", 1)
            if prefix in experts:  # a stacked tensor stands for every expert's projection(s)
                projs = ("down_proj",) if leaf == "down_proj" else ("gate_proj", "up_proj")
                loaded.update(f"{prefix}.{e}.{p}.weight" for e in range(experts[prefix].num_experts) for p in projs)
            else:
                loaded.add(name)
        missing = sorted(set(expected) - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        self.pack_weights()
        return loaded

    def pack_weights(self, enabled: bool = True) -> None:
        """Make (or drop) the oneDNN-blocked copies every Linear projects with (see models.linear).

        The routed experts keep their stacked weights on F.linear: they run a few rows each."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(enabled)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))

    # -- forward ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run the new tokens of `fb`, writing their KV into `pool`; logits [N, vocab] float32."""
        assert pool.layout.num_layers == self.num_layers, (pool.layout.num_layers, self.num_layers)
        x = self.model.embed_tokens(fb.input_ids)  # [T, hidden]
        rope = self.rotary.table(fb.positions)  # cos/sin [T, Dr/2]
        key_mask: torch.Tensor | None = None  # [B, Q, K] DSA selection, carried to "shared" layers
        for i, layer in enumerate(cast(Iterable[DecoderLayer], self.model.layers)):
            cache = pool.layer_buffers(i)
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            query = attn.project_query(h)
            if self.has_indexer:
                indexer = cast("Indexer | None", getattr(attn, "indexer", None))
                if indexer is not None:
                    key_mask = indexer(h, query.q_resid, rope, fb, cache["index_k"])
                else:  # "shared" layer: no index key of its own; define its bytes as zeros
                    store_kv(cache["index_k"], h.new_zeros(h.shape[0], cache["index_k"].shape[-1]), fb)
            x = x + attn(h, rope, fb, cache, key_mask, query)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.model.norm(x[fb.logits_index])  # [N, hidden]
        return self.lm_head(h).float()  # [N, vocab]


class DeepseekV3ForCausalLM(_MLAForCausalLM):
    architecture = "DeepseekV3ForCausalLM"
    config_class = "DeepseekV3Config"
    has_indexer = False


class GlmMoeDsaForCausalLM(_MLAForCausalLM):
    architecture = "GlmMoeDsaForCausalLM"
    config_class = "GlmMoeDsaConfig"
    has_indexer = True

    @staticmethod
    def rope_interleaved(hf_config: Any) -> bool:
        """GLM-5 always pairs rope features interleaved, whatever the config says."""
        return True
