"""Where an offline batch's time goes: prefill forwards vs decode steps, and inside the prefill forwards the
projections (by name), attention, norms and the rest; then the bare native decode step and a projection
micro-benchmark (GFLOP/s and weight GB/s) at the step's batch size.

What it knows: how to fill an engine with B random prompts of L tokens (greedy, ignore_eos), run them to N
output tokens, and time every engine step by whether its forward was a pure decode step. It wraps
DecoderLayer._project and models.llama.paged_attention to time the prefill forwards' parts.

What it does not know: anything about the server or other baselines; it is a measuring script, not a test. The
micro-benchmark repeats one layer's weight, which then comes from the last-level cache: its GB/s are above what a
decode step, streaming every layer's weights from DRAM, can get.

usage: python scripts/profile_batch.py [--model DIR] [--dtype bfloat16] [--batch 32] [--input-len 128]
       [--output-len 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-micro", action="store_true", help="skip the projection micro-benchmark")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.models import llama, native_kernels

    model_dir = resolve_model_dir(args.model)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model_dir=model_dir, kernels="native", dtype=args.dtype),
            cache=CacheConfig(max_total_tokens=max(65536, args.batch * (args.input_len + args.output_len + 64))),
        )
    )
    model = engine.runner.model
    print(f"amx_bf16: {native_kernels.load().amx_bf16()}")
    parts: dict[str, float] = collections.defaultdict(float)
    rows_seen: dict[str, int] = collections.defaultdict(int)
    state = {"prefill": False}

    orig_project = llama.DecoderLayer._project

    def project(self, name, x, b, residual=None, rows=None):  # type: ignore[no-untyped-def]
        if not state["prefill"]:
            return orig_project(self, name, x, b, residual, rows)
        t = time.perf_counter()
        y = orig_project(self, name, x, b, residual, rows)
        parts[f"proj {name}"] += time.perf_counter() - t
        rows_seen[f"proj {name}"] += x.shape[0]
        return y

    orig_attn = llama.paged_attention

    def attn(q, k, v, fb, scale, new_kv=None, native=False):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        y = orig_attn(q, k, v, fb, scale, new_kv, native)
        if state["prefill"]:
            parts["attention"] += time.perf_counter() - t
        return y

    orig_logits = model._logits

    def logits(x):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        y = orig_logits(x)
        if state["prefill"]:
            parts["head"] += time.perf_counter() - t
        return y

    llama.DecoderLayer._project = project  # type: ignore[method-assign]
    llama.paged_attention = attn
    model._logits = logits
    orig_forward = model.forward
    steps: list[tuple[str, int, float]] = []

    def forward(fb, pool):  # type: ignore[no-untyped-def]
        kind = "decode" if model._native_step_applies(fb) else ("prefill" if not fb.is_decode else "torch-decode")
        state["prefill"] = kind != "decode"
        t = time.perf_counter()
        y = orig_forward(fb, pool)
        steps.append((kind, int(fb.input_ids.shape[0]), time.perf_counter() - t))
        state["prefill"] = False
        return y

    model.forward = forward
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    for i in range(args.batch):
        ids = torch.randint(0, engine.vocab_size, (args.input_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
    t0 = time.perf_counter()
    n_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        n_steps += 1
    wall = time.perf_counter() - t0
    fwd = collections.defaultdict(lambda: [0, 0, 0.0])
    for kind, tokens, sec in steps:
        fwd[kind][0] += 1
        fwd[kind][1] += tokens
        fwd[kind][2] += sec
    shape = f"batch {args.batch}; {args.input_len}+{args.output_len}; threads {args.threads}"
    print(f"model {model_dir}; {args.dtype}; {shape}")
    print(f"wall {wall:.2f} s over {n_steps} engine steps; forwards {sum(s for *_, s in steps):.2f} s")
    for kind, (n, tokens, sec) in fwd.items():
        print(f"  {kind:13s} {n:4d} forwards {tokens:6d} tokens {sec:7.2f} s  ({1e3 * sec / n:.1f} ms each)")
    pre = fwd["prefill"][2]
    print("inside the prefill forwards:")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {v:6.2f} s ({100 * v / pre:4.1f}%)")
    print(f"  {'rest':18s} {pre - sum(parts.values()):6.2f} s")

    if args.no_micro:
        return
    # the projections alone, at prefill and decode row counts
    layer = model.blocks[0]
    print("projection micro-benchmark (layer 0's weights; packed_linear / F.linear on the unpacked weight):")
    for rows in (1, 8, 16, 32, 64, 128, 512, 2048):
        for name in llama.PROJECTIONS:
            n, k = layer.shapes[name]
            x = torch.randn(rows, k).to(model.dtype)
            panels = layer.panels[name]
            reps = max(2, int(2e9 / (2 * rows * n * k)))
            for path in ("panels", "F.linear"):
                if path == "F.linear" and rows < 32:
                    continue
                w = native_kernels.unpack_panels(panels, n, k) if path == "F.linear" else None

                def fn(x=x, w=w, panels=panels, n=n):  # type: ignore[no-untyped-def]
                    return (
                        torch.nn.functional.linear(x, w)
                        if w is not None
                        else native_kernels.packed_linear(x, panels, n)
                    )

                fn()
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                sec = (time.perf_counter() - t) / reps
                gbs = n * k * x.element_size() / sec / 1e9
                gflops = 2 * rows * n * k / sec / 1e9
                print(
                    f"  rows {rows:5d} {name:10s} [{n}x{k}] {path:8s} {1e3 * sec:8.3f} ms",
                    f"{gflops:8.1f} GFLOP/s  {gbs:6.1f} GB/s",
                )


if __name__ == "__main__":
    main()
