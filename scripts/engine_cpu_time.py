"""CPU seconds (this process, all threads) that the engine spends generating N x (prompt + output) tokens.

What it knows: the same workload as `kvfence bench offline` (random prompt ids, greedy, ignore_eos), run
`--repeats` times per configuration with the configurations interleaved, reporting the best wall time and
the best process CPU time of each. On a shared machine wall time measures the neighbours as much as the
engine; with --threads 1 CPU time is the engine's own work (cache contention still inflates it a little).

What it does not know: other systems (llama.cpp, transformers); `kvfence bench offline` compares those.

usage: python scripts/engine_cpu_time.py --num-prompts 32 --threads 1 --repeats 3 --configs torch,native_attn,native
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="torch,native_attn,native", help="comma-separated: torch, native_attn, native")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    model_dir = resolve_model_dir(args.model)
    configs = args.configs.split(",")
    engines = {}
    for c in configs:  # "torch", "native", or "native_attn": native decode attention with torch's RMSNorm
        cache = CacheConfig(enable_prefix_caching=False)  # the same prompts run again: no cache hits
        engines[c] = LLMEngine(EngineConfig(model=ModelConfig(model_dir, kernels=c.split("_")[0]), cache=cache))
        if c == "native_attn":
            engines[c].runner.model.use_native_kernels(False)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(engines.values())).vocab_size
    prompts = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    best: dict[str, tuple[float, float]] = {}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for c, e in engines.items():
            e.generate([p[:8] for p in prompts[:2]], warm)
            w0, c0 = time.perf_counter(), time.process_time()
            done = e.generate(prompts, params)
            w, cpu = time.perf_counter() - w0, time.process_time() - c0
            outs[c] = [d.token_ids for d in done]
            b = best.get(c, (float("inf"), float("inf")))
            best[c] = (min(b[0], w), min(b[1], cpu))
    base = configs[0]
    print(
        f"{args.num_prompts} x ({args.input_len} + {args.output_len}) tokens; model {model_dir}; "
        f"threads {args.threads}; best of {args.repeats} interleaved"
    )
    print(f"{'config':10s} {'wall s':>8s} {'cpu s':>8s} {'cpu ms/step':>12s} {'speed-up (cpu)':>15s} same tokens")
    for c in configs:
        w, cpu = best[c]
        same = sum(a == b for a, b in zip(outs[c], outs[base], strict=True))
        print(
            f"{c:10s} {w:8.2f} {cpu:8.2f} {1e3 * cpu / args.output_len:12.3f} {best[base][1] / cpu:14.2f}x "
            f"{same}/{args.num_prompts}"
        )


if __name__ == "__main__":
    main()
