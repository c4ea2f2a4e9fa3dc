"""The C++ kernels (CPU; float32, or bfloat16 weights and KV), from native_kernels.cpp: RMSNorm, decode
attention that reads the paged KV pool in place, small-batch projections, and a whole Llama-family decode
step in one call.

What it knows: RMSNorm of each row in one pass (weight * (x * rsqrt(mean(x^2) + eps)), the order
transformers uses; one call instead of the ~9 ops torch's CPU rms_norm dispatches). Decode attention:
for a batch of one query token per sequence it computes, per (sequence, KV head), the scores of that
head's G = H / Hkv query heads against every key of the sequence's context, read page by page from
the flat pool views through the batch's page table, an exact two-pass softmax (max, then exp and
sum, in float32) and the weighted sum of the values, with no contiguous copy of the context.
Projections `x @ W^T` (`packed_linear`): the weight is packed once into panels of 32 output columns
laid out k-major (`pack_panels`), and an AVX-512 kernel keeps 8 batch rows x 32 columns of
accumulators in registers while it streams a panel (about 105 GFLOP/s on one core here, against
oneDNN's 70-80 at 32 rows and 13-15 at one row, where oneDNN's per-call cost dominates). CPUs with AVX2
but not AVX-512 take the rows in passes of fewer rows and columns over blocks of k (the same FMA chains,
so the same bits); others, plain C++ loops. SiLU and
the softmax use a vector exp (Cephes' polynomial, about 1 ulp). `llama_decode_layers` runs every
layer of a decode step (norms, q/k/v, q/k norms, RoPE, the K/V store, attention, o, SwiGLU MLP,
residuals) in one call: at batch 1 the torch forward's ~300 small ops cost more than its arithmetic.
`llama_decode_burst` runs several such steps, each followed by greedy argmax, without returning to Python; both
read the model's weights from one `llama_weights` object, checked once where it is made.
A float32 prefill's attention over fresh prompts, RoPE and SiLU * up have kernels of their own.

Every output element of these kernels is computed by the same float operations whatever its
batch-mates are (work is split over weight panels and (sequence, KV head), never over a row's own
sum; each projection output is one FMA chain over k in order), so a sequence's logits through the
native step do not depend on the batch it shares.

Work sharing: the kernels hand out chunks of weight panels, or of (sequence, KV head) units, from one atomic
counter to the calling thread and `torch.get_num_threads() - 1` helper threads of their own, and the caller
waits only for chunks another thread has taken (not, as at::parallel_for's static split and barrier do, for a
thread the OS has descheduled). Idle helpers spin for $GOMP_SPINCOUNT pause iterations (0 with
OMP_WAIT_POLICY=PASSIVE; libgomp's variables, read once when the kernels load), then sleep on a futex.
Every kernel runs with the GIL released (arguments are converted and results returned with it held): the server's
event loop, transfer threads and other engines' threads run Python meanwhile, and two Python threads may call the
kernels at once (the second caller's chunks then run on its own thread, each call's bits unchanged).

The kernels are compiled on first use with torch's C++ extension builder (a C++ compiler and ninja
needed; 35-45 s on two cores here, then cached under torch's extensions directory, keyed by a hash of
the source). Engines take them by default where they apply (`ModelConfig.kernels = "auto"`: CPU,
float32 or bfloat16, the build succeeds; otherwise the torch kernels, with a warning saying why); a model
running them holds its projections as these panels only (models.llama, `hold_panels`), and its torch
forward (prefill) runs `packed_linear` on them. `python -m kvfence.models.native_kernels` builds them
ahead of time.

bfloat16: `pack_panels` of a bfloat16 weight makes bfloat16 panels (pairs of k side by side), read by
AVX512_BF16's VDPBF16PS where the CPU has it and by float FMAs in the same order where it does not (the
same bits: products of bfloat16s are exact in float32); the input rows are rounded to bfloat16, sums stay
float32. Where the CPU has AMX-BF16 (and Linux grants the tile state), projections whose K is a multiple of 32
run on AMX tiles (TDPBF16PS, 16 rows a tile) instead, at every batch size: a tile sums its 16 k pairs in the
hardware's order, whose bits differ from VDPBF16PS's in the last places, so the AMX and AVX-512 paths are not
mixed within a process; `load().amx_bf16()` says which one runs (KVFENCE_NATIVE_AMX=0 turns AMX off).
A bfloat16 prefill's products (`panel_gemm`) also read the panels, on AMX tiles or else on the decode step's
panel kernel, with the decode path's bits for each row.
Decode attention and the decode step read and write bfloat16 pools, computing in float32. A bfloat16 prefill of
fresh prompts of equal length (no cached prefix) attends over its own new K/V in place
(`causal_prefill_attention`: float32 scores, softmax and sums, rounded once), instead of SDPA over copies.

What it does not know: prefill attention over a cached prefix or in float32, masks other than "the first kv_len
keys" (decode) and causal (fresh prompts), float16, or devices other than the CPU; callers keep the torch path
for those.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from kvfence.models.native_build import NATIVE_BUILD_ESTIMATE, load_built_extension

logger = logging.getLogger(__name__)
_SOURCE_FILE = Path(__file__).with_name("native_kernels.cpp")  # the C++ (its header says what it knows)


class NativeKernelsUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, no ninja, a build error)."""


@functools.cache
def load(extra_cflags: tuple[str, ...] = ()) -> Any:
    """Build (first use) or load the extension module (the functions below; its bindings are the C++ file's
    PYBIND11_MODULE, every kernel with the GIL released); `extra_cflags` builds a
    variant (the tests build one without AVX-512, to check the portable code path on this machine)."""
    bin_dir = str(Path(sys.executable).parent)  # pip's ninja lives beside the interpreter, maybe not on PATH
    if (Path(bin_dir) / "ninja").exists() and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    try:
        source = _SOURCE_FILE.read_text()
        key = hashlib.sha256("\0".join([source, *extra_cflags]).encode()).hexdigest()[:12]  # a new build per edit
        name = f"kvfence_native_kernels_{key}"
        built = load_built_extension(name)  # without importing torch's builder (~5 MiB resident)
        if built is not None:
            return built
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        if not (Path(_get_build_directory(name, False)) / f"{name}.so").exists():
            logger.warning("building kvfence's native CPU kernels (first use here: %s)", NATIVE_BUILD_ESTIMATE)
        module = load_inline(
            name=name,
            cpp_sources=[source],
            # -fopenmp: torch's thread count and parallel-region query (at::get_num_threads, in_parallel_region)
            extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # the builder raises RuntimeError, OSError, subprocess errors, ImportError
        raise NativeKernelsUnavailable(f"cannot build the native kernels: {e}") from e
    return module


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache: [S, Hkv, D]; v_cache: [S, Hkv, Dv] flat pool views (this step's K/V stored);
    kv_pages: [B, P] pages of each context; kv_lens: [B] context lengths -> [B, H, Dv]."""
    return load().paged_decode_attention(q, k_cache, v_cache, kv_pages, kv_lens, int(page_size), float(scale))


def causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, scale: float
) -> torch.Tensor:
    """Causal attention of `batch` fresh prompts of equal length over their own keys (no cached prefix): q [T, H, D],
    k and v [T, Hkv, D], bfloat16 (rows may be strided views; heads contiguous; D a multiple of 16), T = batch * Q
    rows in [batch, Q] order -> [T, H, D] bfloat16. Scores, softmax and the weighted sum in float32, the output
    rounded once; a row's bits depend only on its own sequence (native_kernels.cpp, causal_prefill_attention)."""
    return load().causal_prefill_attention(q, k, v, int(batch), float(scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, E] float32 (weight [E] float32) or bfloat16 (weight float32 or bfloat16) -> [T, E] in x's dtype, as
    transformers orders it: weight * (x * rsqrt(mean(x^2) + eps)), float32 arithmetic; for bfloat16 the
    normalised row is rounded to bfloat16 before the weight multiplies it (and the product rounded again)."""
    return load().rms_norm(x, weight, float(eps))


def rope_bf16_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """RoPE in place on bfloat16 heads x [T, Hq, D] (each head contiguous), rotate-half, with cos and sin [n, D]
    bfloat16 tables (sin's first half negated) at positions [T]: the bits of torch's bfloat16
    `torch.addcmul(x * cos, x.roll(D // 2, -1), sin)` in one pass."""
    load().rope_bf16_(x, cos, sin, positions)


def rope_f32_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """RoPE in place on float32 heads x [T, Hq, D] (each head contiguous), rotate-half, with cos and sin [n, D]
    float32 tables (sin's first half negated) at positions [T]: x * cos + roll(x, D // 2) * sin per element, as
    the native decode step computes it, in one pass."""
    load().rope_f32_(x, cos, sin, positions)


def silu_mul_into(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """out = silu(gate) * up for float32 [T, n] tensors (columns contiguous, rows any stride; out may be a column
    block of a larger buffer), with the native decode step's SiLU."""
    load().silu_mul_into(gate, up, out)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w: [N, K] float32 -> [ceil(N / 32), K, 32]: 32 output columns per panel, k-major, zero past N; bfloat16 ->
    [ceil(N / 32), ceil(K / 2), 32, 2]: per pair of k, each column's two weights side by side (the operand of
    AVX512_BF16's dot product), zero past N and K. What `packed_linear` and `llama_decode_layers` read.

    In transparent huge pages where Linux grants them: every decode step streams all panels, and with 4 KiB
    pages that is a TLB miss every 4 KiB (the panels are copied once into kvfence.hugepages memory; the same
    resident size)."""
    from kvfence.hugepages import huge_empty

    packed = load().pack_panels(w.contiguous())
    return huge_empty(tuple(packed.shape), packed.dtype).copy_(packed)


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_panels' inverse: panels of a weight [n, k] -> that weight [n, k] (a new tensor, same dtype)."""
    if panels.dim() == 3:  # float32 [P, K, 32]
        return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n].clone()
    w = panels.permute(0, 2, 1, 3).reshape(-1, 2 * panels.shape[1])  # bfloat16 [P, K/2, 32, 2]: a copy
    return w if w.shape == (n, k) else w[:n, :k].clone()


def panel_rows(panels: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` [T] of the weight [n, k] that `panels` packs -> [T, k] (a tied embedding read from its head's
    panels: the model keeps one copy)."""
    cols = ids % PANEL
    if panels.dim() == 3:  # float32 [P, K, 32]
        return panels[ids // PANEL, :, cols]  # [T, K]
    return panels[ids // PANEL, :, cols].reshape(ids.shape[0], -1)[:, :k]  # [T, K/2, 2] -> [T, K]


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [B, K] float32 or bfloat16; packed: pack_panels(w) of a w [n, K] (float32 or bfloat16); b: [n] or None;
    residual: [B, n] or None -> residual + x @ w^T + b [B, n] in x's dtype, float32 sums; each output one chain
    over k in order, so a row's result does not depend on the rest of the batch."""
    return load().packed_linear(x, packed, int(n), _EMPTY if b is None else b, _EMPTY if residual is None else residual)


@functools.cache
def amx_bf16() -> bool:
    """Whether bfloat16 projections whose K is a multiple of 32 run on AMX tiles in this process (cached)."""
    return bool(load().amx_bf16())


def panel_gemm_applies(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `panel_gemm` can compute x @ w^T from these panels here: bfloat16 x [M, K] and bfloat16 panels on
    the CPU, and K even (a multiple of 32 where AMX-BF16 is granted to this process: AMX takes every bfloat16
    product then). Without AMX the product runs on the decode step's panel kernel (VDPBF16PS, or the same sums
    by AVX-512, AVX2 or plain float FMAs)."""
    return (
        x.dtype == torch.bfloat16
        and packed.dtype == torch.bfloat16
        and x.dim() == 2
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and _panel_gemm_k(int(x.shape[1]))
    )


@functools.cache
def _panel_gemm_k(k: int) -> bool:
    return bool(load().panel_gemm_bf16_applies(k))


def panel_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] bfloat16; packed: bfloat16 pack_panels(w) of a w [n, K]; b: [n] or None; residual: [M, n]
    bfloat16 or None -> residual + (x @ w^T + b) [M, n] bfloat16, on AMX tiles or panel_rows_bf16 straight from the
    panels (no unpacked copy of w): float32 sums rounded to bfloat16 with the bias, then added to the residual
    and rounded, as torch's bfloat16 `residual + F.linear(x, w, b)` does. Each row's sums are the bits `packed_linear`
    computes for that row (the same products in the same order). Only where `panel_gemm_applies`."""
    return load().panel_gemm_bf16(
        x, packed, int(n), _EMPTY if b is None else b, _EMPTY if residual is None else residual
    )


def small_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, K]; w: [N, K]; b: [N] or None -> x @ w^T + b [B, N] (packs w first: for one-off calls)."""
    return packed_linear(x, pack_panels(w), w.shape[0], b)


def llama_decode_layers(
    x: torch.Tensor,
    layer_weights: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    slots: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """Every layer of a Llama-family decode step in one call (see native_kernels.cpp, llama_decode_layers).

    x: [B, E] float32 embedded tokens; layer_weights: 12 per layer (LAYER_FIELDS order, empty tensors for what a
    model lacks; the PACKED_FIELDS packed by `pack_panels` in the pools' dtype, the others float32); cos/sin:
    [B, D] float32; k_pools/v_pools: per layer [S, Hkv, D], float32 or bfloat16; slots: [B]; kv_pages: [B, P];
    kv_lens: [B] -> [B, E] float32, and this step's K/V written at `slots`.
    """
    return load().llama_decode_layers(
        x, layer_weights, cos, sin, k_pools, v_pools, slots, kv_pages, kv_lens, int(page_size),
        int(num_heads), int(num_kv_heads), float(scale), float(eps),
    )  # fmt: skip


def llama_weights(
    embed: torch.Tensor | None,
    head: torch.Tensor,
    vocab_size: int,
    layer_weights: list[torch.Tensor],
    norm: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    eps: float,
) -> Any:
    """A Llama-family model's weights as llama_decode_step and llama_decode_burst read them, checked once here
    (native_kernels.cpp, LlamaWeights; a bad shape or dtype raises RuntimeError saying which).

    embed: [vocab, E] in the weights' dtype, or None when tied (rows then read from `head`); head: pack_panels of
    the [vocab, E] lm_head; layer_weights: 12 per layer as in llama_decode_layers; norm: [E] float32. The object
    holds references to these tensors, not copies.
    """
    return load().LlamaWeights(
        _EMPTY if embed is None else embed, head, int(vocab_size), layer_weights, norm, int(num_heads),
        int(num_kv_heads), float(scale), float(eps),
    )  # fmt: skip


def llama_decode_step(
    weights: Any,
    ids: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    slots: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    logits_index: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """A whole decode step in one call (native_kernels.cpp, llama_decode_step): ids [B] -> float32 logits [N,
    vocab] of the rows logits_index [N]; the embedding, the RoPE gathers, llama_decode_layers, the final norm and
    the head, with no torch op between them (each costs microseconds at batch 1).

    weights: from `llama_weights`; cos_table/sin_table: [n, D] float32 (n > every position); k_pools/v_pools: one
    per layer of `weights`, in its dtype; the rest as in llama_decode_layers.
    """
    return load().llama_decode_step(
        weights, ids, cos_table, sin_table, positions, k_pools, v_pools, slots, kv_pages, kv_lens, logits_index,
        int(page_size),
    )  # fmt: skip


def llama_decode_burst(
    weights: Any,
    ids: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    kv_pages: torch.Tensor,
    stops: list[tuple[int, ...]],
    steps: int,
    page_size: int,
) -> torch.Tensor:
    """Up to `steps` greedy decode steps in one call (native_kernels.cpp, llama_decode_burst) -> tokens [n, B]
    int64, n <= steps: each step is llama_decode_step's arithmetic over the previous step's argmax (numpy's tie
    rule), so row s is what `steps` separate steps with greedy sampling would give.

    ids [B]: each sequence's last token, at positions [B] (its context length before the call); kv_pages [B, P]
    must cover positions + steps tokens. stops: per sequence, the token ids that end it (eos, stop_token_ids);
    the call ends after the first step where any sequence samples one of its own. Every page a row reads or
    writes must be a page of the pool (pad a shorter table with -1).
    """
    offsets = [0]
    for s in stops:
        offsets.append(offsets[-1] + len(s))
    return load().llama_decode_burst(
        weights, ids, cos_table, sin_table, positions, k_pools, v_pools, kv_pages,
        torch.tensor([t for s in stops for t in s], dtype=torch.long), torch.tensor(offsets, dtype=torch.long),
        int(steps), int(page_size),
    )  # fmt: skip


# what llama_decode_layers expects per layer, in order; PACKED_FIELDS go through pack_panels first
PACKED_FIELDS = frozenset({"qkv_w", "o_w", "gate_up_w", "down_w"})
LAYER_FIELDS = (
    "input_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "post_norm",
    "gate_up_w", "gate_up_b", "down_w", "down_b",
)  # fmt: skip
_EMPTY = torch.empty(0)
PANEL = 32  # output columns per panel (kPanel in the C++)
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels hold weights and KV in


if __name__ == "__main__":  # build (or find) the extension ahead of first use, e.g. in CI before the tests
    import time

    t0 = time.monotonic()
    load()
    print(f"kvfence native kernels ready ({time.monotonic() - t0:.1f} s)")
