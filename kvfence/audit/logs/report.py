"""The result of `kvfence audit logs`: what was scanned, the runs and their checks, per-window counts, the notable
requests, the checksum coverage and the findings; as a dict for `--json` and as text tables.

What it knows: the report's shape and how it prints (aligned text tables: runs, checks per run, windows, requests,
findings; the table lists at most `max_requests` requests, JSON all that the scan kept, with the count of those it
did not keep per kind).
What it does not know: how any of it was found (kvfence.audit.logs.scanner, .rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.findings import Finding, findings_table, render_table, summary_line
from kvfence.audit.logs.formats import window_label
from kvfence.audit.logs.notes import RequestNote
from kvfence.audit.logs.run import Run
from kvfence.audit.logs.window import Window


@dataclass
class LogReport:
    files: dict[str, str]
    bytes_scanned: int
    lines_matched: int
    runs: list[Run]
    windows: dict[str, Window]
    requests: list[RequestNote]
    coverage: dict[str, int]
    unverified_sample: list[str]
    findings: list[Finding]
    window_kind: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    requests_not_listed: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes_scanned": self.bytes_scanned,
            "lines_matched": self.lines_matched,
            "runs": [r.to_dict() for r in self.runs],
            "checks": self.checks,
            "checksum_coverage": self.coverage,
            "unverified_requests_sample": self.unverified_sample,
            "windows": {window_label(k, self.window_kind): w.to_dict() for k, w in sorted(self.windows.items())},
            "requests": [r.to_dict() for r in self.requests],
            "requests_not_listed": self.requests_not_listed,
            "findings": [f.to_dict() for f in self.findings],
        }


def render_report(r: LogReport, max_requests: int = 50) -> str:
    out: list[str] = []
    gb = r.bytes_scanned / 1e9
    out.append(f"scanned {gb:.3f} GB, {r.lines_matched} matching lines; files: {r.files}")
    rows: list[tuple[object, ...]]
    if r.runs:
        out.append("")
        rows = [
            (x.side, x.start or "?", x.version or "?", x.model or "?", x.pool_tokens or "?", x.context_len or "?",
             "yes" if x.counted else "no (--model)")
            for x in r.runs
        ]  # fmt: skip
        out.append(render_table(["SIDE", "STARTED", "VERSION", "MODEL", "POOL", "CONTEXT", "COUNTED"], rows))
    if r.checks:
        out.append("")
        out.append("checks active per run (requests = distinct requests seen while that run served):")
        rows = [
            (c["side"], c["started"], c["requests"], f"{c['from'] or '-'} .. {c['to'] or '-'}", c["kv_checksum"],
             c["kv_canary"], c["deferred_decode_release"], c["request_log"], c["time_stats"], c["pool_vs_context"])
            for c in r.checks
        ]  # fmt: skip
        out.append(
            render_table(
                ["SIDE", "STARTED", "REQUESTS", "REQUEST TIMES", "KV CHECKSUM", "KV CANARY", "DEFERRED RELEASE",
                 "REQUEST LOG", "TIME STATS", "POOL VS CONTEXT"],
                rows, wrap={5: 30, 6: 24},
            )
        )  # fmt: skip
    if r.windows:
        out.append("")
        rows = []
        for key, w in sorted(r.windows.items()):
            cov = ", ".join(f"{k}={v}" for k, v in sorted(w.coverage.items()) if v) or "-"
            rows.append(
                (
                    window_label(key, r.window_kind), w.prefill_seqs, w.decode_requests,
                    f"{max(w.prefill_max_usage, w.decode_max_usage):.2f}",
                    w.too_long + w.decode_capacity_rejects + w.context_rejects, w.truncated, w.transfer_failures,
                    w.checksum_mismatches + w.corruption + w.canary_violations, w.candidates + w.placeholder, cov,
                )
            )  # fmt: skip
        out.append(
            render_table(
                ["WINDOW", "PREFILLED", "DECODED", "MAX USAGE", "TOO LONG", "TRUNC", "XFER FAIL", "MISMATCH",
                 "SUSPECT", "CHECKSUM COVERAGE"],
                rows,
            )
        )  # fmt: skip
    if r.coverage:
        out.append("")
        out.append(
            "checksum coverage of decoded requests: "
            + ", ".join(f"{k}={v}" for k, v in sorted(r.coverage.items()) if v)
        )
    if r.requests:
        out.append("")
        shown = sorted(r.requests, key=lambda n: ("TRANSFERRED" not in n.status, n.time))[:max_requests]
        rows = [
            (n.time, n.side, n.kind, n.rid or "-", n.room or "-", n.detail, n.status, n.evidence, n.line or "-")
            for n in shown
        ]
        out.append(
            render_table(
                ["TIME", "SIDE", "KIND", "RID", "ROOM", "DETAIL", "STATUS", "EVIDENCE", "LINE"],
                rows,
                wrap={5: 40, 6: 40, 7: 30},
            )
        )
        hidden = len(r.requests) - len(shown) + sum(r.requests_not_listed.values())
        if hidden:
            out.append(f"... {hidden} more request(s) (--json lists {len(r.requests)})")
    out.append("")
    out.append(findings_table(r.findings))
    out.append("")
    out.append(summary_line(r.findings))
    return "\n".join(out) + "\n"
