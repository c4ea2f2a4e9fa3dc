"""Resident memory of one aggregated engine: at start (engine built, nothing run), at steady state (after a
batch of greedy requests), and the process's peak; run it once per checkout to compare (PYTHONPATH picks it).

What it knows: /proc/self/status (VmRSS, VmHWM), the engine's public API (LLMEngine, generate), a fixed KV
capacity (--max-total-tokens) so two checkouts hold the same pool. Prints one JSON line.

With --llama-server it then measures llama-server (the cached `kvfence bench llama-cpp-setup` build) the same
way in the same run: the model's GGUF of the same dtype (model-f32/-bf16.llama.cpp-VERSION.gguf beside it),
the same KV capacity (-c, a K/V cache of the same dtype, -fa off), --batch slots, the same prompts as
--batch concurrent /completion requests; VmRSS after /health ("start") and 1 s after the requests ("steady"),
VmHWM ("peak"); and prints kvfence / llama-server for each.

What it does not know: the server or disaggregated workers (one process, one engine); it is a measuring
script, not a test.

usage: python scripts/weights_rss.py [--model DIR] [--kernels native] [--dtype float32] [--batch 8] [--llama-server]
"""

from __future__ import annotations

import argparse
import json
import time


def _status_kib(field: str, pid: str = "self") -> int:
    for line in open(f"/proc/{pid}/status", encoding="ascii"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _llama_server(model_dir: str, dtype: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    """llama-server's start / steady / peak resident MiB on the same model, KV capacity and requests."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx

    from kvfence.bench import llama_cpp
    from kvfence.math_utils import cdiv

    build = llama_cpp.find_build(targets=["llama-server"])
    if build is None:
        raise SystemExit(llama_cpp.missing_message(llama_cpp.build_location()))
    kind = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    gguf = Path(model_dir) / f"model-{kind}.llama.cpp-{build.version}.gguf"
    if not gguf.is_file():
        raise SystemExit(f"no {gguf}")
    with llama_cpp.launch_server(
        build, gguf, parallel=args.batch, context_per_slot=cdiv(args.max_total_tokens, args.batch),
        threads=args.threads, ready_timeout_s=120, flash_attn="off", kv_type=kind,
    ) as server:  # fmt: skip
        pid = str(server.proc.pid)
        start = _status_kib("VmRSS", pid)

        def complete(p: list[int]) -> int:
            body = {**llama_cpp.completion_body(p, args.output_len), "ignore_eos": True}
            return httpx.post(f"{server.url}/completion", json=body, timeout=600).status_code

        with ThreadPoolExecutor(len(prompts)) as pool:
            codes = list(pool.map(complete, prompts))
        assert codes == [200] * len(prompts), codes
        time.sleep(1.0)
        steady, peak = _status_kib("VmRSS", pid), _status_kib("VmHWM", pid)
    return {
        "rss_start_mib": round(start / 1024, 1),
        "rss_steady_mib": round(steady / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1),
    }


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
    ap.add_argument("--llama-server", action="store_true", help="then llama-server on the same model and KV capacity")
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
    ours = {
        "rss_start_mib": round(start / 1024, 1),
        "rss_steady_mib": round(steady / 1024, 1),
        "rss_peak_mib": round(_status_kib("VmHWM") / 1024, 1),
    }
    print(
        json.dumps(
            {
                "kvfence": str(kvfence.__file__).rsplit("/kvfence/", 1)[0],
                "model": str(model_dir),
                "kernels": engine.resolved.kernels,
                "dtype": args.dtype,
                "kv_pool_mib": round(engine.pool.num_pages * engine.resolved.bytes_per_page / 2**20, 1),
                "rss_before_engine_mib": round(base / 1024, 1),
                **ours,
                "engine_build_s": round(load_s, 2),
                "heap_bounds": getattr(engine, "heap_bounds", None),
            }
        ),
        flush=True,
    )
    if args.llama_server:
        theirs = _llama_server(str(model_dir), args.dtype, args, prompts)
        ratios = {k.replace("_mib", ""): round(ours[k] / theirs[k], 3) for k in ours}
        print(json.dumps({"llama-server": theirs, "kvfence / llama-server": ratios}), flush=True)


if __name__ == "__main__":
    main()
