"""`kvfence audit sglang` and `kvfence audit logs`: operator tools for SGLang PD deployments.

What it knows: the command-line surface of the two audits and how their results are shown
(aligned text tables on stdout, or one JSON document with `--json`; `--sarif FILE` / `--junit FILE` also
write SARIF 2.1.0 / JUnit XML for CI) and turned into an exit code (kvfence.audit.exit_status: 0 clean,
1 warnings, 2 critical, 3 could not check, 4 usage); a tool error is one line on stderr, and the SARIF / JUnit /
JSON outputs asked for still say that the tool could not check.
What it does not know: the rules and the log formats; they live in kvfence.audit.sglang (rules),
kvfence.audit.sglang_server (reading a server), kvfence.audit.logs and kvfence.audit.metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfence.audit import exit_status as ex
from kvfence.audit import findings as fnd
from kvfence.errors import KvfenceError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = ex.add_tool_parser(
        subparsers,
        "audit",
        help="audit an SGLang PD deployment (configuration or logs) for cross-request KV leak hazards",
        description="Audit an SGLang prefill/decode deployment for the KV handoff hazards behind cross-request leaks.",
        epilog=ex.HELP,
    )
    p.set_defaults(func=lambda args: _usage(p))
    sub = p.add_subparsers(dest="audit_target", metavar="TARGET")

    s = sub.add_parser(
        "sglang",
        help="check prefill/decode configuration (live URLs, saved JSON, or launch command lines)",
        description="Check an SGLang PD deployment's configuration. Each side is a live URL (reads /server_info "
        "or /get_server_info, /model_info, /v1/models), a saved JSON file (the /server_info body or a bundle "
        "written by --save-bundle), a file holding the launch command, or the command itself.",
        epilog=ex.HELP,
    )
    s.add_argument("--prefill", metavar="SRC", help="prefill server: URL, JSON file, launch script, or command")
    s.add_argument("--decode", metavar="SRC", help="decode server: URL, JSON file, launch script, or command")
    s.add_argument("--prefill-model-info", metavar="JSON", help="saved /model_info of the prefill server")
    s.add_argument("--prefill-metrics", metavar="FILE", help="saved /metrics scrape of the prefill server")
    s.add_argument("--decode-metrics", metavar="FILE", help="saved /metrics scrape of the decode server")
    s.add_argument("--decode-model-info", metavar="JSON", help="saved /model_info of the decode server")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="environment of both servers")
    s.add_argument("--prefill-env", action="append", default=[], metavar="KEY=VAL")
    s.add_argument("--decode-env", action="append", default=[], metavar="KEY=VAL")
    s.add_argument("--env-file", action="append", default=[], metavar="FILE", help="KEY=VAL lines for both")
    s.add_argument("--prefill-env-file", action="append", default=[], metavar="FILE")
    s.add_argument("--decode-env-file", action="append", default=[], metavar="FILE")
    s.add_argument("--sglang-version", metavar="X.Y.Z", help="version to assume when the source does not say")
    s.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per request in seconds")
    s.add_argument("--save-bundle", metavar="DIR", help="save what was read from live URLs as re-auditable JSON")
    s.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    _ci_outputs(s)
    s.set_defaults(func=_guarded("kvfence audit sglang", _sglang_rules, run_sglang))

    v = sub.add_parser(
        "vllm",
        help="check a vLLM P/D pair's KV transfer config (launch commands, saved JSON, or live URLs)",
        description="Check a vLLM prefill/decode deployment's KV transfer configuration: connector, kv_role, "
        "kv_load_failure_policy, whether decode verifies the KV it loads, and prefill/decode consistency. Each side "
        "is a launch command (`vllm serve ... --kv-transfer-config '{...}'`), a file holding it, a saved JSON (the "
        "--kv-transfer-config object, /server_info?config_format=json, or a bundle from --save-bundle), or a live URL.",
        epilog=ex.HELP,
    )
    v.add_argument("--prefill", metavar="SRC", help="prefill instance: URL, JSON file, launch script, or command")
    v.add_argument("--decode", metavar="SRC", help="decode instance: URL, JSON file, launch script, or command")
    v.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per request in seconds")
    v.add_argument("--save-bundle", metavar="DIR", help="save what was read from live URLs as re-auditable JSON")
    v.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    _ci_outputs(v)
    v.set_defaults(func=_guarded("kvfence audit vllm", _vllm_rules, run_vllm))

    lg = sub.add_parser(
        "logs",
        help="scan SGLang prefill/decode logs: over-pool requests, aborted-but-transferred, checksum coverage",
        description="Scan SGLang prefill and decode logs (streamed in bounded memory, any size; .gz too) and report "
        "requests whose input exceeded the pool, requests aborted on prefill but handed to decode, transfer "
        "failures, and KV checksum coverage per request and per time window.",
        epilog=ex.HELP,
    )
    lg.add_argument("prefill_log", metavar="PREFILL.log")
    lg.add_argument("decode_log", metavar="DECODE.log", nargs="?")
    lg.add_argument("--since", metavar="TIME", help="ignore lines before 'YYYY-MM-DD[ HH:MM[:SS]]'")
    lg.add_argument("--until", metavar="TIME", help="ignore lines after 'YYYY-MM-DD[ HH:MM[:SS]]'")
    lg.add_argument("--model", metavar="NAME", help="only count server runs whose model path/name contains NAME")
    lg.add_argument("--window", choices=["minute", "10min", "hour", "day"], default="hour")
    lg.add_argument("--max-requests", type=int, default=50, help="requests listed in the table (JSON lists all)")
    lg.add_argument("--sglang-version", metavar="X.Y.Z", help="release to judge by when the logs do not tell it")
    lg.add_argument("--prefill-metrics", metavar="FILE", help="saved /metrics scrape of the prefill server")
    lg.add_argument("--decode-metrics", metavar="FILE", help="saved /metrics scrape of the decode server")
    lg.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    _ci_outputs(lg)
    lg.set_defaults(func=_guarded("kvfence audit logs", _log_rules, run_logs))


def _sglang_rules() -> list:
    from kvfence.audit.sglang import RULES

    return list(RULES)


def _vllm_rules() -> list:
    from kvfence.audit.vllm import RULES

    return list(RULES)


def _log_rules() -> list:
    from kvfence.audit.logs import RULES

    return list(RULES)


def _ci_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sarif", metavar="FILE", help="also write the findings as SARIF 2.1.0 (e.g. for code scanning)")
    p.add_argument("--junit", metavar="FILE", help="also write one JUnit test case per rule checked")


def _ci_and_json(args: argparse.Namespace, tool: str, rules: list, found: list, servers: dict[str, Any]) -> bool:
    """Write the SARIF/JUnit files asked for; with --json print the document too and say so (the caller then
    returns the exit code instead of printing its table)."""
    _write_ci(args, tool, rules, found)
    if not args.json:
        return False
    doc = {
        "tool": tool,
        "exit_code": fnd.exit_code(found),
        "findings": [f.to_dict() for f in found],
        "servers": servers,
    }
    print(fnd.dumps(doc))
    return True


def _write_ci(args: argparse.Namespace, tool: str, rules: list, found: list, error: str | None = None) -> None:
    from kvfence import __version__

    for path, text in (
        (args.sarif, lambda: fnd.dumps(fnd.to_sarif(tool, __version__, rules, found, error=error))),
        (args.junit, lambda: fnd.to_junit(tool, rules, found, error=error)),
    ):
        if path:
            try:
                Path(path).write_text(text(), encoding="utf-8")
            except OSError as e:
                raise KvfenceError(f"cannot write {path}: {e.strerror or e}") from e


def _guarded(
    tool: str, rules: Callable[[], list], body: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """Run an audit; a tool error becomes one line on stderr, its own exit code, and failed CI outputs."""

    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except (KvfenceError, OSError) as e:
            code = ex.report_error(tool, e)
            message = " ".join(str(e).split())
            try:
                _write_ci(args, tool, rules(), [], error=message)
            except KvfenceError as e2:
                ex.report_error(tool, e2)
            if getattr(args, "json", False):
                print(fnd.dumps({"tool": tool, "exit_code": code, "error": message}))
            return code

    return run


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return ex.USAGE


def _parse_kv(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ex.UsageError(f"{what}: expected KEY=VAL, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def _env_for(args: argparse.Namespace, role: str) -> tuple[dict[str, str], bool]:
    from kvfence.audit.sglang_cli import parse_env_lines

    env: dict[str, str] = {}
    files = list(args.env_file) + list(getattr(args, f"{role}_env_file"))
    for f in files:
        try:
            env.update(parse_env_lines(Path(f).read_text(encoding="utf-8")))
        except OSError as e:
            raise KvfenceError(f"cannot read env file {f}: {e}") from e
    env.update(_parse_kv(args.env, "--env"))
    env.update(_parse_kv(getattr(args, f"{role}_env"), f"--{role}-env"))
    known = bool(files or args.env or getattr(args, f"{role}_env"))
    return env, known


def run_sglang(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvfence.audit import sglang as sg
    from kvfence.audit import sglang_server as srv

    if not args.prefill and not args.decode:
        raise ex.UsageError("give --prefill and/or --decode (URL, JSON file, launch script, or command)")
    snaps: dict[str, srv.ServerSnapshot | None] = {"prefill": None, "decode": None}
    for role in ("prefill", "decode"):
        src = getattr(args, role)
        if not src:
            continue
        env, known = _env_for(args, role)
        snap, bundle = srv.load_snapshot(
            role,
            src,
            env=env,
            env_known=known,
            version=args.sglang_version,
            timeout=args.timeout,
            metrics_path=getattr(args, f"{role}_metrics"),
        )
        mi_path = getattr(args, f"{role}_model_info")
        if mi_path:
            try:
                snap = replace(snap, model_info=json.loads(Path(mi_path).read_text(encoding="utf-8")))
            except (OSError, ValueError) as e:
                raise KvfenceError(f"cannot read {mi_path}: {e}") from e
        if bundle is not None and args.save_bundle:
            out_dir = Path(args.save_bundle)
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / f"{role}.json").write_text(fnd.dumps(bundle), encoding="utf-8")
            except OSError as e:
                raise KvfenceError(f"cannot write the bundle under {out_dir}: {e.strerror or e}") from e
        snaps[role] = snap
    found = fnd.sort_findings(sg.audit(snaps["prefill"], snaps["decode"]))
    code = fnd.exit_code(found)
    servers = {r: srv.facts(s) for r, s in snaps.items() if s is not None}
    if _ci_and_json(args, "kvfence audit sglang", sg.RULES, found, servers):
        return code
    rows = []
    for role, s in snaps.items():
        if s is None:
            continue
        f = srv.facts(s)
        rows.append(
            (
                role,
                f["version"] or "?",
                f["model"] or "?",
                f["pool_kind"] or "?",
                f["context_length"] or "?",
                f["pool_tokens"] or "?",
                f["page_size"] or "unknown",
                f["kv_cache_dtype"] or "unknown",
                "on" if f["kv_checksum"] else "off",
                f["kv_canary"],
            )
        )
    print(
        fnd.render_table(
            ["ROLE", "VERSION", "MODEL", "POOL", "CONTEXT", "POOL TOKENS", "PAGE", "KV DTYPE", "CHECKSUM", "CANARY"],
            rows,
            wrap={2: 40},
        )
    )
    print()
    print(fnd.findings_table(found))
    print()
    print(fnd.summary_line(found))
    return code


def _save_bundle(args: argparse.Namespace, role: str, bundle: dict | None) -> None:
    if bundle is None or not args.save_bundle:
        return
    out_dir = Path(args.save_bundle)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{role}.json").write_text(fnd.dumps(bundle), encoding="utf-8")
    except OSError as e:
        raise KvfenceError(f"cannot write the bundle under {out_dir}: {e.strerror or e}") from e


def run_vllm(args: argparse.Namespace) -> int:
    from kvfence.audit import vllm as vl
    from kvfence.audit import vllm_server as vsrv

    if not args.prefill and not args.decode:
        raise ex.UsageError("give --prefill and/or --decode (URL, JSON file, launch script, or command)")
    snaps: dict[str, vsrv.VllmSnapshot | None] = {"prefill": None, "decode": None}
    for role in ("prefill", "decode"):
        src = getattr(args, role)
        if src:
            snaps[role], bundle = vsrv.load_snapshot(role, src, timeout=args.timeout)
            _save_bundle(args, role, bundle)
    found = fnd.sort_findings(vl.audit(snaps["prefill"], snaps["decode"]))
    code = fnd.exit_code(found)
    servers = {r: vl.facts(s) for r, s in snaps.items() if s is not None}
    if _ci_and_json(args, "kvfence audit vllm", vl.RULES, found, servers):
        return code
    rows = []
    for role, s in snaps.items():
        if s is not None:
            f = vl.facts(s)
            policy = f["kv_load_failure_policy"] or ("default" if f["connector"] else "?")
            rows.append((role, f["version"] or "?", f["model"] or "?", f["connector"] or "unknown",
                         f["kv_role"] or "-", policy, f["max_model_len"] or "?", f["block_size"] or "?"))  # fmt: skip
    headers = ["ROLE", "VERSION", "MODEL", "CONNECTOR", "KV ROLE", "LOAD FAILURE", "MAX MODEL LEN", "BLOCK"]
    print(fnd.render_table(headers, rows, wrap={2: 40}))
    print()
    print(fnd.findings_table(found))
    print()
    print(fnd.summary_line(found))
    return code


def run_logs(args: argparse.Namespace) -> int:
    from kvfence.audit import logs as lg
    from kvfence.audit import metrics as mt
    from kvfence.audit.sglang import RULES as SG_RULES

    report = lg.scan_logs(
        args.prefill_log,
        args.decode_log,
        since=args.since,
        until=args.until,
        model=args.model,
        window=args.window,
        version=args.sglang_version,
    )
    metrics = {}
    for role in ("prefill", "decode"):
        path = getattr(args, f"{role}_metrics")
        if path:
            try:
                text = Path(path).read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                raise KvfenceError(f"cannot read {path}: {e}") from e
            snap = mt.parse_metrics(text, path)
            metrics[role] = snap.facts()
            report.findings += mt.metric_findings(snap, role, pool_rule=True)
    rules = list(lg.RULES)
    if metrics:
        rules += [r for r in SG_RULES if r.id.startswith("metrics-")]
        rules.append(fnd.Rule("metrics-pool-below-context", "the scrape shows a pool below the context length"))
    report.findings = fnd.sort_findings(report.findings)
    code = fnd.exit_code(report.findings)
    _write_ci(args, "kvfence audit logs", rules, report.findings)
    if args.json:
        doc = {"tool": "kvfence audit logs", "exit_code": code, **report.to_dict()}
        if metrics:
            doc["metrics"] = metrics
        print(fnd.dumps(doc))
        return code
    sys.stdout.write(lg.render_report(report, max_requests=args.max_requests))
    return code
