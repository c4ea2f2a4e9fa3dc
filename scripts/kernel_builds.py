"""The native kernels of this machine's default build against another build (extra compiler flags, e.g. -mno-avx2
for the plain C++ path, -mno-avx512f for the AVX2 path on an AVX-512 CPU, or another version of the source, e.g.
`git show HEAD~1:kvfence/models/native_kernels.cpp > /tmp/base.cpp`): the panel projections at the 100M preset's
shapes (decode rows, and a 512-row bfloat16 prefill product from the panels) and decode attention over a
bfloat16 pool, interleaved, with a check that both builds give the same projection bits.

What it knows: native_kernels.load(flags) (one build per flag set, cached), packed_linear and
paged_decode_attention; times are the second-best of 7 interleaved rounds, each the mean of 40 calls (projections)
or of 4 x 12 layers (attention, each layer's pages scattered over a pool too large for the cache).

What it does not know: the engine around the kernels (see scripts/profile_batch.py); it is a measuring
script, not a test.

usage: python scripts/kernel_builds.py [--flags=-mno-avx2] [--source OTHER.cpp] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def second_best(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(7):
        for name, fn in fns.items():
            fn()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return {name: sorted(ts)[1] for name, ts in times.items()}


_NONE = torch.empty(0)  # no bias, no residual (one tensor for every timed call)


def _packed_linear(m: Any, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return m.packed_linear(x, packed, n, _NONE, _NONE)


def _panel_gemm(m: Any, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return m.panel_gemm_bf16(x, packed, n, _NONE, _NONE)


def compare(label: str, builds: dict[str, Any], call: Callable[[Any], torch.Tensor], flops: int, calls: int) -> None:
    """call(module) on every build, timed interleaved; prints each build's time and rate, and whether all builds
    gave the same bits."""
    outs = [call(m) for m in builds.values()]
    same = all(torch.equal(o, outs[0]) for o in outs)
    t = second_best({name: functools.partial(call, m) for name, m in builds.items()}, calls)
    cells = "  ".join(f"{name} {s * 1e3:.3f} ms ({flops / s / 1e9:.0f} GFLOP/s)" for name, s in t.items())
    print(f"{label}: {cells}  same bits: {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flags", default="-mno-avx2", help="comma-separated extra flags of the other build")
    ap.add_argument("--source", type=Path, help="the other build's C++ source (default: this tree's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvfence.models import native_kernels as nk

    def other_build(flags: tuple[str, ...]) -> Any:
        if args.source is None:
            return nk.load(flags)
        this = nk._SOURCE_FILE
        nk._SOURCE_FILE = args.source  # load() names a build by a hash of its source and flags
        try:
            return nk.load.__wrapped__(flags)
        finally:
            nk._SOURCE_FILE = this

    flags = tuple(f for f in args.flags.split(",") if f)
    other = " ".join([*flags, *([args.source.name] if args.source else [])])
    builds = {"default": nk.load(), other: other_build(flags)}
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((4096, 768), (768, 2048)):
            packed = nk.pack_panels(torch.randn(n, k).to(dtype))
            shape = f"{str(dtype)[6:]:8} [{n}x{k}]"
            for rows in (1, 8, 32):
                linear = functools.partial(_packed_linear, x=torch.randn(rows, k), packed=packed, n=n)
                compare(f"{shape} rows {rows:2}", builds, linear, 2 * rows * n * k, 40)
            if dtype == torch.bfloat16 and all(m.panel_gemm_bf16_applies(k) for m in builds.values()):
                x = torch.randn(512, k).bfloat16()  # a prefill chunk, from the panels
                gemm = functools.partial(_panel_gemm, x=x, packed=packed, n=n)
                compare(f"{shape} gemm 512", builds, gemm, 2 * 512 * n * k, 4)
    page, hkv, h, d, layers = 16, 4, 12, 64, 12
    for b, length in ((8, 256), (32, 192)):
        pages_per_seq = length // page
        slots = (b * pages_per_seq * layers + 8) * page
        kc, vc = torch.randn(slots, hkv, d).bfloat16(), torch.randn(slots, hkv, d).bfloat16()
        pages = torch.randperm(slots // page)[: b * pages_per_seq * layers].view(layers, b, pages_per_seq)
        q, lens = torch.randn(b, h, d), torch.full((b,), length, dtype=torch.long)

        def step(m: object, case: tuple[torch.Tensor, ...]) -> None:
            q, kc, vc, pages, lens = case
            for layer in range(layers):
                m.paged_decode_attention(q, kc, vc, pages[layer], lens, page, d**-0.5)  # type: ignore[attr-defined]

        case = (q, kc, vc, pages, lens)
        t = second_best({name: functools.partial(step, m, case) for name, m in builds.items()}, 4)
        cells = "  ".join(f"{name} {s * 1e3:.2f} ms" for name, s in t.items())
        print(f"attention, {layers} layers of {b} x {length} tokens, {h}/{hkv} heads, D {d}, bf16 pool: {cells}")


if __name__ == "__main__":
    main()
