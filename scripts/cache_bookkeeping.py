"""The prefix cache's and the page allocator's own cost (no model), in this tree and, with --base, another one.

What it knows: two workloads that run only kvfence.kv's bookkeeping, each in a child process per tree with that
tree first on sys.path, trees alternated, best of --repeats:
- `churn`: a pool of --pages pages that the prefix cache owns entirely (every page cached, unreferenced), then
  --rounds rounds of what a full pool does at each allocation: evict 16 pages, give them to a request, cache
  them again (insert) and stop reading them (release). Reported per round.
- `prompt`: one prompt of --prompt-tokens tokens cached a 512-token chunk at a time, as the scheduler does
  during a chunked prefill. Reported for the whole prompt.
The digest function is a constant (the cost of reading pages is the pool's, not measured here).

What it does not know: the model, the engine's step, or the scheduler's other work.

usage: git archive <commit> | tar -x -C /tmp/kvf-base
       python scripts/cache_bookkeeping.py --base /tmp/kvf-base
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PAGE = 16
CHUNK = 512


def _insert(cache: Any, rid: str, ids: list[int], table: list[int], first: int, n: int, prev: Any) -> Any:
    """`PrefixCache.insert` in either form: with the chain key of page first - 1 (and returning the next), or not."""
    if "prev" in inspect.signature(cache.insert).parameters:
        return cache.insert(rid, None, ids, table, first, n, prev)
    cache.insert(rid, None, ids, table, first, n)
    return None


def churn(pages: int, rounds: int) -> float:
    from kvfence.kv.allocator import PageAllocator
    from kvfence.kv.prefix_cache import PrefixCache

    alloc = PageAllocator(pages)
    cache = PrefixCache(alloc, PAGE, lambda ps: [0] * len(ps))
    ids = list(range(pages * PAGE))
    table = alloc.allocate("fill", pages)
    _insert(cache, "fill", ids, table, 0, pages, None)
    cache.release(table)
    t0 = time.perf_counter()
    for r in range(rounds):
        assert cache.evict(16) == 16
        mine = alloc.allocate(f"r{r}", 16)
        fresh = [r * 1000 + pages * PAGE + i for i in range(16 * PAGE)]  # a prompt nobody cached
        _insert(cache, f"r{r}", fresh, mine, 0, 16, None)
        cache.release(mine)
    seconds = (time.perf_counter() - t0) / rounds
    cache.check()
    alloc.check()
    return seconds


def prompt(tokens: int) -> float:
    from kvfence.kv.allocator import PageAllocator
    from kvfence.kv.prefix_cache import PrefixCache

    pages = tokens // PAGE
    alloc = PageAllocator(pages)
    cache = PrefixCache(alloc, PAGE, lambda ps: [0] * len(ps))
    ids = list(range(tokens))
    table = alloc.allocate("r", pages)
    t0 = time.perf_counter()
    prev = None
    for first in range(0, pages, CHUNK // PAGE):
        prev = _insert(cache, "r", ids, table, first, min(first + CHUNK // PAGE, pages), prev)
    seconds = time.perf_counter() - t0
    assert cache.num_cached == pages
    return seconds


def _child(tree: Path, case: str, args: argparse.Namespace) -> float:
    argv = [sys.executable, __file__, "--child", case, "--pages", str(args.pages), "--rounds", str(args.rounds),
            "--prompt-tokens", str(args.prompt_tokens)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, help="another kvfence tree to compare against (e.g. a git archive)")
    ap.add_argument("--pages", type=int, default=65536, help="pages of the churn pool (default: 65,536)")
    ap.add_argument("--rounds", type=int, default=200, help="churn rounds (default: 200)")
    ap.add_argument("--prompt-tokens", type=int, default=262144, help="tokens of the cached prompt (default: 262,144)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["churn", "prompt"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        seconds = churn(args.pages, args.rounds) if args.child == "churn" else prompt(args.prompt_tokens)
        print(json.dumps({"seconds": seconds}))
        return
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if args.base is not None:
        trees["base"] = args.base.resolve()
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeats):
        for case in ("churn", "prompt"):
            for name, tree in trees.items():
                s = _child(tree, case, args)
                best[case, name] = min(s, best.get((case, name), s))
    print(f"churn: {args.pages} cached pages, evict 16 + allocate + insert + release per round; "
          f"prompt: {args.prompt_tokens} tokens cached in {CHUNK}-token chunks; best of {args.repeats}")  # fmt: skip
    for case, unit, scale in (("churn", "ms per round", 1e3), ("prompt", "s per prompt", 1.0)):
        row = "  ".join(f"{name} {best[case, name] * scale:.3f}" for name in trees)
        ratio = f"  base / this: {best[case, 'base'] / best[case, 'this tree']:.1f}x" if "base" in trees else ""
        print(f"{case:7s} ({unit}): {row}{ratio}")


if __name__ == "__main__":
    main()
