"""How fast this machine's cores read DRAM: the bound on a decode step that streams every weight once.

What it knows: the time torch takes to sum a tensor larger than any cache (reads only), then to copy it (a read
and a write per byte; the first copy also faults in the destination's pages), with the threads it is given.
What it does not know: anything about kvfence; it is a measuring script, not a test. The last-level cache may
still hold part of a tensor smaller than it, so use one well past the L3 size `lscpu` lists.

usage: python scripts/memory_bandwidth.py [--gib 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tensor read (GiB)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a = torch.ones(int(args.gib * (1 << 30)) // 4, dtype=torch.float32)
    nbytes = a.numel() * 4
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        print(f"read sum: {nbytes / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    b = torch.empty_like(a)
    for _ in range(2):
        t = time.perf_counter()
        b.copy_(a)
        print(f"copy: {2 * nbytes / (time.perf_counter() - t) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
