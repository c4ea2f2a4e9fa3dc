"""Dense projections `x @ W^T (+ b) (+ residual)` on the fastest exact CPU kernel this torch build has.

What it knows: torch's CPU `F.linear`/`addmm` call MKL's sgemm, which on the AMD
EPYC machines we run on takes a code path without AVX-512. oneDNN (bundled with
x86 torch builds, reached through `torch.ops.mkldnn._linear_pointwise`) picks its
kernel from the CPU's features. Given a weight it has blocked once in advance
(`pack_weight`, made by the model after loading, a second copy of the weights in
memory), it runs the same fp32 product about 2x faster than MKL from 32 rows up
(decode batches, prefill chunks); both accumulate in fp32 and differ only in
summation order (relative ~1e-6). At one row (batch-1 decode) MKL wins a
back-to-back microbenchmark on narrow weights, yet inside the engine the packed
path is faster at batch 1 as well, so every product with a packed copy takes it.
`python -m kvfence.bench.kernels [--cold]` times the kernels side by side and
`kvfence bench offline --baselines unpacked` times the engine both ways.

Whether oneDNN is usable is probed once per dtype (the ops exist, run, and agree
with `F.linear` on small products) and cached; without a packed copy (CUDA, fp16,
a build without oneDNN, a failed probe, autograd on) a product takes `F.linear`.

What it does not know: model shapes, or which weights a model chose to pack (Llama-family models pack
their fused projections and lm_head; DeepSeek / GLM-5 models every `Linear`, not the stacked routed experts).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """True if oneDNN's linear runs on the CPU for `dtype` with a packed weight and matches F.linear."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 40, generator=g).to(dtype)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        r = torch.randn(5, 24, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        results = [
            (torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""), F.linear(x, w, b)),
            (torch.ops.mkldnn._linear_pointwise(x[:1], packed, None, "none", [], ""), F.linear(x[:1], w)),
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
        and x.numel() > 0  # no rows (a step that wants no logits): nothing for oneDNN to do
        and x.device.type == "cpu"
        and x.dtype == packed.dtype
        and not torch.is_grad_enabled()
    )


@functools.cache
def row_bucket(rows: int) -> int:
    """The row count a oneDNN product of `rows` rows is padded to: 1, 2, 3, 4, 6, 8, 12, ... 192, 256 (two per
    octave), then 320, 384, 448, 512, 640, ... (four per octave): at most 50% padding below 256 rows, 25% above.

    oneDNN builds (and caches, about 0.6 MB each, up to 1,024 of them) one primitive per input shape it
    meets. A server's steps come in every row count, so unpadded products grew a 10-minute soak by 680 MB;
    buckets bound the shapes to about 7 products x 36 buckets up to 8,192 rows.
    """
    assert rows >= 1, rows
    if rows <= 4:
        return rows
    octave = 1 << (rows - 1).bit_length() - 1  # the power of two below rows (rows > octave)
    steps = (1.5, 2.0) if octave < 256 else (1.25, 1.5, 1.75, 2.0)
    return next(int(octave * f) for f in steps if octave * f >= rows)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [n, k] -> [rows, k] contiguous, x on top, zero rows below (their products are dropped)."""
    if x.shape[0] == rows and x.is_contiguous():
        return x
    out = x.new_empty(rows, x.shape[1])
    out[: x.shape[0]] = x
    out[x.shape[0] :] = 0
    return out


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [..., in]; w: [out, in]; b: [out] or None; packed: pack_weight(w) or None -> [..., out]."""
    if _use_packed(x, packed):
        x2 = x.reshape(-1, x.shape[-1])  # [n, in]
        n = x2.shape[0]
        y = torch.ops.mkldnn._linear_pointwise(_pad_rows(x2, row_bucket(n)), packed, b, "none", [], "")
        return y[:n].view(*x.shape[:-1], y.shape[-1])  # [..., out]
    return F.linear(x, w, b)


def linear_add(
    residual: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + x @ w^T (+ b), a new tensor. residual: [T, out]; x: [T, in]; w: [out, in]; packed as in linear."""
    if b is None and residual.dtype == x.dtype and _use_packed(x, packed):
        rows = row_bucket(x.shape[0])
        y = torch.ops.mkldnn._linear_pointwise.binary(
            _pad_rows(x, rows), _pad_rows(residual, rows), packed, None, "add"
        )  # [rows, out]
        return y[: x.shape[0]]
    if b is None:
        return torch.addmm(residual, x, w.t())  # one GEMM accumulating into the residual
    return residual + F.linear(x, w, b)


class Linear(nn.Linear):
    """nn.Linear whose forward takes the packed oneDNN route once `pack()` has made a copy of its weight.

    For models built from modules (DeepSeek / GLM-5): they call `pack()` on every Linear after loading.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed: torch.Tensor | None = None  # pack_weight(self.weight), kept out of the state dict

    def pack(self, enabled: bool = True) -> None:
        """Make (or drop) the packed copy from the current weight values."""
        self.packed = pack_weight(self.weight) if enabled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
