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

What it does not know: model shapes, or anything about the batch beyond its row count.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 16  # measured crossover on the 2-core EPYC: MKL wins below, oneDNN from here up
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
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        z = torch.ops.mkldnn._linear_pointwise.binary(x, r, w, None, "add")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok_y = torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol * 10)
    ok_z = torch.allclose(z.float(), (r + F.linear(x, w)).float(), rtol=tol, atol=tol * 10)
    return bool(ok_y and ok_z)


def _use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        rows >= ONEDNN_MIN_ROWS
        and x.device.type == "cpu"
        and x.dtype == w.dtype
        and not torch.is_grad_enabled()
        and onednn_available(x.dtype)
    )


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in]; w: [out, in]; b: [out] or None -> [..., out]."""
    if _use_onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    return F.linear(x, w, b)


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ w^T (+ b), a new tensor. residual: [T, out]; x: [T, in]; w: [out, in]."""
    if _use_onednn(x, w) and b is None and residual.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), w, None, "add")
    if b is None:
        return torch.addmm(residual, x, w.t())  # one GEMM accumulating into the residual
    return residual + F.linear(x, w, b)
