"""Dense projections `x @ W^T (+ b) (+ residual)` on the fastest exact CPU kernel this torch build has.

What it knows: torch's CPU `F.linear`/`addmm` call MKL's sgemm, which on the AMD
EPYC machines we run on takes a code path without AVX-512; oneDNN (bundled with
x86 torch builds, reached through `torch.ops.mkldnn._linear_pointwise`) picks its
kernel from the CPU's features and runs the same fp32 (or bf16) product 1.4-2x
faster at decode shapes (16-64 rows) and ~2.5x at prefill shapes (thousands of
rows); see docs/benchmarks.md. Both accumulate in fp32; results differ only by
summation order (relative ~1e-6). Below `ONEDNN_MIN_ROWS` rows oneDNN's fixed call
cost (~20 us) loses to MKL, so small batches stay on `F.linear`.

Whether oneDNN is usable is probed once per dtype — the op exists, runs, and agrees
with `F.linear` on a small product — and the answer is cached; anything else
(CUDA tensors, fp16, a build without oneDNN, a failed probe) takes `F.linear`.

A model may also keep a oneDNN-blocked copy of each weight (`pack_weight`, made once
after loading; it costs a second copy of the weights in memory). With it, oneDNN
skips re-blocking the weight on every call: from 2 rows up it beats MKL (about 2x
from 32 rows), so those products take it; a single row (batch-1 decode) stays on
MKL, whose GEMV is faster on narrow weights. `python -m kvfence.bench.kernels`
measures the three kernels side by side.

What it does not know: model shapes, or anything about the batch beyond its row count.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 16  # measured crossover on the 2-core EPYC: MKL wins below, oneDNN from here up
PACKED_MIN_ROWS = 2  # with a packed weight oneDNN wins from 2 rows; at 1 row MKL's GEMV is faster overall
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """True if `torch.ops.mkldnn._linear_pointwise` exists and matches F.linear for `dtype` on the CPU."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(ONEDNN_MIN_ROWS, 40, generator=g).to(dtype)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        r = torch.randn(ONEDNN_MIN_ROWS, 24, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        results = [
            (torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""), F.linear(x, w, b)),
            (torch.ops.mkldnn._linear_pointwise.binary(x, r, w, None, "add"), r + F.linear(x, w)),
            (torch.ops.mkldnn._linear_pointwise(x[:1], packed, b, "none", [], ""), F.linear(x[:1], w, b)),
            (torch.ops.mkldnn._linear_pointwise.binary(x, r, packed, None, "add"), r + F.linear(x, w)),
        ]
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return all(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 10) for got, want in results)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of w [out, in] for `linear`/`linear_add`, or None where oneDNN is not usable."""
    if w.device.type != "cpu" or not onednn_available(w.dtype):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)


def _use_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    return (
        packed is not None
        and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]
        and x.device.type == "cpu"
        and x.dtype == packed.dtype
        and not torch.is_grad_enabled()
    )


def _use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        rows >= ONEDNN_MIN_ROWS
        and x.device.type == "cpu"
        and x.dtype == w.dtype
        and not torch.is_grad_enabled()
        and onednn_available(x.dtype)
    )


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [..., in]; w: [out, in]; b: [out] or None; packed: pack_weight(w) or None -> [..., out]."""
    if _use_packed(x, packed):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    if _use_onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    return F.linear(x, w, b)


def linear_add(
    residual: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + x @ w^T (+ b), a new tensor. residual: [T, out]; x: [T, in]; w: [out, in]; packed as in linear."""
    if b is None and residual.dtype == x.dtype and (_use_packed(x, packed) or _use_onednn(x, w)):
        weight = packed if _use_packed(x, packed) else w
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), weight, None, "add")
    if b is None:
        return torch.addmm(residual, x, w.t())  # one GEMM accumulating into the residual
    return residual + F.linear(x, w, b)
