"""Profile steady decode steps of the engine at a batch size: wall time per phase and torch.profiler's top ops.

What it knows: how to fill an engine with N random prompts, run them past prefill, then time
`step()` split into schedule / runner.execute / update+outputs, and print torch.profiler's table
of the ops of a few steps (self CPU time). Used for docs/benchmarks.md "Engine step speed".

What it does not know: anything about the server; it is a measuring script, not a test.

usage: python scripts/profile_step.py [--model DIR] [--batch 1] [--steps 40] [--threads 1] [--kernels native]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--kernels", default="torch", choices=["torch", "native"], help="ModelConfig.kernels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    model_dir = resolve_model_dir(args.model)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model_dir=model_dir, kernels=args.kernels), cache=CacheConfig(max_total_tokens=65536)
        )
    )
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True, detokenize=False)
    for i in range(args.batch):
        ids = torch.randint(0, vocab, (args.input_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(8):  # warm: context copies built, kernels seen
        engine.step()

    phases = {"schedule": 0.0, "execute": 0.0, "update+outputs": 0.0}
    sched_fn, exec_fn = engine.scheduler.schedule, engine.runner.execute

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - t

        return wrapper

    engine.scheduler.schedule = timed("schedule", sched_fn)
    engine.runner.execute = timed("execute", exec_fn)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - t0
    phases["update+outputs"] = total - phases["schedule"] - phases["execute"]
    engine.scheduler.schedule, engine.runner.execute = sched_fn, exec_fn
    print(f"model {model_dir}; kernels {args.kernels}; batch {args.batch}; threads {args.threads}; {args.steps} steps")
    print(f"step: {1e3 * total / args.steps:.3f} ms")
    for k, v in phases.items():
        print(f"  {k:16s} {1e3 * v / args.steps:.3f} ms")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            with torch.profiler.record_function("engine.step"):
                engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=40))


if __name__ == "__main__":
    main()
