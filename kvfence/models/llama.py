"""Llama-family decoder-only transformers (Llama, Mistral, Qwen2, Qwen3) over the paged KV pool.

What it knows: the forward of a pre-norm GQA transformer with RoPE, RMSNorm and a
SwiGLU MLP, with the few per-architecture switches these four need (q/k/v bias for
Qwen2, per-head q/k RMSNorm and a free head_dim for Qwen3, optional attention/MLP
bias and tied embeddings for all). It reads a transformers config (5.x fields:
`rope_parameters`), merges q/k/v and gate/up weights into single matrices at load
time, and keeps two per-token buffers per layer in the pool: "k" and "v", each
(num_key_value_heads, head_dim).

What it does not know: where pages are, which request a row is, sampling. It
writes this forward's K/V at fb.slot_mapping and returns float32 logits for
fb.logits_index rows only. With kernels "native" a decode batch of up to
NATIVE_STEP_MAX_BATCH sequences runs every layer in one C++ call (models.native_kernels),
the same math with float sums in another order, in float32 or with bfloat16 weights and KV
(float32 arithmetic); `decode_steps` runs several such steps with greedy argmax in one call.
Weights are held once: plain (each projection [out, in], plus a
oneDNN-blocked copy for torch's kernels) or, for the native kernels, as native panels only
(`hold_panels`: the originals and oneDNN copies freed, a tied embedding read from the head's
panels); every forward runs from either. Sliding-window attention is not implemented: the
loader caps the context at the window so full attention is exact.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.errors import UnsupportedArchitectureError
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.math_utils import round_up
from kvfence.models.attention import paged_attention, store_kv
from kvfence.models.forward_batch import ForwardBatch
from kvfence.models.linear import linear, linear_add, pack_weight

# --- config helpers ------------------------------------------------------------------------------------


def head_dim_of(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def num_kv_heads_of(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def rope_parameters_of(cfg: Any) -> dict[str, Any]:
    """The RoPE dict as transformers 5.x stores it (`rope_parameters`), with 4.x `rope_scaling` as a fallback."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params:  # per-layer-type dicts ({"full_attention": {...}}) are not used by these models
        raise UnsupportedArchitectureError(f"unsupported rope_parameters layout: {params}")
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def sliding_window_of(cfg: Any) -> int | None:
    """The attention window if any layer uses one (Mistral: all; Qwen2/3: layers marked sliding), else None."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


def rope_inv_freq(cfg: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale, for the rope types we serve.

    Formulas follow the published methods as transformers implements them:
    default, linear (positions / factor), dynamic (NTK; equal to default for
    positions below max_position_embeddings, the only ones we serve), llama3
    (wavelength-banded scaling) and yarn (ramped interpolation + attention factor).
    """
    p = rope_parameters_of(cfg)
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    dim = int(head_dim_of(cfg) * p.get("partial_rotary_factor", 1.0))
    if dim != head_dim_of(cfg):
        raise UnsupportedArchitectureError("partial rotary embeddings are not supported for Llama-family models")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # [dim/2]
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, p, base, dim)
    raise UnsupportedArchitectureError(
        f"rope type {rope_type!r} is not supported; kvfence serves default, linear, dynamic, llama3, yarn"
    )


def _yarn_inv_freq(cfg: Any, p: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    original_ctx = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or cfg.max_position_embeddings / original_ctx
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the rotary dimension whose wavelength completes `rotations` turns over the original context
        return dim * math.log(original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


# --- model ---------------------------------------------------------------------------------------------

# Decode batches up to this size take the one-call C++ step when the engine runs kernels "native"
# (models.native_kernels); larger ones run the torch forward. At 32 on the default model the two cost the
# same CPU time within 1%, and the native step is batch-invariant; above 32 it was not measured.
NATIVE_STEP_MAX_BATCH = 32
_EMPTY = torch.empty(0)
PROJECTIONS = ("qkv_w", "o_w", "gate_up_w", "down_w")  # a layer's projection weights, [out, in] each
# From this many rows (prefill chunks) a bfloat16 projection held as panels unpacks its weight for the call and
# takes F.linear (oneDNN, AMX where the CPU has it): at 1,024 rows x [2048, 768] on two cores here 1,470 GFLOP/s
# against the panels' 190, the unpacking (0.7 ms) included; break-even near 64 rows. float32 stays on the panels
# (oneDNN's 300 GFLOP/s against their 270-300 does not pay for the unpacking).
BF16_GEMM_MIN_ROWS = 128
# A prefill's transients in blocks (the same values, fewer bytes live at once): RoPE this many rows at a time,
# and a float32 MLP's gate and up projections in blocks of columns of about this many bytes (DecoderLayer); 0:
# gate and up whole, one call each. Blocks of 2 MiB cost a 32 x 128-token prefill 1.14-1.16x its time here
# (the panels kernel streams x once per panel group and call), so the default is 0.
_ROPE_ROWS = 256
_MLP_BLOCK_BYTES = 0


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, cast back, then scaled (the order transformers uses)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel, same result in fp32
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return xf if weight is None else weight * xf


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool) -> torch.Tensor:
    """x: [T, E] -> rms_norm(x, weight, eps), by the C++ kernel (models.native_kernels) when `native` and it applies."""
    # float32 rows with a float32 weight, or bfloat16 rows with a bfloat16 weight (a float32 weight would make
    # torch's `weight * xf` a float32 result)
    if (
        native
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.device.type == "cpu"
        and x.dim() == 2
    ):
        from kvfence.models.native_kernels import rms_norm as native_rms_norm

        return native_rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


class RopeRows:
    """The cos and sin (sin's first half negated) of a forward's rows: the [n, D] tables and each row's position.
    The gathered [T, 1, D] rows the torch path multiplies by are made on first use, once for every layer; the
    native path reads the tables by position."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
        assert cos_table.shape == sin_table.shape and positions.dim() == 1, (cos_table.shape, positions.shape)
        self.cos_table, self.sin_table, self.positions = cos_table, sin_table, positions  # [n, D], [n, D], [T]

    @functools.cached_property
    def cos(self) -> torch.Tensor:
        return self.cos_table[self.positions][:, None, :]  # [T, 1, D]

    @functools.cached_property
    def sin(self) -> torch.Tensor:
        return self.sin_table[self.positions][:, None, :]  # [T, 1, D]


class DecoderLayer(nn.Module):
    """One pre-norm block; q/k/v and gate/up are single fused matrices."""

    def __init__(self, cfg: Any, arch: str, dtype: torch.dtype) -> None:
        super().__init__()
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.H, self.Hkv, self.D = cfg.num_attention_heads, num_kv_heads_of(cfg), head_dim_of(cfg)
        self.eps = float(cfg.rms_norm_eps)
        qkv_rows = (self.H + 2 * self.Hkv) * self.D
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.input_norm = _param(E, dtype=dtype)
        self.qkv_w = _param(qkv_rows, E, dtype=dtype)
        self.qkv_b = _param(qkv_rows, dtype=dtype) if qkv_bias else None
        self.o_w = _param(E, self.H * self.D, dtype=dtype)
        self.o_b = _param(E, dtype=dtype) if o_bias else None
        self.qk_norm = arch == "Qwen3ForCausalLM"
        self.q_norm = _param(self.D, dtype=dtype) if self.qk_norm else None
        self.k_norm = _param(self.D, dtype=dtype) if self.qk_norm else None
        self.post_norm = _param(E, dtype=dtype)
        self.gate_up_w = _param(2 * I, E, dtype=dtype)
        self.gate_up_b = _param(2 * I, dtype=dtype) if mlp_bias else None
        self.down_w = _param(E, I, dtype=dtype)
        self.down_b = _param(E, dtype=dtype) if mlp_bias else None
        self.I = I
        self.shapes = {name: tuple(getattr(self, name).shape) for name in PROJECTIONS}  # name -> (out, in)
        self.packed: dict[str, torch.Tensor | None] = {}  # weight name -> oneDNN-blocked copy (models.linear)
        # weight name -> native_kernels.pack_panels of it, the only copy while the model holds panels
        self.panels: dict[str, torch.Tensor] = {}
        self.native = False  # RMSNorm by models.native_kernels (set by LlamaForCausalLM.use_native_kernels)

    def pack_weights(self, enabled: bool = True) -> None:
        """Refresh the blocked copies of the four projection weights from the loaded values (or drop them)."""
        assert not self.panels, "the projections are held as native panels (hold_panels(False) first)"
        self.packed = {name: pack_weight(getattr(self, name)) for name in PROJECTIONS} if enabled else {}

    def hold_panels(self, enabled: bool) -> None:
        """Hold the projections as native panels only (the [out, in] originals and oneDNN copies freed, one
        weight at a time), or back as [out, in] weights (then without oneDNN copies: pack_weights makes them)."""
        from kvfence.models import native_kernels

        if enabled and not self.panels:
            self.packed = {}
            for name in PROJECTIONS:
                w = getattr(self, name)
                self.panels[name] = native_kernels.pack_panels(w.data)
                w.data = w.data.new_empty(0)  # the original's storage goes
        elif not enabled and self.panels:
            for name in PROJECTIONS:
                getattr(self, name).data = native_kernels.unpack_panels(self.panels.pop(name), *self.shapes[name])

    def _gate_up_act(self, h: torch.Tensor, gate_up: torch.Tensor, scratch: dict[str, torch.Tensor]) -> torch.Tensor:
        """h: [T, E] float32; gate_up: the float32 panels [2I / 32, E, 32] of [gate; up] -> silu(gate) * up [T, I],
        written into scratch["act"] (made on the first layer of a forward, reused by the others).

        A block of columns at a time: gate's and up's panels for those columns ([c / 32] panels each, the same
        per-column sums as one call over all of them), their product written into its columns of the result.
        By default one block (c = I): a prefill holds [T, I] twice (the product written over gate's buffer's
        copy) instead of [T, 2I] and [T, I] (resident peak: docs/benchmarks.md, "Aggregated peak memory").
        """
        from kvfence.models.native_kernels import packed_linear, silu_mul_into

        T, I, P = h.shape[0], self.I, gate_up.shape[-1]
        b = self.gate_up_b
        act = scratch.get("act")
        if act is None or act.shape != (T, I):
            act = scratch["act"] = h.new_empty(T, I)  # [T, I]
        # columns per block: about _MLP_BLOCK_BYTES per [T, c] block, whole panels, at least one panel
        cols = I if _MLP_BLOCK_BYTES <= 0 else max(P, min(I, _MLP_BLOCK_BYTES // (4 * max(T, 1)) // P * P))
        for c0 in range(0, I, cols):
            c1 = min(I, c0 + cols)
            gate_b, up_b = (None, None) if b is None else (b[c0:c1], b[I + c0 : I + c1])
            gate = packed_linear(h, gate_up[c0 // P : c1 // P], c1 - c0, gate_b)  # [T, c]
            up = packed_linear(h, gate_up[(I + c0) // P : (I + c1) // P], c1 - c0, up_b)  # [T, c]
            if self.native:  # the native decode step's SiLU, on the kernels' threads
                silu_mul_into(gate, up, act[:, c0:c1])
            else:
                torch.mul(F.silu(gate, inplace=True), up, out=act[:, c0:c1])
            del gate, up
        return act

    def _project(
        self,
        name: str,
        x: torch.Tensor,
        b: torch.Tensor | None,
        residual: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        """x: [T, in] -> (residual +) x @ W^T (+ b) [T, out] for projection `name`, from whichever copy is held.
        rows: the forward's row count when x holds only some of its rows (the panel kernel is chosen by it, so
        that each row's result is the one the whole forward would give)."""
        panels = self.panels.get(name)
        if panels is not None:
            from kvfence.models.native_kernels import packed_linear, panel_gemm, panel_gemm_applies, unpack_panels

            if x.dtype == torch.bfloat16 and (x.shape[0] if rows is None else rows) >= BF16_GEMM_MIN_ROWS:
                if panel_gemm_applies(x, panels):  # AMX tiles or the panel kernel on the panels themselves
                    return panel_gemm(x, panels, self.shapes[name][0], b, residual)
                # a transient [out, in] copy for oneDNN
                y = F.linear(x, unpack_panels(panels, *self.shapes[name]), b)
                return y if residual is None else residual + y
            return packed_linear(x, panels, self.shapes[name][0], b, residual)
        w = getattr(self, name)
        if residual is None:
            return linear(x, w, b, self.packed.get(name))
        return linear_add(residual, x, w, b, self.packed.get(name))

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeRows,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        scratch: dict[str, torch.Tensor] | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, E]; rope: the rows' cos/sin; k_cache/v_cache: [S, Hkv, D]; scratch: buffers the layers of one
        forward share (each layer's are dead once it returns) -> [T, E]. keep [N] (the last layer, whose output
        only feeds the logits): every row's K/V are stored and attended as usual, then only these rows go on
        through o, the MLP and the residual -> [N, E]. Held as panels, every kernel after attention computes a
        row on its own, so the kept rows are the bits of the whole forward's."""
        T = x.shape[0]
        H, Hkv, D = self.H, self.Hkv, self.D
        scratch = {} if scratch is None else scratch
        h = _norm(x, self.input_norm, self.eps, self.native)
        qkv = self._project("qkv_w", h, self.qkv_b)  # [T, (H + 2 Hkv) D]
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if self.qk_norm:  # Qwen3: RMSNorm of every q and k head over head_dim, own weights for q and k
            assert self.q_norm is not None and self.k_norm is not None
            w = torch.cat([self.q_norm.expand(H, D), self.k_norm.expand(Hkv, D)])  # [H + Hkv, D]
            qk = rms_norm(qk, None, self.eps) * w
        # RoPE on q and k heads at once, rotate-half convention:
        # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] = qk * cos + [x2, x1] * [-sin, sin],
        # written back over qk (its inputs are the two temporaries, so nothing it reads is overwritten)
        if self.native and qk.dtype == torch.bfloat16:  # the same bits in one native pass over qk
            from kvfence.models.native_kernels import rope_bf16_

            rope_bf16_(qk, rope.cos_table, rope.sin_table, rope.positions)
        elif self.native and qk.dtype == torch.float32 and rope.cos_table.dtype == torch.float32:
            from kvfence.models.native_kernels import rope_f32_

            rope_f32_(qk, rope.cos_table, rope.sin_table, rope.positions)  # the native decode step's RoPE
        else:
            cos, sin = rope.cos, rope.sin  # [T, 1, D]
            for r0 in range(0, T, _ROPE_ROWS):  # a block of rows at a time: two [rows, H + Hkv, D] temporaries
                rows = slice(r0, r0 + _ROPE_ROWS)
                blk = qk[rows]
                torch.addcmul(blk * cos[rows], blk.roll(D // 2, -1), sin[rows], out=blk)  # [rows, H + Hkv, D]
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        store_kv(k_cache, k, fb)
        store_kv(v_cache, v, fb)
        attn = paged_attention(q, k_cache, v_cache, fb, scale, (k, v), native=self.native)  # [T, H, D]
        # A prefill's activations are freed as soon as they are dead, so the next ones reuse their memory
        # (a layer's resident peak is what is live at once, not every temporary of the layer)
        del h, qkv, qk, q, k, v
        attn = attn.reshape(T, H * D)  # [T, H * D]
        if keep is not None:
            assert self.panels, "keep: only for projections held as panels (row by row)"
            attn, x = attn[keep], x[keep]  # [N, H * D], [N, E]
        x = self._project("o_w", attn, self.o_b, x, rows=T)
        del attn
        h = _norm(x, self.post_norm, self.eps, self.native)
        gate_up = self.panels.get("gate_up_w")
        if gate_up is not None and h.dtype == torch.float32 and self.I % gate_up.shape[-1] == 0:
            act = self._gate_up_act(h, gate_up, scratch)  # [T, I]
        else:
            gu = self._project("gate_up_w", h, self.gate_up_b, rows=T)  # [T, 2I]
            act = F.silu(gu[:, : self.I]).mul_(gu[:, self.I :])  # [T, I]
            del gu
        del h
        return self._project("down_w", act, self.down_b, x, rows=T)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM serving from a paged KV pool (see module docstring)."""

    architecture = "LlamaForCausalLM"
    inv_freq: torch.Tensor  # a buffer: [D/2] float32

    @classmethod
    def kv_layout(cls, hf_config: Any, page_size: int, dtype: torch.dtype) -> KVLayout:
        shape = (num_kv_heads_of(hf_config), head_dim_of(hf_config))
        return KVLayout(
            architecture=cls.architecture,
            num_layers=int(hf_config.num_hidden_layers),
            buffers=(KVBufferSpec("k", shape), KVBufferSpec("v", shape)),
            page_size=page_size,
            dtype=dtype,
        )

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.dtype = dtype
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.H, self.Hkv, self.D = int(cfg.num_attention_heads), num_kv_heads_of(cfg), head_dim_of(cfg)
        assert self.H % self.Hkv == 0, (self.H, self.Hkv)
        assert self.D % 2 == 0, self.D
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.eps = float(cfg.rms_norm_eps)
        self.embed = _param(self.vocab_size, self.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.architecture, dtype) for _ in range(self.num_layers))
        self.blocks: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]  # self.layers, typed
        self.norm = _param(self.hidden_size, dtype=dtype)
        tied = self.tie_word_embeddings
        self.lm_head = self.embed if tied else _param(self.vocab_size, self.hidden_size, dtype=dtype)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32
        self.scale = self.D**-0.5
        self.lm_head_packed: torch.Tensor | None = None  # oneDNN-blocked lm_head, set by pack_weights
        self._weight_shapes = self._shapes_of_targets()
        # dtype -> (cos, sin) by position, each [n, D] (see _rope_tables); replaced whole, never edited, because
        # engines on threads of one process (an in-process deployment) share this model
        self._rope: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.native = False  # final RMSNorm by models.native_kernels
        self.panels = False  # projections and head held as native panels only (hold_panels)
        self.skip_dead_rows = True  # with panels: the last layer after attention only for the logits' rows
        self._native_head: torch.Tensor | None = None  # lm_head's panels (the only copy while self.panels)
        self._native: Any = None  # native_kernels.llama_weights: what the native step reads, while self.panels

    # --- weights -------------------------------------------------------------------------------------

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """hf tensor name -> (our parameter, row offset, rows): where each checkpoint tensor lands."""
        H, Hkv, D = self.H, self.Hkv, self.D
        targets: dict[str, tuple[torch.Tensor, int, int]] = {"model.embed_tokens.weight": (self.embed, 0, -1)}
        targets["model.norm.weight"] = (self.norm, 0, -1)
        if not self.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0, -1)
        for i, layer in enumerate(self.blocks):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = (layer.input_norm, 0, -1)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_norm, 0, -1)
            qkv_parts = [("q_proj", 0, H * D), ("k_proj", H * D, Hkv * D), ("v_proj", (H + Hkv) * D, Hkv * D)]
            for name, start, rows in qkv_parts:
                targets[p + f"self_attn.{name}.weight"] = (layer.qkv_w, start, rows)
                if layer.qkv_b is not None:
                    targets[p + f"self_attn.{name}.bias"] = (layer.qkv_b, start, rows)
            targets[p + "self_attn.o_proj.weight"] = (layer.o_w, 0, -1)
            if layer.o_b is not None:
                targets[p + "self_attn.o_proj.bias"] = (layer.o_b, 0, -1)
            if layer.q_norm is not None and layer.k_norm is not None:
                targets[p + "self_attn.q_norm.weight"] = (layer.q_norm, 0, -1)
                targets[p + "self_attn.k_norm.weight"] = (layer.k_norm, 0, -1)
            targets[p + "mlp.gate_proj.weight"] = (layer.gate_up_w, 0, layer.I)
            targets[p + "mlp.up_proj.weight"] = (layer.gate_up_w, layer.I, layer.I)
            targets[p + "mlp.down_proj.weight"] = (layer.down_w, 0, -1)
            if layer.gate_up_b is not None and layer.down_b is not None:
                targets[p + "mlp.gate_proj.bias"] = (layer.gate_up_b, 0, layer.I)
                targets[p + "mlp.up_proj.bias"] = (layer.gate_up_b, layer.I, layer.I)
                targets[p + "mlp.down_proj.bias"] = (layer.down_b, 0, -1)
        return targets

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this model needs, with its shape (names as in the safetensors files)."""
        return dict(self._weight_shapes)

    def _shapes_of_targets(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, (param, _, rows) in self._targets().items():
            shape = tuple(param.shape)
            out[name] = shape if rows < 0 else (rows, *shape[1:])
        return out

    @staticmethod
    def is_ignored_weight(name: str) -> bool:
        """Checkpoint tensors we do not need: rotary caches some exporters save, a tied head's copy."""
        return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (hf_name, tensor) pairs into place, casting to our dtype; returns the names loaded.

        Raises KeyError for a name we do not know (unless ignorable) and ValueError for a
        shape mismatch; the loader turns both into errors naming the file.
        """
        assert not self.panels, "weights load into the plain layout (hold_panels(False) first)"
        targets = self._targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if self.is_ignored_weight(name):
                    continue
                raise KeyError(f"unexpected tensor {name!r}")
            param, start, rows = targets[name]
            dest = param.data if rows < 0 else param.data[start : start + rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        return loaded

    def pack_weights(self, enabled: bool = True) -> None:
        """Make (or drop, enabled=False) the oneDNN-blocked weight copies the projections run on.

        The loader makes them for the torch kernels; dropping them sends every projection to F.linear
        (MKL), which `kvfence bench offline --baselines unpacked` uses as a same-run baseline (on a model
        holding native panels, the weights go back to [out, in] first, so its decode steps run the torch
        forward on F.linear too).
        """
        if self.panels:
            self.hold_panels(False)
        for layer in self.blocks:
            layer.pack_weights(enabled)
        self.lm_head_packed = pack_weight(self.lm_head) if enabled else None

    @torch.no_grad()
    def hold_panels(self, enabled: bool = True, shared_file: Path | None = None) -> None:
        """Hold the weights as the native kernels read them, and only so (enabled), or plain (not enabled).

        Panels: every projection and the head as native_kernels.pack_panels panels, each original and its
        oneDNN copy freed as its panels are made (so the model never holds much more than one copy); a
        tied embedding is read from the head's panels; the per-layer list the native step takes is built
        here, not on the first step. Plain: [out, in] weights back from the panels, with oneDNN copies.

        `shared_file`: the panels then live in that file, mapped read-only (copy-on-write), so processes on
        one host that load the same model (a disaggregated deployment's workers) share one copy in the page
        cache. The first process writes it (atomically); later ones map it after checking that its first
        panels equal theirs.
        """
        from kvfence.models import native_kernels

        if enabled and not self.panels:
            assert self.dtype in native_kernels.DTYPES and self.embed.device.type == "cpu", (self.dtype, self.embed)
            self.lm_head_packed = None
            for layer in self.blocks:
                layer.hold_panels(True)
            self._native_head = native_kernels.pack_panels(self.lm_head.data)
            self.lm_head.data = self.lm_head.data.new_empty(0)  # tied: the embedding goes too (read from the panels)
            if shared_file is not None:
                self._map_panels(shared_file)
            layer_weights = [
                _EMPTY if (t := getattr(layer, name)) is None
                else layer.panels[name] if name in native_kernels.PACKED_FIELDS
                else t.detach().float().contiguous()
                for layer in self.blocks
                for name in native_kernels.LAYER_FIELDS
            ]  # fmt: skip
            self._native = native_kernels.llama_weights(
                None if self.tie_word_embeddings else self.embed,  # tied: rows from the head's panels
                self._native_head, self.vocab_size, layer_weights, self.norm.detach().float(), self.H, self.Hkv,
                self.scale, self.eps,
            )  # fmt: skip
            self.panels = True
        elif not enabled and self.panels:
            assert self._native_head is not None
            self._native = None
            for layer in self.blocks:
                layer.hold_panels(False)
            self.lm_head.data = native_kernels.unpack_panels(self._native_head, self.vocab_size, self.hidden_size)
            self._native_head = None
            self.panels = False
            self.pack_weights()

    def _map_panels(self, path: Path) -> None:
        """Replace the in-memory panels (head first, then each layer's PROJECTIONS) with views of `path`, a file
        holding them back to back at 64-byte offsets, written here if absent."""
        assert self._native_head is not None
        panels = [self._native_head] + [layer.panels[name] for layer in self.blocks for name in PROJECTIONS]
        offsets, end = [], 0
        for t in panels:
            offsets.append(end)
            end += round_up(t.numel() * t.element_size(), 64)
        if not path.is_file() or path.stat().st_size != end:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                for t, offset in zip(panels, offsets, strict=True):
                    f.seek(offset)
                    f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
                f.truncate(end)
            os.replace(tmp, path)  # atomic: a concurrent writer leaves the same bytes
        whole = torch.from_file(str(path), shared=False, size=end, dtype=torch.uint8)  # MAP_PRIVATE, read only
        mapped = [
            whole[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, o in zip(panels, offsets, strict=True)
        ]
        if not torch.equal(mapped[1], panels[1]):  # a file from other weights under the same name
            raise ValueError(f"{path} does not hold this model's panels; delete it to rewrite it")
        self._native_head = mapped[0]
        it = iter(mapped[1:])
        for layer in self.blocks:
            for name in PROJECTIONS:
                layer.panels[name] = next(it)

    def use_native_kernels(self, enabled: bool = True) -> None:
        """Run decode steps and every RMSNorm through models.native_kernels, holding the weights as native
        panels only (hold_panels), or back through torch with plain weights and oneDNN copies."""
        self.hold_panels(enabled)
        self.native = enabled
        for layer in self.blocks:
            layer.native = enabled

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> embeddings [T, E] in the model's dtype (from the head's panels when tied and held so)."""
        if self.panels and self.tie_word_embeddings:
            from kvfence.models.native_kernels import panel_rows

            assert self._native_head is not None
            return panel_rows(self._native_head, ids, self.hidden_size)
        return F.embedding(ids, self.embed)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, E] after the final norm -> float32 logits [N, vocab]."""
        if self._native_head is not None:
            from kvfence.models.native_kernels import packed_linear

            return packed_linear(x, self._native_head, self.vocab_size).float()
        return linear(x, self.lm_head, None, self.lm_head_packed).float()

    # --- forward -------------------------------------------------------------------------------------

    def _rope_tables(self, num_positions: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (first half negated) for positions 0..n-1 (at least), each [n, D] in `dtype` (ours by default).

        Computed once and regrown by doubling when a longer position comes, so a forward only
        indexes them; each row is the same elementwise formula as computing it per token. The
        pair is read once and replaced whole: another engine's thread may regrow it meanwhile,
        and then each caller still holds a matching pair long enough for its own positions.
        """
        dtype = dtype or self.dtype
        tables = self._rope.get(dtype)
        if tables is None or tables[0].shape[0] < num_positions:
            n = max(64, 1 << (num_positions - 1).bit_length())
            freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [n, D/2]
            cos, sin = freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
            tables = torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)  # [n, D] each
            self._rope[dtype] = tables
        return tables

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run the new tokens of `fb`, writing their K/V into `pool`; logits [N, vocab] float32."""
        if self._native_step_applies(fb):
            return self._forward_native_decode(fb, pool)
        x = self._embed_rows(fb.input_ids)  # [T, E]
        rope = RopeRows(*self._rope_tables(int(fb.positions.max()) + 1), fb.positions)
        scratch: dict[str, torch.Tensor] = {}  # the layers' shared buffers (DecoderLayer.forward)
        # the last layer's o, MLP and residual only for the rows whose logits are wanted (a prompt's last
        # token): the other rows' K/V are all a later step reads of them (held as panels: the same bits)
        N, T = fb.logits_index.shape[0], x.shape[0]
        skip = self.panels and self.skip_dead_rows and N < T
        for i, layer in enumerate(self.layers):
            keep = fb.logits_index if skip and i == self.num_layers - 1 else None
            x = layer.forward(x, rope, pool.flat(i, "k"), pool.flat(i, "v"), fb, self.scale, scratch, keep)
        del scratch
        if not skip:
            x = x[fb.logits_index]  # [N, E]: only the rows whose logits are wanted
        x = _norm(x, self.norm, self.eps, self.native)
        return self._logits(x)  # [N, vocab]

    def _native_step_applies(self, fb: ForwardBatch) -> bool:
        return (
            fb.native_decode
            and self.panels  # the native weights are held (so: CPU, float32 or bfloat16)
            and fb.kv_pages is not None
            and 0 < fb.batch_size <= NATIVE_STEP_MAX_BATCH
        )

    def _forward_native_decode(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """A decode step (one token per sequence) through models.native_kernels: embedding, every layer, the
        final norm and the head in one C++ call. Same math as `forward` (float32 activations whatever the
        weights' dtype); float sums in another order."""
        from kvfence.models import native_kernels

        assert self._native is not None and fb.kv_pages is not None and fb.kv_lens is not None
        cos_table, sin_table = self._rope_tables(int(fb.positions.max()) + 1, torch.float32)
        return native_kernels.llama_decode_step(
            self._native, fb.input_ids, cos_table, sin_table, fb.positions,
            [pool.flat(i, "k") for i in range(self.num_layers)], [pool.flat(i, "v") for i in range(self.num_layers)],
            fb.slot_mapping, fb.kv_pages, fb.kv_lens, fb.logits_index, fb.page_size,
        )  # fmt: skip  # [N, vocab] float32

    def decode_steps_apply(self, batch_size: int) -> bool:
        """Whether `decode_steps` can run a decode batch of this size: the native weights are held."""
        return self._native is not None and 0 < batch_size <= NATIVE_STEP_MAX_BATCH

    @torch.no_grad()
    def decode_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pages: torch.Tensor,
        page_size: int,
        stops: list[tuple[int, ...]],
        steps: int,
        pool: KVPool,
    ) -> torch.Tensor:
        """Up to `steps` greedy decode steps in one native call -> sampled tokens [n, B] int64 (n <= steps).

        input_ids [B]: each sequence's last token, at positions [B]; kv_pages [B, P] covers positions + steps
        tokens; stops: per sequence, the tokens that end it (the call ends after the first step that samples
        one). Each step is `_forward_native_decode`'s arithmetic followed by greedy argmax, so the tokens are
        the ones that many single steps would sample."""
        from kvfence.models import native_kernels

        assert self.decode_steps_apply(int(input_ids.shape[0]))
        cos_table, sin_table = self._rope_tables(int(positions.max()) + steps, torch.float32)
        return native_kernels.llama_decode_burst(
            self._native, input_ids, cos_table, sin_table, positions,
            [pool.flat(i, "k") for i in range(self.num_layers)], [pool.flat(i, "v") for i in range(self.num_layers)],
            kv_pages, stops, steps, page_size,
        )  # fmt: skip  # [n, B]


class MistralForCausalLM(LlamaForCausalLM):
    architecture = "MistralForCausalLM"


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"


class Qwen3ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen3ForCausalLM"
