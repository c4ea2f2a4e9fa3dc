"""`kvfence bench soak`: K clients for a bounded time against one server, then check it came back clean.

What it knows: a request mix (normal requests, streamed or not; over-length prompts
that must be refused with 400 context_length_exceeded; streams the client closes after
a few tokens), the per-client loop that sends it until the deadline, and what counts as
a violation:

  - any 5xx, any transport error (connection refused/reset, timeout) on a request the
    client did not abort itself, any error event inside a 200 stream;
  - an over-length prompt answered with anything but 400 context_length_exceeded;
  - a normal request whose usage.prompt_tokens differs from the tokens sent, or that
    returned more tokens than max_tokens;
  - an integrity record (the `kvfence.integrity` field) with status rejected/failed;
  - KV pages in use (+ quarantined) per role not back to the pre-load baseline once the
    server is idle again, or requests still running/waiting;
  - process RSS grown by more than a bound between the warmed-up baseline and the end.

Page numbers come from /server_info (`stats.roles`), else from /metrics
(kvfence_kv_pages_*). RSS comes from /server_info when it reports one (a key with
"rss" in its name), else from /proc/<pid>/status of the processes the soak started.

What it does not know: the server's internals. Loopback only unless allow_remote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfence.bench.client import (
    INTEGRITY_FAILURES,
    RequestResult,
    check_target,
    get_json,
    get_text,
    parse_prometheus,
    read_server_facts,
    send_completion,
)
from kvfence.bench.launch import add_launch_arguments, launch_server, rss_bytes, vocab_size_of

MAX_CLIENTS = 256
MAX_DURATION_S = 4 * 3600.0


@dataclass(frozen=True)
class SoakMix:
    """Relative weights of the request kinds each client draws from."""

    normal: float = 0.7
    overlength: float = 0.15
    abort: float = 0.15

    def __post_init__(self) -> None:
        assert min(self.normal, self.overlength, self.abort) >= 0 and self.total > 0, self

    @property
    def total(self) -> float:
        return self.normal + self.overlength + self.abort

    @classmethod
    def parse(cls, text: str) -> SoakMix:
        """`normal=0.7,overlength=0.15,abort=0.15` (missing kinds get weight 0)."""
        weights = {"normal": 0.0, "overlength": 0.0, "abort": 0.0}
        try:
            for part in text.split(","):
                k, _, v = part.partition("=")
                if k.strip() not in weights:
                    raise ValueError(k)
                weights[k.strip()] = float(v)
            return cls(**weights)
        except (ValueError, AssertionError):
            raise argparse.ArgumentTypeError(
                f"{text!r}: give weights like normal=0.7,overlength=0.15,abort=0.15"
            ) from None

    def draw(self, rng: random.Random) -> str:
        x = rng.random() * self.total
        if x < self.normal:
            return "normal"
        return "overlength" if x < self.normal + self.overlength else "abort"


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 4
    duration_s: float = 15.0
    mix: SoakMix = SoakMix()
    seed: int = 0
    prompt_len: tuple[int, int] = (4, 48)  # normal / abort prompts, uniform, tokens
    max_tokens: tuple[int, int] = (1, 24)  # normal requests, uniform
    abort_max_tokens: int = 64  # aborted streams ask for this many and close after 1-3 tokens
    request_timeout_s: float = 120.0
    warmup_requests: int = 4  # before the RSS baseline (first requests allocate)
    sample_interval_s: float = 1.0
    settle_timeout_s: float = 30.0  # time the server gets to return to idle after the load
    max_rss_growth_mb: float = 256.0
    model: str | None = None
    vocab_size: int | None = None  # when the server does not report one (prompt ids are drawn below it)
    allow_remote: bool = False

    def __post_init__(self) -> None:
        assert 1 <= self.clients <= MAX_CLIENTS, f"clients must be in [1, {MAX_CLIENTS}]"
        assert 0 < self.duration_s <= MAX_DURATION_S, f"duration must be in (0, {MAX_DURATION_S:.0f}] s"
        assert 1 <= self.prompt_len[0] <= self.prompt_len[1] and 1 <= self.max_tokens[0] <= self.max_tokens[1]


@dataclass
class Sample:
    t: float  # seconds since the soak started
    phase: str  # "baseline" | "load" | "settle" | "final"
    pages: dict[str, int]  # role -> pages used + quarantined
    running: int | None
    waiting: int | None
    rss_bytes: int | None
    rss_source: str = "none"  # "server_info" | "/proc" | "none"


@dataclass
class SoakReport:
    url: str
    config: dict[str, Any]
    requests: dict[str, int] = field(default_factory=dict)  # kind -> sent
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> status/code -> count
    five_xx: int = 0
    transport_errors: int = 0
    stream_errors: int = 0
    overlength_unexpected: list[str] = field(default_factory=list)
    normal_unexpected: list[str] = field(default_factory=list)
    integrity: dict[str, int] = field(default_factory=dict)  # status -> count
    integrity_failures: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    samples: list[Sample] = field(default_factory=list)
    baseline_pages: dict[str, int] = field(default_factory=dict)
    final_pages: dict[str, int] = field(default_factory=dict)
    max_pages: dict[str, int] = field(default_factory=dict)
    rss_source: str = "none"
    rss_baseline: int | None = None
    rss_final: int | None = None
    rss_max: int | None = None
    violations: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def rss_growth_mb(self) -> float | None:
        if self.rss_baseline is None or self.rss_final is None:
            return None
        return (self.rss_final - self.rss_baseline) / 2**20

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["rss_growth_mb"] = self.rss_growth_mb
        return d

    def format(self) -> str:
        total = sum(self.requests.values())
        lines = [f"soak {self.url}: {total} requests in {self.elapsed_s:.1f} s, {self.config['clients']} clients"]
        for kind in ("normal", "overlength", "abort"):
            if kind in self.requests:
                st = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.get(kind, {}).items()))
                lines.append(f"  {kind:<11} {self.requests[kind]:>6}   {st}")
        lines.append(
            f"  5xx: {self.five_xx}   transport errors: {self.transport_errors}   "
            f"stream errors: {self.stream_errors}   client aborts: {self.aborted}"
        )
        integ = ", ".join(f"{k}: {v}" for k, v in sorted(self.integrity.items())) or "no records in responses"
        lines.append(f"  integrity: {integ}")
        lines.append(
            f"  KV pages (used+quarantined) baseline {self.baseline_pages} max {self.max_pages} "
            f"final {self.final_pages}"
        )

        def mb(b: int | None) -> str:
            return "-" if b is None else f"{b / 2**20:.0f} MiB"

        growth = self.rss_growth_mb
        lines.append(
            f"  RSS ({self.rss_source}): baseline {mb(self.rss_baseline)} max {mb(self.rss_max)} "
            f"final {mb(self.rss_final)} growth {'-' if growth is None else f'{growth:+.1f} MiB'}"
        )
        lines.append("  PASS" if self.ok else "  FAIL:\n" + "\n".join(f"    - {v}" for v in self.violations))
        return "\n".join(lines)


# ---- server state ----------------------------------------------------------------------------------------------


def _find_rss(obj: Any) -> int | None:
    """Sum of the integer values under keys naming an RSS in bytes (e.g. rss_bytes) anywhere in `obj`."""
    total, found = 0, False
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                if isinstance(v, (int, float)) and "rss" in str(k).lower() and "bytes" in str(k).lower():
                    total += int(v)
                    found = True
                else:
                    stack.append(v)
        elif isinstance(x, list):
            stack.extend(x)
    return total if found else None


async def _sample(client: httpx.AsyncClient, url: str, pids: list[int], t0: float, phase: str) -> Sample:
    info = await get_json(client, f"{url}/server_info")
    stats = (info or {}).get("stats") or {}
    pages: dict[str, int] = {}
    running = stats.get("num_running")
    waiting = stats.get("num_waiting")
    for role, nums in (stats.get("roles") or {}).items():
        if "pages_used" in nums:
            pages[str(role)] = int(nums["pages_used"]) + int(nums.get("pages_quarantined", 0))
    if not pages:  # no /server_info stats: read the Prometheus gauges
        text = await get_text(client, f"{url}/metrics")
        if text:
            m = parse_prometheus(text)
            for (name, labels), v in m.items():
                role = dict(labels).get("role")
                if role and name in ("kvfence_kv_pages_used", "kvfence_kv_pages_quarantined"):
                    pages[role] = pages.get(role, 0) + int(v)
                if name == "kvfence_num_running_requests":
                    running = int(v)
                if name == "kvfence_num_waiting_requests":
                    waiting = int(v)
    rss, source = (_find_rss(info) if info else None), "server_info"
    if rss is None and pids:
        rss, source = rss_bytes(pids), "/proc"
    return Sample(time.monotonic() - t0, phase, pages, running, waiting, rss, source if rss is not None else "none")


# ---- the clients -----------------------------------------------------------------------------------------------


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(16, vocab // 2)  # keep clear of the low ids where tokenizers put their special tokens
    return [rng.randrange(lo, vocab) for _ in range(n)]


async def _client_loop(
    i: int,
    client: httpx.AsyncClient,
    url: str,
    cfg: SoakConfig,
    model: str,
    vocab: int,
    over_len: int,
    deadline: float,
    out: list[RequestResult],
) -> None:
    rng = random.Random(cfg.seed * 1000 + i)
    while time.monotonic() < deadline:
        kind = cfg.mix.draw(rng)
        if kind == "overlength":
            n = over_len + rng.choice([0, 1, 17, over_len // 2])
            body = {"model": model, "prompt": _random_ids(rng, n, vocab), "max_tokens": 1, "stream": rng.random() < 0.5}
            out.append(await send_completion(client, url, body, kind=kind, prompt_len=n))
            continue
        n = rng.randint(*cfg.prompt_len)
        body = {"model": model, "prompt": _random_ids(rng, n, vocab), "temperature": rng.choice([0.0, 1.0])}
        if kind == "abort":
            body |= {"max_tokens": cfg.abort_max_tokens, "stream": True, "ignore_eos": True}
            out.append(await send_completion(client, url, body, kind=kind, prompt_len=n, abort_after=rng.randint(1, 3)))
            continue
        stream = rng.random() < 0.5
        body |= {"max_tokens": rng.randint(*cfg.max_tokens), "stream": stream, "ignore_eos": rng.random() < 0.5}
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(await send_completion(client, url, body, kind=kind, prompt_len=n))


def _judge(report: SoakReport, results: list[RequestResult]) -> None:
    kinds: Counter[str] = Counter()
    statuses: dict[str, Counter[str]] = {}
    integrity: Counter[str] = Counter()
    for r in results:
        kinds[r.kind] += 1
        key = "no_response" if r.status is None else str(r.status)
        if r.error_code:
            key += f"/{r.error_code}"
        statuses.setdefault(r.kind, Counter())[key] += 1
        if r.status is not None and r.status >= 500:
            report.five_xx += 1
        if r.status is None and not r.aborted:
            report.transport_errors += 1
        if r.status == 200 and r.error_code is not None:
            report.stream_errors += 1
        if r.aborted:
            report.aborted += 1
        if r.integrity is not None:
            integrity[r.integrity_status or "none"] += 1
            if r.integrity_status in INTEGRITY_FAILURES:
                report.integrity_failures.append(r.integrity)
        if r.kind == "overlength" and not (r.status == 400 and r.error_code == "context_length_exceeded"):
            report.overlength_unexpected.append(f"{r.prompt_len} tokens -> {key}")
        if r.kind == "normal" and r.status == 200 and r.error_code is None:
            if r.prompt_tokens_reported is not None and r.prompt_tokens_reported != r.prompt_len:
                report.normal_unexpected.append(f"sent {r.prompt_len} tokens, usage says {r.prompt_tokens_reported}")
            if r.output_tokens > r.max_tokens:
                report.normal_unexpected.append(f"max_tokens {r.max_tokens}, got {r.output_tokens}")
            if not r.completed_stream:
                report.normal_unexpected.append("stream ended without [DONE]")
    report.requests = dict(kinds)
    report.statuses = {k: dict(v) for k, v in statuses.items()}
    report.integrity = dict(integrity)


async def _soak(url: str, cfg: SoakConfig, pids: list[int]) -> SoakReport:
    report = SoakReport(url, {k: (asdict(v) if k == "mix" else v) for k, v in cfg.__dict__.items()})
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0), limits=limits) as client:
        facts = await read_server_facts(client, url, cfg.model)
        limit = facts.max_request_tokens or facts.context_length
        if not limit:
            raise ValueError(f"{url} reports no context length (/server_info or /v1/models max_model_len)")
        vocab = facts.vocab_size or cfg.vocab_size or 256  # 256: every byte-level tokenizer has these ids
        report.baseline_pages = (await _sample(client, url, pids, t0, "baseline")).pages
        # warm up (allocations of the first batches are not a leak), then take the RSS baseline
        warm: list[RequestResult] = []
        for j in range(cfg.warmup_requests):
            body = {"model": facts.model, "prompt": _random_ids(random.Random(j), 8 + j, vocab), "max_tokens": 8}
            warm.append(await send_completion(client, url, body, kind="warmup", prompt_len=8 + j))
        failed_warm = Counter(f"{r.status}/{r.error_code}" for r in warm if not r.ok)
        if failed_warm:
            report.violations.append(f"warm-up requests failed: {dict(failed_warm)}")
        await _settle(client, url, pids, t0, report, cfg.settle_timeout_s)
        base = await _sample(client, url, pids, t0, "baseline")
        report.samples.append(base)
        report.rss_baseline = base.rss_bytes
        report.rss_source = base.rss_source

        # the load, with a sampler beside it
        results: list[RequestResult] = []
        deadline = time.monotonic() + cfg.duration_s
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                report.samples.append(await _sample(client, url, pids, t0, "load"))
                try:
                    await asyncio.wait_for(stop.wait(), cfg.sample_interval_s)
                except TimeoutError:
                    pass

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(
            *(
                _client_loop(i, client, url, cfg, facts.model, vocab, limit + 1, deadline, results)
                for i in range(cfg.clients)
            )
        )
        stop.set()
        await sampling
        settled = await _settle(client, url, pids, t0, report, cfg.settle_timeout_s)
        final = await _sample(client, url, pids, t0, "final")
        report.samples.append(final)
    report.elapsed_s = time.monotonic() - t0
    report.final_pages = final.pages
    report.rss_final = final.rss_bytes
    for s in report.samples:
        for role, n in s.pages.items():
            report.max_pages[role] = max(report.max_pages.get(role, 0), n)
    rss_values = [s.rss_bytes for s in report.samples if s.rss_bytes is not None]
    report.rss_max = max(rss_values) if rss_values else None
    _judge(report, results)
    _violations(report, cfg, settled, final)
    return report


def _idle(s: Sample, baseline: dict[str, int]) -> bool:
    return (s.running or 0) == 0 and (s.waiting or 0) == 0 and all(s.pages.get(r, 0) <= n for r, n in baseline.items())


async def _settle(
    client: httpx.AsyncClient, url: str, pids: list[int], t0: float, report: SoakReport, timeout: float
) -> bool:
    """Wait until nothing runs or waits and pages are back to the baseline; False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        s = await _sample(client, url, pids, t0, "settle")
        if _idle(s, report.baseline_pages) and all(r in report.baseline_pages for r in s.pages):
            return True
        if time.monotonic() > deadline:
            report.samples.append(s)
            return False
        await asyncio.sleep(0.2)


def _violations(report: SoakReport, cfg: SoakConfig, settled: bool, final: Sample) -> None:
    v = report.violations
    if report.five_xx:
        v.append(f"{report.five_xx} responses with a 5xx status")
    if report.transport_errors:
        v.append(f"{report.transport_errors} requests got no response (connection error or timeout)")
    if report.stream_errors:
        v.append(f"{report.stream_errors} streams carried an error event after the 200")
    if report.overlength_unexpected:
        shown = "; ".join(report.overlength_unexpected[:5])
        v.append(f"{len(report.overlength_unexpected)} over-length prompts not refused with 400 ({shown})")
    if report.normal_unexpected:
        shown = "; ".join(report.normal_unexpected[:5])
        v.append(f"{len(report.normal_unexpected)} normal requests came back wrong ({shown})")
    if report.integrity_failures:
        reasons = Counter(str(r.get("reason")) for r in report.integrity_failures)
        v.append(f"{len(report.integrity_failures)} integrity failures (reasons {dict(reasons)})")
    if not report.baseline_pages:
        v.append("the server reports no KV page numbers (/server_info stats.roles or /metrics); cannot check leaks")
    elif not settled:
        v.append(
            f"KV pages or requests did not return to the baseline within {cfg.settle_timeout_s:.0f} s: baseline "
            f"{report.baseline_pages}, now {final.pages}, running {final.running}, waiting {final.waiting}"
        )
    growth = report.rss_growth_mb
    if growth is not None and growth > cfg.max_rss_growth_mb:
        v.append(f"RSS grew by {growth:.1f} MiB (bound {cfg.max_rss_growth_mb:.0f} MiB)")
    if report.requests.get("normal") and "200" not in report.statuses.get("normal", {}):
        v.append("no normal request succeeded")


def run_soak(
    url: str,
    clients: int = 4,
    duration_s: float = 15.0,
    mix: SoakMix | None = None,
    *,
    pids: list[int] | None = None,
    **options: Any,
) -> SoakReport:
    """Soak the server at `url`; `pids` are its processes (for RSS when /server_info has none)."""
    cfg = SoakConfig(clients=clients, duration_s=duration_s, mix=mix or SoakMix(), **options)
    url = check_target(url, cfg.allow_remote)
    return asyncio.run(_soak(url, cfg, list(pids or [])))


# ---- command line --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", choices=["agg", "disagg"], help="start a kvfence deployment on a free port")
    add_launch_arguments(p)
    p.add_argument("--pid", type=int, action="append", default=[], help="server process id(s), for RSS with --url")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load")
    p.add_argument("--mix", type=SoakMix.parse, default=SoakMix(), help="normal=0.7,overlength=0.15,abort=0.15")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    p.add_argument("--settle-timeout", type=float, default=30.0)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the report as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvfence.errors import KvfenceError

    options = dict(
        seed=args.seed,
        model=args.model_name,
        max_rss_growth_mb=args.max_rss_growth_mb,
        settle_timeout_s=args.settle_timeout,
        allow_remote=args.allow_remote,
        vocab_size=vocab_size_of(args.model_dir),
    )
    server = None
    try:
        url, pids = args.url, list(args.pid)
        if args.launch:
            server = launch_server(
                args.launch,
                model=args.model_dir,
                server_args=shlex.split(args.server_args),
                ready_timeout_s=args.launch_timeout,
            )
            url, pids = server.url, server.pids
        try:
            report = run_soak(url, args.clients, args.duration, args.mix, pids=pids, **options)
        except (AssertionError, ValueError) as e:
            raise KvfenceError(str(e)) from None
    finally:
        if server is not None:
            server.stop()
    print(report.format())
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
    return 0 if report.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `soak` to the `kvfence bench` subcommands."""
    if "soak" in subparsers.choices:
        return
    p = subparsers.add_parser(
        "soak",
        help="K clients for a bounded time (normal, over-length, aborted requests); checks 5xx, integrity, leaks",
        description="Run K concurrent clients against one server for a bounded time with a mix of normal, "
        "over-length (must get 400 context_length_exceeded) and client-aborted requests; then check there was no "
        "5xx, no integrity failure, KV pages back to the baseline and RSS growth under a bound. Exit 0 pass, 1 fail.",
    )
    add_arguments(p)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvfence.bench.soak")
    add_arguments(parser)
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
