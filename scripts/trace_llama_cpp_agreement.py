"""Where kvfence's and llama.cpp's greedy tokens part on the `bench offline` workload, and by how much they disagree.

What it knows: the workload of `kvfence bench offline` (its `_prompts`: N random prompt ids of one length, seeded
by --seed, drawn from the engine's vocabulary; greedy, ignore_eos, one batch of N through `LLMEngine.generate`),
and the llama-server greedy run the bench compares with (`llama_cpp.greedy_tokens`: one request at a time on a
1-slot server, GGUF F32, fp32 KV cache). For every prompt whose tokens differ (up to the first end-of-generation
token, as `llama_cpp.agreement` judges) it finds the first differing step k and reports
  - both systems' tokens at k;
  - kvfence's top logprobs at k from the bench run itself (the same batch of N, with `logprobs`);
  - llama.cpp's top logprobs at k in its own greedy run (the same request with `n_probs`; this llama.cpp
    version answers `completion_probabilities`, one {id, logprob, top_logprobs: [{id, logprob}, ...]} per
    token, best first, from the raw logits, and leaves out the entry of a token that ends the text on an
    incomplete UTF-8 character, so entries are matched to steps by id: `align_probs`);
  - both systems' top logprobs at k queried exactly: prompt + the agreed k tokens as the prompt, one token
    out (kvfence prefill at batch 1; llama-server /completion with `n_predict` 1 and `n_probs`; a token-id
    array prompt gets no BOS added, see tokenize_input_subprompt in tools/server/server-common.cpp);
  - the gap between the top two candidates in each.
It runs llama-server once per `-fa` value of --flash-attn: `auto` is what the bench runs, and on CPU it turns
flash attention on, for which llama.cpp casts F32 K and V to F16 (build_attn_mha in src/llama-graph.cpp,
whatever -ctk/-ctv say) and the CPU decode kernel then converts Q to F16 and accumulates V in F16; `off` keeps
attention in F32. It also measures the noise floor of the comparison: over the steps where both agree, the
largest difference between the two systems' logprob of the chosen token, and, for --full-prompt, every logprob
of the first generated step from llama.cpp (n_probs = vocabulary) against transformers' forward on the same
checkpoint (the oracle kvfence is tested against) and kvfence's top 20 (the engine's most).

What it does not know: which of llama.cpp's F16 steps costs the most precision (not isolated); whether a
near tie would go the same way on another CPU or thread count. It runs one system at a time, llama-server
with --threads threads.

usage: PYTHONPATH=$PWD python scripts/trace_llama_cpp_agreement.py --num-prompts 32 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

TOP = 5  # alternatives per step asked of both systems


class Step(NamedTuple):
    """One position's top candidates, best first: (token id, logprob)."""

    top: tuple[tuple[int, float], ...]

    @property
    def gap(self) -> float:
        return self.top[0][1] - self.top[1][1]

    def logprob(self, token: int) -> float | None:
        return next((lp for t, lp in self.top if t == token), None)


class Divergence(NamedTuple):
    prompt: int
    step: int
    ours: int | None  # None: that side stopped (llama.cpp at an end-of-generation token)
    theirs: int | None
    ours_in_run: Step  # kvfence's logprobs at the step, from the batched bench run
    ours_exact: Step  # kvfence, prompt + agreed prefix as the prompt (prefill, batch 1)
    theirs_decode: Step | None  # llama-server's logprobs at the step of its own greedy run (None: not reported)
    theirs_exact: Step | None  # llama-server, prompt + agreed prefix as the prompt (None: not reported)


class LlamaTrace(NamedTuple):
    """What one llama-server configuration gave on the workload."""

    flash_attn: str
    tokens: list[list[int]]  # the bench's greedy requests
    firsts: list[int | None]  # first differing step of each prompt
    divergences: list[Divergence]
    floor: float  # max |kvfence - llama.cpp| logprob of the chosen token over the agreed steps
    floor_steps: int
    moved: int  # prompts whose llama.cpp tokens changed when n_probs was set
    full: str | None


def _say(msg: str) -> None:
    print(f"trace: {msg}", file=sys.stderr, flush=True)


def first_difference(ours: Sequence[int], theirs: Sequence[int], eog: frozenset[int]) -> int | None:
    """The first step where the two greedy runs differ, judged as `llama_cpp.agreement` does; None if they agree."""

    def cut(tokens: Sequence[int]) -> tuple[list[int], bool]:
        for i, t in enumerate(tokens):
            if t in eog:
                return list(tokens[:i]), True
        return list(tokens), False

    (a, a_eog), (b, b_eog) = cut(ours), cut(theirs)
    if a == b and (a_eog or b_eog or len(b) == len(theirs) == len(ours)):
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _body(prompt: list[int], n_predict: int, n_probs: int) -> dict[str, Any]:
    from kvfence.bench.llama_cpp import completion_body

    return {**completion_body(prompt, n_predict), "n_probs": n_probs}


def _steps(entries: list[dict[str, Any]]) -> list[Step]:
    return [Step(tuple((int(p["id"]), float(p["logprob"])) for p in e["top_logprobs"])) for e in entries]


def align_probs(tokens: Sequence[int], entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step index -> llama-server's probability entry. The server leaves out the entry of every token that
    ends the text on an incomplete UTF-8 character (random byte-level ids do), so the entries are a subsequence
    of the tokens: matched in order by id."""
    out, j = {}, 0
    for e in entries:
        while j < len(tokens) and tokens[j] != e["id"]:
            j += 1
        if j == len(tokens):
            break
        out[j] = e
        j += 1
    return out


def llama_step(client: Any, url: str, prompt: list[int], n_probs: int) -> Step | None:
    """llama-server's top `n_probs` logprobs for the next token after `prompt` (token ids, no BOS added);
    None when it reports none (the token is an incomplete UTF-8 character)."""
    r = client.post(f"{url}/completion", json=_body(prompt, 1, n_probs))
    if r.status_code != 200:
        raise RuntimeError(f"llama-server /completion answered {r.status_code}: {r.text[:300]}")
    steps = _steps(r.json()["completion_probabilities"])
    return steps[0] if steps else None


def launch(build: Any, gguf: Any, ctx: int, threads: int, flash_attn: str) -> Any:
    """The bench's llama-server (1 slot, fp32 KV cache), with `-fa flash_attn` (the bench leaves it at auto)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from kvfence.bench.launch import LaunchedServer
    from kvfence.bench.llama_cpp import server_command
    from kvfence.disagg.launcher import free_port

    port = free_port("127.0.0.1")
    cmd = server_command(build, gguf, host="127.0.0.1", port=port, parallel=1, context_per_slot=ctx, threads=threads)
    cmd += ["-fa", flash_attn]
    log = Path(tempfile.mkdtemp(prefix="kvfence-trace-")) / f"llama-server-fa-{flash_attn}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = LaunchedServer("llama.cpp", "llama.cpp", f"http://127.0.0.1:{port}", " ".join(cmd), proc, log)
    server.wait_ready(300.0)
    return server


def kvfence_steps(engine: Any, prompts: list[list[int]]) -> list[Step]:
    """kvfence's top-TOP logprobs for the next token of each prompt, one prompt at a time (prefill only)."""
    from kvfence.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False, logprobs=TOP)
    return [Step(engine.generate([p], params)[0].logprobs[0].top) for p in prompts]


def _top2(step: Step | None) -> str:
    if step is None:
        return "n/a"
    return " ".join(f"{t}:{lp:.6f}" for t, lp in step.top[:2]) + f"  {step.gap:.1e}"


def _tok(t: int | None) -> str:
    return "stop" if t is None else str(t)


def divergence_table(divs: list[Divergence]) -> str:
    from kvfence.bench.offline import _aligned

    rows = [
        (
            "prompt",
            "step",
            "kvfence",
            "llama.cpp",
            "kvfence top-2, gap (in run)",
            "kvfence top-2, gap (exact)",
            "llama.cpp top-2, gap (its decode)",
            "llama.cpp top-2, gap (exact)",
        )
    ]
    for d in divs:
        rows.append(
            (
                str(d.prompt),
                str(d.step),
                _tok(d.ours),
                _tok(d.theirs),
                _top2(d.ours_in_run),
                _top2(d.ours_exact),
                _top2(d.theirs_decode),
                _top2(d.theirs_exact),
            )
        )
    return _aligned(rows)


def full_first_step(hf: Any, engine: Any, client: Any, url: str, prompt: list[int], vocab: int) -> str:
    """Every logprob of the first generated step: llama.cpp vs transformers (full vocabulary), vs kvfence (top 20)."""
    from kvfence.engine.sampling_params import MAX_LOGPROBS, SamplingParams

    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [vocab]
    theirs = llama_step(client, url, prompt, vocab)
    if theirs is None:
        return "first step: llama.cpp reported no probabilities (an incomplete UTF-8 token)"
    lp = torch.full((vocab,), math.nan, dtype=torch.float64)
    for t, v in theirs.top:
        lp[t] = v
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False, logprobs=MAX_LOGPROBS)
    ours = engine.generate([prompt], params)[0].logprobs[0].top
    d_llama = (lp - ref).abs()
    d_llama = d_llama[d_llama.isfinite()]  # tokens llama.cpp did not return, or whose probability underflowed
    d_ours = max(abs(v - ref[t].item()) for t, v in ours)
    d_top = max(abs(v - lp[t].item()) for t, v in ours)
    return (
        f"first step, all {d_llama.numel()} logprobs: max |llama.cpp - transformers| {d_llama.max().item():.1e} "
        f"(median {d_llama.median().item():.1e}); top {MAX_LOGPROBS}: max |kvfence - transformers| {d_ours:.1e}, "
        f"max |kvfence - llama.cpp| {d_top:.1e}"
    )


def trace_llama(
    args: argparse.Namespace,
    build: Any,
    gguf: Any,
    engine: Any,
    hf: Any,
    prompts: list[list[int]],
    ours: list[list[int]],
    ours_lp: list[list[Any]],
    eog: frozenset[int],
    flash_attn: str,
) -> LlamaTrace:
    """Run the bench's llama-server requests under `-fa flash_attn` and trace each disagreement."""
    import httpx

    from kvfence.bench import llama_cpp

    o = args.output_len
    with launch(build, gguf, args.input_len + o + 8, args.threads, flash_attn) as server:
        _say(f"llama-server -fa {flash_attn}: the bench's greedy requests ({server.url})")
        theirs = llama_cpp.greedy_tokens(server.url, prompts, o)
        firsts = [first_difference(a, b, eog) for a, b in zip(ours, theirs, strict=True)]
        differing = [i for i, k in enumerate(firsts) if k is not None]
        queries = [prompts[i] + ours[i][: firsts[i]] for i in differing]  # type: ignore[misc]
        decode: list[dict[int, dict[str, Any]]] = []
        floor, floor_steps, moved = 0.0, 0, 0
        with httpx.Client(timeout=600.0) as client:
            _say(f"llama-server -fa {flash_attn}: the same requests with n_probs {TOP}")
            for i, p in enumerate(prompts):
                r = client.post(f"{server.url}/completion", json=_body(p, o, TOP)).json()
                moved += r["tokens"] != theirs[i]
                decode.append(align_probs(r["tokens"], r["completion_probabilities"]))
                k = firsts[i] if firsts[i] is not None else len(theirs[i])
                for j, e in decode[i].items():  # the agreed steps: how far apart the chosen token's logprobs are
                    if j < k and j < len(ours_lp[i]):
                        floor = max(floor, abs(e["logprob"] - ours_lp[i][j].logprob))
                        floor_steps += 1
            _say(f"llama-server -fa {flash_attn}: {len(differing)} exact step queries")
            theirs_exact = [llama_step(client, server.url, q, TOP) for q in queries]
            full = None
            if 0 <= args.full_prompt < len(prompts):
                full = full_first_step(hf, engine, client, server.url, prompts[args.full_prompt], engine.vocab_size)
    ours_exact = kvfence_steps(engine, queries)
    divs = []
    for j, i in enumerate(differing):
        k = firsts[i]
        assert k is not None
        e = decode[i].get(k)
        divs.append(
            Divergence(
                i,
                k,
                ours[i][k] if k < len(ours[i]) else None,
                theirs[i][k] if k < len(theirs[i]) else None,
                Step(ours_lp[i][k].top),
                ours_exact[j],
                None if e is None else _steps([e])[0],
                theirs_exact[j],
            )
        )
    return LlamaTrace(flash_attn, theirs, firsts, divs, floor, floor_steps, moved, full)


def report(t: LlamaTrace, n: int) -> None:
    same = sum(k is None for k in t.firsts)
    print(f"\nllama-server -fa {t.flash_attn}: same greedy tokens {same}/{n}")
    if t.divergences:
        print(divergence_table(t.divergences))
        gaps = sorted(d.ours_in_run.gap for d in t.divergences)
        first = sum(d.theirs_exact is not None and d.theirs_exact.top[0][0] == d.ours for d in t.divergences)
        print(
            f"kvfence's top-2 gap at the divergences: median {gaps[len(gaps) // 2]:.1e}, max {gaps[-1]:.1e}; "
            f"llama.cpp's exact (prefill) query ranks kvfence's token first in {first}/{len(t.divergences)}"
        )
    moved = f"; {t.moved} prompts' llama.cpp tokens changed with n_probs set" if t.moved else ""
    print(
        f"max |kvfence - llama.cpp| logprob of the chosen token over {t.floor_steps} agreed steps: {t.floor:.1e}{moved}"
    )
    if t.full:
        print(t.full)


def main() -> int:
    import transformers

    from kvfence.bench import llama_cpp
    from kvfence.bench.offline import _prompts
    from kvfence.config import add_engine_arguments, engine_config_from_args, resolve_model_dir
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="the bench's prompt seed (default: 0, as the bench)")
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default: 2)")
    ap.add_argument("--flash-attn", default="auto,off", help="llama-server -fa values to trace, comma-separated "
                    "(default: auto,off; the bench runs auto)")  # fmt: skip
    ap.add_argument("--full-prompt", type=int, default=0, metavar="I", help="prompt whose first step is compared "
                    "over the whole vocabulary (-1: none; default: 0)")  # fmt: skip
    add_engine_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model, _say)
    engine = LLMEngine(engine_config_from_args(args, model_dir, seed=args.seed))
    vocab = engine.vocab_size or 1000
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    eog = frozenset(getattr(engine.tokenizer, "eos_token_ids", ()) or ())
    n, o = args.num_prompts, args.output_len
    build = llama_cpp.find_build()
    if build is None:
        print(llama_cpp.missing_message(llama_cpp.build_location()))
        return 1
    gguf = llama_cpp.ensure_gguf(model_dir, build, _say)

    # kvfence as the bench runs it (warm-up, then one batch of N), then again asking for logprobs
    plain = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False)
    engine.generate([p[:8] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    _say(f"kvfence: {n} x ({args.input_len} + {o}) greedy, one batch")
    ours = [c.token_ids for c in engine.generate(prompts, plain)]
    with_lp = engine.generate(prompts, dataclasses.replace(plain, logprobs=TOP))
    lp_same = sum(c.token_ids == t for c, t in zip(with_lp, ours, strict=True))
    ours_lp = [c.logprobs or [] for c in with_lp]
    _say(f"kvfence: the same {n} prompts one at a time (batch invariance)")
    alone = sum(engine.generate([p], plain)[0].token_ids == t for p, t in zip(prompts, ours, strict=True))
    hf = None
    if args.full_prompt >= 0:
        transformers.utils.logging.disable_progress_bar()
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    traces = [
        trace_llama(args, build, gguf, engine, hf, prompts, ours, ours_lp, eog, fa) for fa in args.flash_attn.split(",")
    ]
    print(
        f"model {model_dir}; {n} prompts x ({args.input_len} + {o}) tokens, seed {args.seed}; threads {args.threads}; "
        f"kvfence kernels {args.kernels}"
    )
    print(f"kvfence: batch {n} vs the same with logprobs {lp_same}/{n} the same tokens, vs batch 1 {alone}/{n}")
    for t in traces:
        report(t, n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
