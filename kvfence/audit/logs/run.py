"""One server run inside one log file: what its start-up lines said, and which checks covered its requests.

What it knows: a run starts at a `server_args=` line (or a scheduler `max_total_num_tokens=` line without one)
and lasts until the next; it carries the model, release (and how the release was told), the settings the rules
read (KV checksum, canary, auto-truncate, request logging, time stats, transfer backend), the pool and context,
the lines that showed them (for locations), and how many distinct requests it served; `checks()` says, per run,
which checks were active.
What it does not know: how the lines were found (kvfence.audit.logs.scanner) or what is wrong (.rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.audit import sglang_releases as rel


@dataclass
class Run:
    """One server start inside one log file, with what its start-up lines said and which checks it ran."""

    side: str
    start: str
    model: str | None = None
    version: str | None = None
    version_source: str = ""
    checksum: bool | None = None  # None: no server_args line seen
    canary: str | None = None
    canary_seen: str = ""  # what proved the canary ran: install / stats lines
    canary_violations: int = 0
    auto_truncate: bool | None = None
    log_requests: bool | None = None
    log_requests_format: str | None = None
    time_stats: bool | None = None
    transfer_backend: str | None = None
    pool_tokens: int | None = None
    context_len: int | None = None
    pool_warning: bool = False
    startup_seen: bool = False  # the scheduler's max_total_num_tokens= line of this run
    checksum_skipped_at: str | None = None
    counted: bool = True  # False when --model excludes it
    requests: int = 0  # distinct requests (by rid) seen while this run served
    first_request: str = ""
    last_request: str = ""
    line: int | None = None  # the server_args (or scheduler) line that started it
    pool_line: int | None = None  # the line that showed the pool below the context (warning or scheduler line)
    checksum_skipped_line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def saw_request(self, ts: str) -> None:
        self.requests += 1
        self.first_request = self.first_request or ts
        self.last_request = ts

    @property
    def logs_requests(self) -> bool | None:
        """Whether this run writes a line per request (ReqTimeStats or --log-requests); None when unknown."""
        if self.time_stats or self.log_requests:
            return True
        if self.time_stats is None or self.log_requests is None:
            return None
        return False


def checks(r: Run) -> dict[str, Any]:
    """Which checks this run had active, for the requests it served."""
    v = rel.parse_version(r.version)
    if r.checksum is None:
        checksum = "unknown (no server_args line)"
    elif r.checksum:
        checksum = "on" + (f", skipped from {r.checksum_skipped_at}" if r.checksum_skipped_at else "")
    elif rel.has_kv_checksum(v) is False:
        checksum = f"n/a (SGLang {r.version} has none)"
    else:
        checksum = "off"
    canary = r.canary or "unknown"
    if canary not in ("none", "unknown"):
        canary += f", seen: {r.canary_seen}" if r.canary_seen else ", no canary line seen"
    if r.canary_violations:
        canary += f", {r.canary_violations} violation(s)"
    if r.side == "decode":
        default = rel.deferred_release_default(v)
        state = "on" if default else "off"
        deferred = "unknown (not in logs)" if default is None else f"SGLang {r.version} default {state}"
    else:
        deferred = "n/a (prefill has none)"
    if r.pool_tokens and r.context_len:
        pool = f"{r.pool_tokens} {'<' if r.context_len > r.pool_tokens else '>='} context {r.context_len}"
    else:
        pool = "unknown"
    req_log = {None: "unknown", False: "off"}.get(r.log_requests, r.log_requests_format or "text")
    stats = {None: "unknown", False: "off", True: "on"}[r.time_stats]
    return {
        "side": r.side, "started": r.start or "?", "version": r.version or "unknown",
        "version_source": r.version_source, "model": r.model, "requests": r.requests,
        "from": r.first_request, "to": r.last_request, "kv_checksum": checksum, "kv_canary": canary,
        "deferred_decode_release": deferred, "request_log": req_log, "time_stats": stats, "pool_vs_context": pool,
    }  # fmt: skip
