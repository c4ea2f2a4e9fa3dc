"""`kvfence audit logs`: scan SGLang prefill/decode logs: was this deployment affected by the KV handoff leak,
when, how often, and on what evidence.

What lives where:
- formats: every line SGLang 0.5.19 .. 0.5.23 writes that the audit reads (text, source file, releases; checked
  against the PyPI wheels by tests/test_audit_sources.py), and the patterns that pull them out of the file;
- startup: the `server_args=` start-up line (dict repr or ServerArgs repr) and the release its fields name;
- reader: a file in bounded windows of whole lines (gzip too), and line numbers of what was found;
- recent: the bounded map that holds per-request state while a request can still be open;
- run, window, notes: a server run and the checks it had, a time window's counts, the notable requests;
- scanner: the pass over each file; handlers: what each rare line kind means (a dispatch table);
- verdict: was a prefill abort handed to decode anyway, and on what evidence (per-request lines, else the
  release rule); rules: the findings, with the log lines that show them; report: the result and its tables;
- scan: `scan_logs`, the entry point.
What it does not know: requests that left no line. "verified" checksum coverage is inferred (SGLang logs no
per-request success): checksum on in that run, no skip line before it, no mismatch for the request.

Memory is bounded by time windows, server runs and prefill aborts, not by the size of the logs; speed: one regex
`findall` per window returns every line the audit reads (see formats and scanner).
"""

from __future__ import annotations

from kvfence.audit.logs.formats import FORMATS, LineFormat
from kvfence.audit.logs.notes import RequestNote
from kvfence.audit.logs.report import LogReport, render_report
from kvfence.audit.logs.rules import RULES
from kvfence.audit.logs.run import Run
from kvfence.audit.logs.scan import scan_logs
from kvfence.audit.logs.startup import infer_release, infer_version, parse_server_args

__all__ = [
    "FORMATS",
    "RULES",
    "LineFormat",
    "LogReport",
    "RequestNote",
    "Run",
    "infer_release",
    "infer_version",
    "parse_server_args",
    "render_report",
    "scan_logs",
]
