"""`scan_logs`: audit one SGLang prefill log (and its decode log): scan both, judge the prefill aborts, apply the
rules, and return the report.

What it knows: the order of the work (every file is opened first, so a missing one fails before any scanning;
prefill is scanned before decode, so decode knows which rooms the prefill aborts wait for), and that the cyclic
garbage collector is paused while the scan builds many small tuples and no cycles.
What it does not know: the line formats, the verdicts or the rules (the modules next to it).
"""

from __future__ import annotations

import gc

from kvfence.audit.findings import Finding
from kvfence.audit.logs import rules
from kvfence.audit.logs.formats import window_label
from kvfence.audit.logs.handlers import HANDLERS
from kvfence.audit.logs.reader import open_log
from kvfence.audit.logs.report import LogReport
from kvfence.audit.logs.run import checks
from kvfence.audit.logs.scanner import Scanner
from kvfence.audit.logs.verdict import POSSIBLE, RELEASE_RULE, TRANSFERRED, judge_abort

_PRIORITY = {TRANSFERRED: 0, POSSIBLE: 1, RELEASE_RULE: 2}


def scan_logs(
    prefill_log: str,
    decode_log: str | None = None,
    since: str | None = None,
    until: str | None = None,
    model: str | None = None,
    window: str = "hour",
    version: str | None = None,
) -> LogReport:
    files = {"prefill": prefill_log}
    if decode_log:
        files["decode"] = decode_log
    for path in files.values():
        open_log(path).close()  # KvfenceError now for a file that cannot be read
    sc = Scanner(since, until, model, window, version, HANDLERS)
    gc_was_on = gc.isenabled()
    gc.disable()  # the scan builds millions of tuples and no reference cycles; collections would only cost time
    try:
        sc.scan_file(prefill_log, "prefill")
        if decode_log:
            sc.scan_file(decode_log, "decode")
    finally:
        if gc_was_on:
            gc.enable()
    runs = [r for r in sc.runs if r.start or r.model or r.pool_tokens or r.requests]

    verdicts: dict[str, list[tuple[str, str, int | None]]] = {}  # status head -> [(window, side, line)]
    judged = []
    for a in sc.aborts_by_order:
        room = a.note.room.encode() if a.note.room else None
        v = judge_abort(a, sc.awaited.get(room) if room else None, decode_log is not None)
        a.note.status, a.note.evidence = v.status, v.evidence
        head = next((p for p in _PRIORITY if v.status.startswith(p)), "")
        if not head and not v.status.startswith(("not handed over", "stopped")):
            head = "unknown"
        if head:
            line: int | None
            if v.line:  # decode's line that shows it finished the request
                side, line = "decode", v.line
            elif v.evidence.startswith("prefill ReqTimeStats"):  # prefill's time-stats line
                side, line = "prefill", a.stats_line or a.note.line
            else:  # the abort line itself
                side, line = "prefill", a.note.line
            verdicts.setdefault(head, []).append((window_label(a.note.time[: sc.wlen], window), side, line))
        if head == TRANSFERRED:
            sc.win(a.note.time).candidates += 1
        judged.append((_PRIORITY.get(head, 3), a.note))
    for _, note in sorted(judged, key=lambda x: x[0]):
        sc.book.add(note)

    at = rules.Places(files, sc.book)
    findings: list[Finding] = []
    findings += rules.abort_findings(sc, at, verdicts)
    findings += rules.count_findings(sc, at)
    findings += rules.run_findings(sc, runs, at)
    findings += rules.input_findings(sc, runs, files, model)
    return LogReport(
        files=files,
        bytes_scanned=sc.bytes_scanned,
        lines_matched=sc.lines_matched,
        runs=runs,
        windows=sc.windows,
        requests=sorted(sc.book.listed, key=lambda n: n.time),
        coverage={k: v for k, v in sc.coverage.items() if v},
        unverified_sample=sc.unverified,
        findings=findings,
        window_kind=window,
        checks=[checks(r) for r in runs if r.counted and (r.start or r.requests)],
        requests_not_listed=dict(sc.book.not_listed),
    )
