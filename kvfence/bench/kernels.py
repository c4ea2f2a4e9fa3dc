"""`python -m kvfence.bench.kernels`: the projection kernels of models.linear against torch's F.linear.

What it knows: the five projection shapes of a Llama-family model (q/k/v fused,
o, gate/up fused, down, lm_head) for a given hidden / intermediate / head / vocab
size, and how to time one product per kernel — F.linear (MKL on x86 builds),
oneDNN on the plain weight, oneDNN on a pack_weight copy — interleaved call by
call, so a noisy neighbour slows every kernel alike. It prints the median time per
call and each kernel's speed-up over F.linear at several row counts (1 = batch-1
decode, 32 = a decode batch, 2048 = a prefill chunk).

What it does not know: the engine; `kvfence bench offline` measures that end to end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kvfence.models.linear import onednn_available, pack_weight


def _shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of each projection weight."""
    head_dim = hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "lm_head": (vocab, hidden),
    }


def _median_us(fns: dict[str, Callable[[], object]], calls: int, evict: torch.Tensor | None) -> dict[str, float]:
    for fn in fns.values():  # warm-up: oneDNN builds its primitive on the first call of a shape
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            if evict is not None:  # stream a buffer bigger than the caches first, as a decode step does
                evict.add_(1)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfence.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--rows", default="1,32,2048", help="comma-separated row counts (default: 1,32,2048)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--cold", action="store_true", help="evict the caches (stream 128 MiB) before every timed call")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32
    if not onednn_available(dtype):
        print("oneDNN is not usable in this torch build: models.linear uses F.linear only")
        return 0
    shapes = _shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    evict = torch.zeros(32 << 20) if args.cold else None  # 128 MiB of fp32
    caches = "caches evicted before each call" if args.cold else "warm caches"
    threads = torch.get_num_threads()
    print(f"projection kernels, fp32, torch threads {threads}, {caches}; median us per call, interleaved")
    columns = ("F.linear", "oneDNN", "packed", "oneDNN/F", "packed/F")
    header = f"{'rows':>5}  {'weight':8}  " + "  ".join(f"{c:>9}" for c in columns)
    print(header)
    print("-" * len(header))
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        calls = 20 if rows >= 1024 or args.cold else 300
        for name, (out_f, in_f) in shapes.items():
            x = torch.randn(rows, in_f, generator=g)
            w = torch.randn(out_f, in_f, generator=g) * in_f**-0.5
            packed = pack_weight(w)
            assert packed is not None
            with torch.inference_mode():
                us = _median_us(
                    {
                        "aten": partial(F.linear, x, w),
                        "onednn": partial(torch.ops.mkldnn._linear_pointwise, x, w, None, "none", [], ""),
                        "packed": partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
                    },
                    calls,
                    evict,
                )
            print(
                f"{rows:>5}  {name:8}  {us['aten']:>9.1f}  {us['onednn']:>9.1f}  {us['packed']:>9.1f}  "
                f"{us['aten'] / us['onednn']:>8.2f}x  {us['aten'] / us['packed']:>8.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
