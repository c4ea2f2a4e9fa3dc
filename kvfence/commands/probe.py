"""`kvfence probe URL --model NAME`: bounded black-box test of a serving endpoint for KV-leak signatures.

What it knows: the command line, the progress bar on stderr, the summary table, what the probe could not
establish, the JSON report, and the exit code (kvfence.audit.exit_status: 0 clean, 1 warnings, 2 critical,
3 could not check: a refused target, a server that is down or answers nothing the probe can use; 4 usage).
What it does not know: the checks; they live in kvfence.audit.probe.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfence.audit import exit_status as ex
from kvfence.audit import findings as fnd
from kvfence.errors import KvfenceError

TOOL = "kvfence probe"


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {x}")
    return x


def register(subparsers: argparse._SubParsersAction) -> None:
    p = ex.add_tool_parser(
        subparsers,
        "probe",
        help="black-box probe of an OpenAI-compatible server: over-length prompts, canaries, aborts, drift",
        description="Probe an OpenAI-compatible server (loopback only unless --i-am-authorised) with prompts at "
        "the context length -1/0/+1, prompts above the KV pool, planted canaries, mid-stream aborts and bursts. "
        "Reports any 200 to an over-length prompt, usage.prompt_tokens that does not match what was sent, "
        "canaries or another request's unique text in a reply (critical), temperature-0 golden drift (idle replay "
        "after unrelated requests, under load, after the burst), requests the server failed, and what the probe "
        "could not establish.",
        epilog=ex.HELP,
    )
    p.add_argument("url", metavar="URL", help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="model name to send in requests")
    p.add_argument("--context-length", type=_positive_int, help="context length (else /server_info or /v1/models)")
    p.add_argument("--pool-tokens", type=_positive_int, help="KV pool size in tokens (else /server_info)")
    p.add_argument("--max-requests", type=_positive_int, default=200, help="hard cap on requests sent (default 200)")
    p.add_argument("--time-budget", type=_seconds, default=120.0, help="wall-clock budget in seconds (default 120)")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight in the burst (default 8)")
    p.add_argument("--request-timeout", type=_seconds, default=60.0, help="per-request timeout in seconds")
    p.add_argument("--max-tokens", type=_positive_int, default=16, help="max_tokens of golden/canary requests")
    p.add_argument("--golden", type=_count, default=4, help="golden prompts (each sent idle, under load, idle)")
    p.add_argument("--canaries", type=_count, default=8, help="canary requests in the burst")
    p.add_argument("--aborts", type=_count, default=4, help="mid-stream aborts in the burst")
    p.add_argument(
        "--churn", type=_count, default=1, help="unrelated requests between a golden prompt and its replay (default 1)"
    )
    p.add_argument(
        "--expect-deterministic",
        action="store_true",
        help="the server claims batch-invariant greedy decoding: temperature-0 golden drift is critical, not a warning",
    )
    p.add_argument(
        "--kv-params",
        choices=["nixl", "mooncake", "kvfence"],
        help="instead: send a vLLM decode instance fabricated kv_transfer_params of this connector's shape (vLLM "
        "#52234: unknown remote request, out-of-range block ids, a reused reference) and report whether it fails "
        "closed (an error) or answers 200 with tokens",
    )
    p.add_argument(
        "--prefill", metavar="URL", help="with --kv-params: the prefill instance, for the reused-reference case"
    )
    p.add_argument("--api-key", help="bearer token for the server")
    p.add_argument(
        "--i-am-authorised",
        "--i-am-authorized",
        dest="allow_remote",
        action="store_true",
        help="allow a non-loopback target you are authorised to test",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    p.add_argument("--report", metavar="PATH", help="also write the JSON report to PATH")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (KvfenceError, OSError) as e:
        code = ex.report_error(TOOL, e)
        message = " ".join(str(e).split())
        doc = {"tool": TOOL, "exit_code": code, "error": message}
        if args.report:
            try:
                Path(args.report).write_text(fnd.dumps(doc), encoding="utf-8")
            except OSError as e2:
                ex.report_error(TOOL, e2)
        if args.json:
            print(fnd.dumps(doc))
        return code


def _run(args: argparse.Namespace) -> int:
    if args.kv_params:
        return _run_kv_params(args)
    if args.prefill:
        raise ex.UsageError("--prefill goes with --kv-params")
    from kvfence.audit.probe import ProbeConfig, run_probe

    cfg = ProbeConfig(
        url=args.url,
        model=args.model,
        context_length=args.context_length,
        pool_tokens=args.pool_tokens,
        max_requests=args.max_requests,
        time_budget_s=args.time_budget,
        concurrency=args.concurrency,
        request_timeout_s=args.request_timeout,
        max_tokens=args.max_tokens,
        golden=args.golden,
        canaries=args.canaries,
        aborts=args.aborts,
        churn=args.churn,
        expect_deterministic=args.expect_deterministic,
        allow_remote=args.allow_remote,
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    report = run_probe(cfg)
    code = fnd.exit_code(report.findings)
    doc = {"tool": "kvfence probe", "exit_code": code, **report.to_dict()}
    if _report_and_json(args, doc):
        return code
    f = report.facts
    print(
        f"target {report.url} model {report.model}: context {f.context_length or '?'} ({f.context_source}), "
        f"pool {f.pool_tokens or '?'} ({f.pool_source}), tokens counted by {f.counter}"
    )
    print(
        f"{report.requests_sent} requests in {report.elapsed_s:.1f} s"
        + (f"; {report.stopped_early}" if report.stopped_early else "")
    )
    print()
    print(fnd.render_table(["CHECK", "SENT", "200", "4XX", "OTHER", "RESULT"], report.summary_rows()))
    if report.not_established:
        print()
        print("not established by this probe:")
        print(fnd.render_table(["CHECK", "WHY"], [(x.check, x.why) for x in report.not_established], wrap={1: 100}))
    print()
    print(fnd.findings_table(report.findings))
    print()
    print(fnd.summary_line(report.findings))
    return code


def _report_and_json(args: argparse.Namespace, doc: dict) -> bool:
    """Write --report; with --json print the document too and say so (the caller then prints no table)."""
    if args.report:
        try:
            Path(args.report).write_text(fnd.dumps(doc), encoding="utf-8")
        except OSError as e:
            raise KvfenceError(f"cannot write {args.report}: {e.strerror or e}") from e
    if args.json:
        print(fnd.dumps(doc))
    return bool(args.json)


def _run_kv_params(args: argparse.Namespace) -> int:
    from kvfence.audit.kv_params_probe import KvParamsProbeConfig, run_kv_params_probe

    cfg = KvParamsProbeConfig(
        url=args.url,
        model=args.model,
        connector=args.kv_params,
        prefill_url=args.prefill,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        allow_remote=args.allow_remote,
        api_key=args.api_key,
    )
    report = run_kv_params_probe(cfg)
    code = fnd.exit_code(report.findings)
    doc = {"tool": TOOL, "exit_code": code, **report.to_dict()}
    if _report_and_json(args, doc):
        return code
    print(f"target {report.url}: fabricated {report.connector} kv_transfer_params")
    print()
    rows = [(c.case, c.status or "no answer", c.verdict, c.error[:80]) for c in report.cases]
    print(fnd.render_table(["CASE", "HTTP", "VERDICT", "ERROR"], rows, wrap={3: 80}))
    if report.not_established:
        print()
        print("not established by this probe:")
        for line in report.not_established:
            print(f"  {line}")
    print()
    print(fnd.findings_table(report.findings))
    print()
    print(fnd.summary_line(report.findings))
    return code
