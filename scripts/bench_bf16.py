"""kvfence's native bfloat16 path against its float32 one and transformers bfloat16, in the same run.

What it knows: how to run N random-token requests (greedy, ignore_eos) through kvfence engines (--kernels
native, --dtype bfloat16 and float32) and transformers generate (bfloat16, and float32 as the oracle of
the agreement check only, untimed), in interleaved rounds keeping each system's best; it prints tok/s with
ratios, and greedy agreement: whole outputs equal (k/N), the mean length of the common prefix, and at each
first divergence from transformers float32 the float32 model's margin there (its top-1 logit minus its logit
of the token the other system chose: a small margin is a near tie that bfloat16 rounding can flip).

What it does not know: the server, or vLLM (kvfence bench offline --baselines vllm where it exists).

usage: python scripts/bench_bf16.py [--model DIR] [--num-prompts 8] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _margins(hf32: Any, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]]) -> list[float]:
    """At each sequence's first divergence of `other` from `ref` (the float32 oracle's tokens): the oracle's
    logit of its own token minus its logit of the token `other` chose there."""
    out = []
    with torch.inference_mode():
        for p, r, o in zip(prompts, ref, other, strict=True):
            k = _prefix(r, o)
            if k >= min(len(r), len(o)):
                continue
            logits = hf32(torch.tensor([p + r[:k]])).logits[0, -1].float()
            out.append(float(logits[r[k]] - logits[o[k]]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvfence.bench.offline import _hf_model, _prompts, run_hf_generate, run_kvfence
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine

    model_dir = resolve_model_dir(args.model)
    n, i, o = args.num_prompts, args.input_len, args.output_len

    def engine(dtype: str) -> Any:
        return LLMEngine(
            EngineConfig(
                model=ModelConfig(model_dir=model_dir, kernels="native", dtype=dtype),
                cache=CacheConfig(max_total_tokens=max(16384, n * (i + o)), enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_seqs=max(n, 1)),
            )
        )

    bf16, fp32 = engine("bfloat16"), engine("float32")
    assert bf16.resolved.kernels == fp32.resolved.kernels == "native"
    prompts = _prompts(n, i, bf16.vocab_size, args.seed)
    hf16 = _hf_model(model_dir, torch.bfloat16, "sdpa")
    systems = [
        ("kvfence native bf16", lambda: run_kvfence(bf16, prompts, o, "kvfence native bf16")),
        ("kvfence native fp32", lambda: run_kvfence(fp32, prompts, o, "kvfence native fp32")),
        ("transformers generate bf16", lambda: run_hf_generate(hf16, prompts, o, 0)),
    ]
    print(
        f"bf16 vs fp32: {n} requests x ({i} prompt + {o} output) tokens, greedy, ignore_eos; model {model_dir}; "
        f"torch threads {torch.get_num_threads()}; best of {args.repeats} interleaved runs"
    )
    best: dict[str, Any] = {}
    for r in range(args.repeats):
        for name, fn in systems:
            res = fn()
            print(f"  repeat {r + 1}: {name} {res.output_tokens / res.seconds:,.1f} output tok/s", flush=True)
            if name not in best or res.seconds < best[name].seconds:
                best[name] = res
    ours = best["kvfence native bf16"]
    print(f"{'system':28s} {'seconds':>8s} {'output tok/s':>13s} {'bf16 ours / this':>17s}")
    for name, _ in systems:
        res = best[name]
        ratio = "-" if res is ours else f"{ours.seconds and res.seconds / ours.seconds:.2f}x"
        print(f"{name:28s} {res.seconds:8.2f} {res.output_tokens / res.seconds:13,.1f} {ratio:>17s}")

    t0 = time.perf_counter()
    hf32 = _hf_model(model_dir, torch.float32, "sdpa")
    ref = run_hf_generate(hf32, prompts, o, 0).outputs  # the oracle's tokens (untimed)
    outputs = {name: best[name].outputs for name, _ in systems} | {"transformers generate fp32": ref}
    print(f"greedy agreement ({o} tokens each; oracle transformers fp32, {time.perf_counter() - t0:.0f} s):")
    pairs = [
        ("kvfence native bf16", "transformers generate bf16"),
        ("kvfence native bf16", "transformers generate fp32"),
        ("transformers generate bf16", "transformers generate fp32"),
        ("kvfence native fp32", "transformers generate fp32"),
    ]
    for a, b in pairs:
        same = sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))
        prefix = statistics.mean(_prefix(x, y) for x, y in zip(outputs[a], outputs[b], strict=True))
        line = f"  {a} vs {b}: {same}/{n} identical, mean common prefix {prefix:.1f}/{o}"
        if b == "transformers generate fp32":
            m = _margins(hf32, prompts, ref, outputs[a])
            if m:
                line += f"; fp32 margin at first divergence: median {statistics.median(m):.3f}, max {max(m):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
