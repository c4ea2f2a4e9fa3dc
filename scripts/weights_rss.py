"""Resident memory of one aggregated engine: at start (engine built, nothing run), at steady state (after a
batch of greedy requests), and the process's peak; run it once per checkout to compare (PYTHONPATH picks it).

What it knows: /proc/self/status (VmRSS, VmHWM), the engine's public API (LLMEngine, generate), a fixed KV
capacity (--max-total-tokens) so two checkouts hold the same pool. Prints one JSON line.

What it does not know: the server or disaggregated workers (one process, one engine); it is a measuring
script, not a test.

usage: python scripts/weights_rss.py [--model DIR] [--kernels native] [--dtype float32] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import time


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--kernels", default="native")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import kvfence
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    model_dir = resolve_model_dir(args.model)
    base = _status_kib("VmRSS")
    t0 = time.monotonic()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model_dir=model_dir, kernels=args.kernels, dtype=args.dtype),
            cache=CacheConfig(max_total_tokens=args.max_total_tokens),
        )
    )
    start = _status_kib("VmRSS")
    load_s = time.monotonic() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, engine.vocab_size, (args.input_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    engine.generate(prompts, params)
    time.sleep(1.0)  # an idle engine may hand its heap's free pages back on a thread of its own
    steady = _status_kib("VmRSS")
    print(
        json.dumps(
            {
                "kvfence": str(kvfence.__file__).rsplit("/kvfence/", 1)[0],
                "model": str(model_dir),
                "kernels": engine.resolved.kernels,
                "dtype": args.dtype,
                "kv_pool_mib": round(engine.pool.num_pages * engine.resolved.bytes_per_page / 2**20, 1),
                "rss_before_engine_mib": round(base / 1024, 1),
                "rss_start_mib": round(start / 1024, 1),
                "rss_steady_mib": round(steady / 1024, 1),
                "rss_peak_mib": round(_status_kib("VmHWM") / 1024, 1),
                "engine_build_s": round(load_s, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
