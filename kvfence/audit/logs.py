"""Scan SGLang prefill/decode logs: was this deployment affected by the KV handoff leak, when, how often.

What it knows: the lines SGLang 0.5.19 .. 0.5.23 writes, each listed in FORMATS with the source file that
writes it and the releases that do (tests/test_audit_sources.py checks every entry against the PyPI wheels):
- the line prefix `[YYYY-MM-DD HH:MM:SS(.mmm)( DPn)( PPn)( TPn)( EPn)...] ` (utils/common.py configure_logger);
  `--log-requests` lines carry `[YYYY-MM-DD HH:MM:SS] ` only (utils/log_utils.py);
- start-up: `server_args={...}` (a dict repr, read with ast.literal_eval; the `ServerArgs(k=v, ...)` repr is
  read too, each value with literal_eval) whose key set also tells the release apart, the scheduler line
  `max_total_num_tokens=..., context_len=...`, and 0.5.23's `KV pool holds N tokens, fewer than --context-length`;
- per request: the intake aborts `Input length (N tokens) exceeds the maximum allowed length (M tokens)...,
  self.rid='R'` and (0.5.21+) `Request prompt exceeds the KV memory budget: input_len=N., self.rid='R'`, the
  truncation warnings, the tokenizer's context-length refusal, the disaggregation capacity aborts
  `Request R exceeds the maximum number of tokens: N > CAP`, `ReqTimeStats(rid=R, bootstrap_room=B,
  input_len=N, ..., output_len=N, ..., type=prefill|decode): ... transfer_total=X MB` (with
  --enable-request-time-stats-logging), `--log-requests` text (`Receive: obj=...`, `Finish: obj=..., out=...`)
  and JSON (`{"timestamp": ..., "event": "request.received" | "request.finished", ...}`) lines, transfer and
  bootstrap failures, KV checksum mismatch / skip lines, context corruption, deferred-release timeouts;
- the `--kv-canary` lines: installation, periodic stats, violations, overflow skips and test perturbations.
A request aborted on prefill is a leak candidate only with evidence that its KV was handed over: decode
decoded it (time stats or a finished request with output), or prefill's time stats show a completed transfer.
Without that, the release decides what the abort did (kvfence.audit.sglang_releases).
What it does not know: requests that left no line. "verified" checksum coverage is inferred (SGLang logs no
per-request success): checksum on in that run, no skip line before it, no mismatch for the request.

Speed: a file is mapped (mmap) and scanned in large windows by two compiled regexes, one for the batch lines
(findall, aggregated per window without per-line Python work) and one anchored on the literal "] " for every
other kind; only those rarer lines are handled in Python.
"""

from __future__ import annotations

import ast
import gc
import itertools
import json
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvfence.audit import sglang_flags
from kvfence.audit import sglang_releases as rel
from kvfence.audit.findings import Finding, Rule, Severity, render_table

CHUNK_BYTES = 32 << 20
_WINDOW_LEN = {"minute": 16, "10min": 15, "hour": 13, "day": 10}


class LineFormat(NamedTuple):
    kind: str
    head: bytes  # the message (after the prefix) starts with this
    source: str  # file under sglang/srt/ that writes it
    releases: tuple[str, str] | None  # first and last release that writes it; None: none of 0.5.19 .. 0.5.23
    fragments: tuple[str, ...]  # source text of that file which builds the line


_ALL = ("0.5.19", "0.5.23")
FORMATS: list[LineFormat] = [
    LineFormat("server_args", b"server_args={", "entrypoints/engine.py", _ALL, ('logger.info(f"server_args={',)),
    LineFormat("server_args", b"server_args=ServerArgs(", "entrypoints/engine.py", None, ("server_args=ServerArgs(",)),
    LineFormat("startup", b"max_total_num_tokens=", "managers/scheduler.py", _ALL,
               ('f"max_total_num_tokens={self.max_total_num_tokens}, "',
                'f"context_len={self.model_config.context_len}, "')),
    LineFormat("pool_warning", b"KV pool holds ", "managers/tp_worker.py", ("0.5.23", "0.5.23"),
               ('"KV pool holds %d tokens, fewer than --context-length %d. One "',)),
    LineFormat("too_long", b"Input length (", "managers/utils.py", _ALL,
               ('f"Input length ({len(req.origin_input_ids)} tokens) exceeds "',
                'f"the maximum allowed length ({max_req_input_len} tokens). "')),
    LineFormat("kv_budget", b"Request prompt exceeds the KV memory budget", "managers/scheduler.py",
               ("0.5.21", "0.5.23"), ('f"Request prompt exceeds the KV memory budget: input_len={input_len}."',)),
    LineFormat("abort_rid", b"", "managers/schedule_batch.py", _ALL, ('logger.error(f"{error_msg}, {self.rid=}")',)),
    LineFormat("truncated", b"Request length is longer than the KV cache pool size or ", "managers/utils.py", _ALL,
               ('"Request length is longer than the KV cache pool size or "',
                'f"{len(req.origin_input_ids)=}, {max_req_input_len=}."')),
    LineFormat("context_reject", b"[http_server] Error: The input (", "entrypoints/http_server.py", _ALL,
               ('logger.error(f"[http_server] Error: {e}")',)),
    LineFormat("context_truncated", b"The input (", "managers/tokenizer_manager.py", _ALL,
               ('f"The input ({input_token_num} tokens) is longer than the "', '"Truncating the input."')),
    LineFormat("capacity", b"Request ", "disaggregation/decode.py", _ALL,
               ('f"Request {req.rid} exceeds the maximum number of tokens: {input_len} > {capacity}"',)),
    LineFormat("capacity", b"Request ", "disaggregation/prefill.py", _ALL,
               ('exceeds the maximum number of tokens: {len(req.origin_input_ids)} > ',)),
    LineFormat("receive", b"Receive: obj=", "utils/request_logger.py", _ALL, ('f"Receive: obj={',)),
    LineFormat("finish", b"Finish: obj=", "utils/request_logger.py", _ALL,
               ('self._log(f"Finish: obj={obj_str}{headers_str}{out_str}")',)),
    LineFormat("json_request", b'{"timestamp": ', "utils/request_logger.py", _ALL,
               ('log_json(self.targets, "request.received", log_data)',
                'log_json(self.targets, "request.finished", log_data)')),
    LineFormat("time_stats", b"ReqTimeStats(", "managers/schedule_batch.py", _ALL,
               ('f"ReqTimeStats("', 'f"rid={self.rid}{bootstrap_info}, "', 'f"output_len={len(self.output_ids)}, "',
                'f"type={self.time_stats.disagg_mode_str()})"')),
    LineFormat("transfer_total", b"", "observability/req_time_stats.py", _ALL,
               ('f"transfer_total={self.transfer_total_mb:.2f} MB"',)),
    LineFormat("transfer_failed", b"Prefill transfer failed for request rank=", "disaggregation/prefill.py", _ALL,
               ('f"Prefill transfer failed for request rank=',)),
    LineFormat("transfer_failed", b"Decode transfer failed for request rank=", "disaggregation/decode.py", _ALL,
               ('f"Decode transfer failed for request rank={self.tp_rank} "',)),
    LineFormat("bootstrap_failed", b"Prefill bootstrap failed for request rank=", "disaggregation/prefill.py",
               _ALL, ('f"Prefill bootstrap failed for request rank=',)),
    LineFormat("bootstrap_failed", b"Decode handshake failed for request rank=", "disaggregation/decode.py", _ALL,
               ('f"Decode handshake failed for request rank={self.tp_rank} ',)),
    LineFormat("checksum_mismatch", b"KV checksum mismatch", "disaggregation/decode.py", ("0.5.21", "0.5.23"),
               ('f"KV checksum mismatch req={req.rid} "',)),
    LineFormat("checksum_skipped", b"KV checksum skipped: ", "disaggregation/decode.py", ("0.5.23", "0.5.23"),
               ('"KV checksum skipped: prefill layout signature %#x differs from "',)),
    LineFormat("corruption", b"Context corruption detected: ", "disaggregation/decode.py", _ALL,
               ('f"Context corruption detected: Request {decode_req.req.rid} "',)),
    LineFormat("deferred_timeout", b"Deferred KV release for room ", "disaggregation/decode.py", _ALL,
               ('f"Deferred KV release for room {room} timed out after "',)),
    LineFormat("canary_violation", b"kv_canary violation: ", "kv_canary/runner/violation_reporter.py", _ALL,
               ('f"kv_canary violation: "', 'f"launch_tag={tag_label} "')),
    LineFormat("canary_stats", b"[canary] step=", "kv_canary/runner/stats_logger.py", _ALL,
               ('"[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d "',)),
    LineFormat("canary_overflow", b"kv-canary: per-forward verify skipped", "kv_canary/runner/enable_warner.py",
               _ALL, ('"kv-canary: per-forward verify skipped this step due to overflow "',)),
    LineFormat("canary_perturb", b"kv_canary perturb", "kv_canary/perturb/utils.py", _ALL,
               ('"kv_canary perturb %s: group=%s source_idx=%d slot=%d row=%d col=%d "',)),
    LineFormat("canary_install", b"install_canary: ", "kv_canary/api.py", _ALL,
               ('"install_canary: disaggregation_mode=%s config=%s perturb_config=%s "',)),
    LineFormat("prefill_batch", b"Prefill batch", "managers/scheduler_components/metrics_reporter.py", _ALL,
               ('f"Prefill batch{iter_msg}, "', 'f"#new-seq: {prefill_stats.num_new_seqs}, "')),
    LineFormat("decode_batch", b"Decode batch", "managers/scheduler_components/metrics_reporter.py", _ALL,
               ('msg = f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, {token_usage_msg}"',)),
]  # fmt: skip

RULES = [
    Rule("aborted-but-transferred", "a request aborted on prefill was handed to decode anyway"),
    Rule("possible-stub-handoff", "a release that hands rejected prompts to decode processed one, unconfirmed"),
    Rule("placeholder-signature", "decode finished a request whose prompt was 1 token"),
    Rule("checksum-mismatch", "the KV checksum caught corrupted or foreign KV"),
    Rule("context-corruption", "decode caught metadata of another request"),
    Rule("kv-canary-violation", "the KV canary found stale or foreign KV in an engine's pool"),
    Rule("kv-canary-coverage-gap", "the KV canary skipped verification"),
    Rule("kv-canary-perturbation", "the KV canary's test perturbation was on"),
    Rule("pool-below-context", "a server ran with a KV pool below its context length"),
    Rule("over-pool-served", "prefill processed an input above its KV pool"),
    Rule("deferred-release-timeout", "decode released held pages without prefill's drain acknowledgement"),
    Rule("auto-truncated", "prompts were silently truncated"),
    Rule("transfer-failures", "KV transfer or bootstrap failures"),
    Rule("too-long-unmatched", "a prefill abort could not be followed to decode"),
    Rule("over-pool-requests", "requests above the context or pool limit (refused)"),
    Rule("checksum-skipped", "decoded requests admitted with the KV checksum skipped"),
    Rule("checksum-absent", "decoded requests ran without a KV checksum"),
    Rule("log-unrecognised", "a file holds no line SGLang writes"),
    Rule("no-startup-line", "a log without the server_args / start-up lines"),
    Rule("no-request-lines", "a log without any per-request line"),
    Rule("model-filter-matched-nothing", "--model excluded every server run"),
]

_PREFIX_RE = re.compile(rb"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?[^\]\n]*\] ")
# One findall per window of the file collects every line we read, in order, with the timestamp split into the
# window key and the rest. Batch and ReqTimeStats lines come out parsed (aggregated without per-line Python);
# every other kind comes out as its head and the rest of its line. Groups: key, rest, new-seq, new-token,
# prefill usage, decode usage, rid, room, input_len, output_len, "prefill", transfer_total MB, other type,
# rare head, rest of the rare line. The head must start the message: `[^\]\n]*\] ` cannot cross a "]".
_FREQUENT_KINDS = ("prefill_batch", "decode_batch", "time_stats")
_RARE_HEADS = sorted({f.head for f in FORMATS if f.head and f.kind not in _FREQUENT_KINDS}, key=len, reverse=True)
_FREQUENT_TAIL = (
    rb"[^\]\n]*\] (?:Prefill batch(?: \[\d+\])?, #new-seq: (\d+), #new-token: (\d+), #cached-token: \d+, "
    rb"(?:full )?token usage: ([\d.]+)|Decode batch(?: \[\d+\])?, #running-req: \d+, #[a-z ]*token: \d+, "
    rb"[a-z ]*token usage: ([\d.]+)|ReqTimeStats\(rid=([^,\s]+), (?:bootstrap_room=(\w+), )?input_len=(\d+), "
    rb"cached_input_len=\d+, output_len=(\d+), attempts=\d+, type=(?:(prefill)\):[^\n]* transfer_total=([\d.]+) MB"
    rb"|(\w+)\))|(" + b"|".join(re.escape(h) for h in _RARE_HEADS) + rb")([^\n]*))"
)
_FREQUENT_RE = {
    name: re.compile(rb"\[" + ts + _FREQUENT_TAIL)
    for name, ts in (
        ("minute", rb"(\d{4}-\d\d-\d\d \d\d:\d\d)(:\d\d)"),
        ("10min", rb"(\d{4}-\d\d-\d\d \d\d:\d)(\d:\d\d)"),
        ("hour", rb"(\d{4}-\d\d-\d\d \d\d)(:\d\d:\d\d)"),
        ("day", rb"(\d{4}-\d\d-\d\d)( \d\d:\d\d:\d\d)"),
    )
}
_KIND_OF = {f.head: f.kind for f in FORMATS if f.head}

_RID_RE = re.compile(r"\brid=['\"]?([^'\",\s)]+)")
_ROOM_RE = re.compile(r"bootstrap_room=(\d+)")
_TOO_LONG_RE = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")
_BUDGET_RE = re.compile(r"KV memory budget: input_len=(\d+)")
_TRUNC_RE = re.compile(r"len\(req\.origin_input_ids\)=(\d+), max_req_input_len=(\d+)")
_CAP_RE = re.compile(r"Request (\S+) exceeds the maximum number of tokens: (\d+) > (\d+)")
_CTX_RE = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_FIN_ID_RE = re.compile(r"'id': '([^']+)'")
_FIN_REASON_RE = re.compile(r"'finish_reason': \{'type': '(\w+)'")
_FIN_PROMPT_RE = re.compile(r"'prompt_tokens': (\d+)")
_FIN_COMPLETION_RE = re.compile(r"'completion_tokens': (\d+)")
_STARTUP_RE = re.compile(r"max_total_num_tokens=(\d+).*?context_len=(\d+)")
_POOL_WARN_RE = re.compile(r"KV pool holds (\d+) tokens, fewer than --context-length (\d+)")
_MISMATCH_REQ_RE = re.compile(r"req=['\"]?([^'\",\s]+)")
_CANARY_STATS_RE = re.compile(r"violations=(\d+)")
_CANARY_TAG_RE = re.compile(r"launch_tag=(\S+) fail_reason=(\S+)")


# ---------------------------------------------------------------------------------------------
# The start-up line
# ---------------------------------------------------------------------------------------------


def parse_server_args(msg: str) -> dict[str, Any] | None:
    """The fields of a `server_args={...}` or `server_args=ServerArgs(...)` message; never evaluates code."""
    body = msg[len("server_args=") :].strip()
    if body.startswith("{"):
        try:
            out = ast.literal_eval(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return _tolerant_dict(body)
        return out if isinstance(out, dict) else None
    if body.startswith("ServerArgs("):
        try:
            call = ast.parse(body, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(call, ast.Call):
            return None
        out: dict[str, Any] = {}
        for kw in call.keywords:
            if kw.arg is None:
                continue
            try:
                out[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                out[kw.arg] = ast.unparse(kw.value)  # an object repr: keep its text, evaluate nothing
        return out
    return None


_TOP_KEY_RE = re.compile(r"""(?:^\{|, )'([a-z_][a-z0-9_]*)': ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[-\w.]+)""")


def _tolerant_dict(body: str) -> dict[str, Any]:
    """Scalar fields of a dict repr that literal_eval refused (an object repr inside it)."""
    out: dict[str, Any] = {}
    for key, raw in _TOP_KEY_RE.findall(body):
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


_VERSION_FIELDS = [
    frozenset(n for n, (a, b) in sglang_flags.FIELDS.items() if a <= i <= b) for i in range(len(sglang_flags.VERSIONS))
]


def infer_version(keys: set[str]) -> str | None:
    """The release whose ServerArgs fields are exactly these keys (SGLang logs every field), else None."""
    if len(keys) < 50:
        return None  # a partial repr (tolerant parse) says nothing about the release
    scores = [len(keys ^ f) for f in _VERSION_FIELDS]
    best = min(scores)
    if best > 3 or scores.count(best) != 1:
        return None
    return sglang_flags.VERSIONS[scores.index(best)]


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


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
    requests: int = 0
    first_request: str = ""
    last_request: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def saw_request(self, ts: str) -> None:
        self.requests += 1
        self.first_request = self.first_request or ts
        self.last_request = ts


@dataclass
class Window:
    prefill_batches: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_max_usage: float = 0.0
    decode_batches: int = 0
    decode_max_usage: float = 0.0
    decode_requests: int = 0
    too_long: int = 0
    truncated: int = 0
    decode_capacity_rejects: int = 0
    context_rejects: int = 0
    transfer_failures: int = 0
    checksum_mismatches: int = 0
    corruption: int = 0
    deferred_timeouts: int = 0
    canary_violations: int = 0
    candidates: int = 0
    placeholder: int = 0
    coverage: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestNote:
    """A request worth listing: too long, failed, mismatched, or a leak candidate."""

    side: str
    rid: str | None
    room: str | None
    time: str
    kind: str
    detail: str
    status: str = ""
    coverage: str = ""
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(slots=True)
class DecodeOutcome:
    time: bytes = b""
    completed: bool = False
    output_len: int = 0
    failed: bool = False
    reason: str = ""
    run: Run | None = None
    mismatch: bool = False
    evidence: str = ""


@dataclass(slots=True)
class PrefillRecord:
    """What prefill's own lines say about one request."""

    room: bytes | None = None
    input_len: int | None = None
    transfer_mb: float | None = None


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes_scanned": self.bytes_scanned,
            "lines_matched": self.lines_matched,
            "runs": [r.to_dict() for r in self.runs],
            "checks": self.checks,
            "checksum_coverage": self.coverage,
            "unverified_requests_sample": self.unverified_sample,
            "windows": {_window_label(k, self.window_kind): w.__dict__ for k, w in sorted(self.windows.items())},
            "requests": [r.to_dict() for r in self.requests],
            "findings": [f.to_dict() for f in self.findings],
        }


def _window_label(key: str, kind: str) -> str:
    if kind == "10min":
        return key + "0"
    if kind == "hour":
        return key + ":00"
    return key


def _max_usage(col: tuple[bytes, ...]) -> float:
    vals = [x for x in col if x]
    return float(max(vals, key=float)) if vals else 0.0


class _Scanner:
    def __init__(
        self, since: str | None, until: str | None, model: str | None, window: str, version: str | None
    ) -> None:
        self.since_s = since
        self.until_s = until
        self.model = model
        self.window = window
        self.version = version
        self.wlen = _WINDOW_LEN[window]
        self.frequent_re = _FREQUENT_RE[window]
        self.windows: dict[str, Window] = {}
        self.runs: list[Run] = []
        self.bytes_scanned = 0
        self.lines_matched = 0
        self.side_lines: dict[str, int] = {}
        self.side_request_lines: dict[str, int] = {}
        # prefill side
        # Per-request state is keyed by the raw bytes the frequent regex yields (no decode per line).
        self.p_records: dict[bytes, PrefillRecord] = {}  # rid -> what prefill logged about it
        self.too_long: list[RequestNote] = []
        # decode side
        self.d_rooms: dict[bytes, DecodeOutcome] = {}
        self.d_rid_room: dict[bytes, bytes] = {}
        self.d_rids: dict[bytes, DecodeOutcome] = {}  # outcomes with no room known
        self.notes: list[RequestNote] = []
        self.canary_perturb: list[str] = []
        self.canary_overflow: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str, str]] = set()  # de-duplicate per-rank repeats

    # -- windows -------------------------------------------------------------------------------
    def win(self, ts: str) -> Window:
        key = ts[: self.wlen]
        w = self.windows.get(key)
        if w is None:
            w = self.windows[key] = Window()
        return w

    def in_range(self, ts: str) -> bool:
        if self.since_s and ts < self.since_s:
            return False
        if self.until_s and ts[: len(self.until_s)] > self.until_s:
            return False
        return True

    # -- files ---------------------------------------------------------------------------------
    def scan_file(self, path: str, side: str) -> None:
        run = Run(side=side, start="")
        run.counted = self.model is None  # unknown model: counted only when no filter
        run.version = self.version
        run.version_source = "--sglang-version" if self.version else ""
        self.runs.append(run)
        self.side_lines.setdefault(side, 0)
        self.side_request_lines.setdefault(side, 0)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.bytes_scanned += size
            if size == 0:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                start = 0
                while start < size:
                    end = min(start + CHUNK_BYTES, size)
                    if end < size:
                        cut = mm.rfind(b"\n", start, end)
                        end = cut + 1 if cut >= start else (mm.find(b"\n", end) + 1 or size)
                    run = self.scan_chunk(mm, start, end, side, run)
                    start = end

    def scan_chunk(self, buf: mmap.mmap, start: int, end: int, side: str, run: Run) -> Run:
        """Lines buf[start:end] (whole lines) of one side; returns the run in force at the end."""
        rows = self.frequent_re.findall(buf, start, end)
        if not rows:
            return run
        if self.since_s or self.until_s:
            rows = [r for r in rows if r[13] or self.in_range((r[0] + r[1]).decode())]
        self.side_lines[side] += len(rows)
        prev = 0
        for i in itertools.compress(range(len(rows)), [r[13] for r in rows]):
            if run.counted and i > prev:
                self.scan_frequent(rows[prev:i], side, run)
            prev = i + 1
            row = rows[i]
            kind, ts = _KIND_OF[row[13]], (row[0] + row[1]).decode()
            msg = (row[13] + row[14]).decode("utf-8", "replace")
            if kind in ("server_args", "startup"):
                run = self.start_run(run, side, kind, ts, msg)
            elif run.counted and self.in_range(ts):
                self.handle(kind, ts, msg, side, run)
        if run.counted and prev < len(rows):
            self.scan_frequent(rows[prev:], side, run)
        return run

    def scan_frequent(self, rows: list[tuple[bytes, ...]], side: str, run: Run) -> None:
        """Batch lines (aggregated per window) and ReqTimeStats lines, in file order."""
        self.lines_matched += len(rows)
        keys = [r[0] for r in rows]
        i = 0
        for key, grp in itertools.groupby(keys):
            n = len(list(grp))
            part = rows[i : i + n] if n < len(rows) else rows
            i += n
            w = self.win(key.decode())
            p = [r for r in part if r[2]]
            if p:
                w.prefill_batches += len(p)
                w.prefill_seqs += sum(map(int, [r[2] for r in p]))
                w.prefill_tokens += sum(map(int, [r[3] for r in p]))
                w.prefill_max_usage = max(w.prefill_max_usage, float(max([r[4] for r in p])))
            d = [r[5] for r in part if r[5]]
            if d:
                w.decode_batches += len(d)
                w.decode_max_usage = max(w.decode_max_usage, float(max(d)))
            stats = [r for r in part if r[6]]
            if stats:
                self.side_request_lines[side] += len(stats)
                self._time_stats_rows(w, stats, side, run)

    def _time_stats_rows(self, w: Window, rows: list[tuple[bytes, ...]], side: str, run: Run) -> None:
        """ReqTimeStats lines of one window (managers/schedule_batch.py log_time_stats)."""
        run.requests += len(rows)
        run.first_request = run.first_request or (rows[0][0] + rows[0][1]).decode()
        run.last_request = (rows[-1][0] + rows[-1][1]).decode()
        pool = run.pool_tokens
        records, rooms, rid_room = self.p_records, self.d_rooms, self.d_rid_room
        prefill_side = side == "prefill"
        for key, rest, _, _, _, _, rid, room, in_b, out_b, is_prefill, mb, *_ in rows:
            if room == b"None":
                room = b""
            if is_prefill or prefill_side:
                rec = records.get(rid)
                if rec is None:
                    rec = records[rid] = PrefillRecord()
                if room:
                    rec.room = room
                rec.input_len = int(in_b)
                if mb:
                    rec.transfer_mb = float(mb)
                if pool and rec.input_len > pool:
                    note = RequestNote(side, rid.decode(), room.decode() or None, (key + rest).decode(),
                                       "over_pool_served", f"input {rec.input_len} > pool {pool}")  # fmt: skip
                    self.notes.append(note)
                continue
            if room:
                out = rooms.get(room)
                if out is None:
                    out = rooms[room] = DecodeOutcome(time=key + rest, run=run)
                rid_room.setdefault(rid, room)
            else:
                out = self._decode_outcome(rid, None, key + rest, run)
            if out_b != b"0" and not out.failed:
                if not out.completed:
                    w.decode_requests += 1
                out.completed = True
                out.output_len = int(out_b)
                out.evidence = out.evidence or "decode ReqTimeStats"

    # -- runs ----------------------------------------------------------------------------------
    def start_run(self, run: Run, side: str, kind: str, ts: str, msg: str) -> Run:
        self.lines_matched += 1
        ts = ts[:19]
        if kind == "startup" and run.start and not run.startup_seen:
            new = run  # the scheduler line that follows this run's server_args line
        else:
            new = Run(side=side, start=ts, version=self.version)
            new.version_source = "--sglang-version" if self.version else ""
            self.runs.append(new)
        if kind == "server_args":
            fields = parse_server_args(msg) or {}
            new.model = _str(fields.get("served_model_name")) or _str(fields.get("model_path"))
            new.checksum = bool(fields.get("disaggregation_enable_kv_checksum", False))
            new.canary = _str(fields.get("kv_canary"))
            new.auto_truncate = _opt_bool(fields.get("allow_auto_truncate"))
            new.log_requests = _opt_bool(fields.get("log_requests"))
            new.log_requests_format = _str(fields.get("log_requests_format"))
            new.time_stats = _opt_bool(fields.get("enable_request_time_stats_logging"))
            new.transfer_backend = _str(fields.get("disaggregation_transfer_backend"))
            if isinstance(fields.get("context_length"), int):
                new.context_len = fields["context_length"]
            if not self.version:
                inferred = infer_version(set(fields))
                if inferred:
                    new.version, new.version_source = inferred, "server_args fields"
                elif "disaggregation_enable_kv_checksum" in fields:
                    new.version_source = "server_args fields: 0.5.21 or later"
            model_path = _str(fields.get("model_path")) or ""
            if self.model is None:
                new.counted = True
            else:
                needle = self.model.lower()
                new.counted = needle in (new.model or "").lower() or needle in model_path.lower()
        else:
            new.startup_seen = True
            m = _STARTUP_RE.search(msg)
            if m:
                new.pool_tokens, new.context_len = int(m.group(1)), int(m.group(2))
            if new is not run:
                new.counted = run.counted if self.model is not None else True
        return new

    # -- rare lines ----------------------------------------------------------------------------
    def once(self, kind: str, a: str | None, b: str | None) -> bool:
        key = (kind, a or "", b or "")
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def handle(self, kind: str, ts: str, msg: str, side: str, run: Run) -> None:
        if kind == "json_request":
            self._json_request(ts, msg, side, run)
            return
        if kind == "capacity" and " exceeds the maximum number of tokens: " not in msg:
            return
        if kind == "context_truncated" and "Truncating the input" not in msg:
            return
        self.lines_matched += 1
        w = self.win(ts)
        rid_m = _RID_RE.search(msg)
        rid = rid_m.group(1) if rid_m else None
        room_m = _ROOM_RE.search(msg)
        room = room_m.group(1) if room_m else None
        if kind in ("receive", "finish", "too_long", "kv_budget", "capacity", "context_reject"):
            self.side_request_lines[side] += 1
        if kind in ("too_long", "kv_budget"):
            if not self.once(kind + side, rid, None):
                return
            run.saw_request(ts)
            if kind == "too_long":
                m = _TOO_LONG_RE.search(msg)
                detail = f"input {m.group(1)} tokens > allowed {m.group(2)}" if m else "input above the allowed length"
            else:
                m = _BUDGET_RE.search(msg)
                detail = f"input {m.group(1)} tokens above the KV memory budget" if m else "above the KV memory budget"
            w.too_long += 1
            note = RequestNote(side, rid, room, ts, kind, detail, version=run.version)
            if side == "prefill":
                self.too_long.append(note)
            else:
                note.status = "rejected on decode"
                self.notes.append(note)
                self._outcome_of(rid, room, ts, run).failed = True
        elif kind in ("truncated", "context_truncated"):
            m = _TRUNC_RE.search(msg) if kind == "truncated" else _CTX_RE.search(msg)
            w.truncated += 1
            detail = f"input {m.group(1)} tokens truncated to {m.group(2)}" if m else "input truncated"
            self.notes.append(RequestNote(side, None, None, ts, "truncated", detail, "served truncated"))
        elif kind == "capacity":
            m = _CAP_RE.search(msg)
            rid = m.group(1) if m else rid
            if not self.once(kind + side, rid, None):
                return
            run.saw_request(ts)
            w.decode_capacity_rejects += 1
            detail = f"input {m.group(2)} tokens > {side} capacity {m.group(3)}" if m else "over capacity"
            self.notes.append(RequestNote(side, rid, room, ts, "over_capacity", detail, f"rejected on {side}"))
            if side == "decode":
                self._outcome_of(rid, room, ts, run).failed = True
        elif kind == "context_reject":
            m = _CTX_RE.search(msg)
            w.context_rejects += 1
            detail = f"input {m.group(1)} tokens > context {m.group(2)}" if m else msg[:120]
            self.notes.append(RequestNote(side, rid, room, ts, "over_context", detail, "rejected (400)"))
        elif kind == "receive":
            run.saw_request(ts)
            self._bind_room(side, rid, room)
        elif kind == "finish":
            fid = _FIN_ID_RE.search(msg)
            reason = _FIN_REASON_RE.search(msg)
            pt, ct = _FIN_PROMPT_RE.search(msg), _FIN_COMPLETION_RE.search(msg)
            self._finished(
                rid or (fid.group(1) if fid else None), room, reason.group(1) if reason else "?",
                int(pt.group(1)) if pt else None, int(ct.group(1)) if ct else None, ts, side, run, "Finish line",
            )  # fmt: skip
        elif kind in ("transfer_failed", "bootstrap_failed"):
            if not self.once(kind + side, rid, room):
                return
            w.transfer_failures += 1
            why = msg.split(" with exception ", 1)[1][:160] if " with exception " in msg else ""
            self.notes.append(RequestNote(side, rid, room, ts, kind, why, "aborted"))
            if side == "decode":
                o = self._outcome_of(rid, room, ts, run)
                o.failed, o.reason = True, kind
        elif kind == "checksum_mismatch":
            m = _MISMATCH_REQ_RE.search(msg)
            rid = m.group(1) if m else rid
            if not self.once(kind, rid, room):
                return
            w.checksum_mismatches += 1
            self.notes.append(RequestNote(side, rid, room, ts, "checksum_mismatch", msg[:200], "rejected (500)"))
            o = self._outcome_of(rid, room, ts, run)
            o.failed, o.mismatch, o.reason = True, True, "checksum mismatch"
        elif kind == "checksum_skipped":
            if run.checksum_skipped_at is None:
                run.checksum_skipped_at = ts
        elif kind == "corruption":
            if not self.once(kind, rid, room):
                return
            w.corruption += 1
            self.notes.append(RequestNote(side, rid, room, ts, "context_corruption", msg[:200], "rejected"))
            o = self._outcome_of(rid, room, ts, run)
            o.failed, o.reason = True, "context corruption"
        elif kind == "deferred_timeout":
            m = re.search(r"for room (\d+)", msg)
            room = m.group(1) if m else room
            if not self.once(kind, room, None):
                return
            w.deferred_timeouts += 1
            self.notes.append(
                RequestNote(side, rid, room, ts, "deferred_release_timeout", msg[:200], "pages released undrained")
            )
        elif kind == "canary_violation":
            w.canary_violations += 1
            run.canary_violations += 1
            run.canary_seen = run.canary_seen or "violation lines"
            m = _CANARY_TAG_RE.search(msg)
            detail = f"launch_tag={m.group(1)} fail_reason={m.group(2)}" if m else msg[:160]
            self.notes.append(RequestNote(side, None, None, ts, "kv_canary_violation", detail, "stale or foreign KV"))
        elif kind == "canary_stats":
            run.canary_seen = "stats lines"
            m = _CANARY_STATS_RE.search(msg)
            if m and int(m.group(1)) > run.canary_violations:
                extra = int(m.group(1)) - run.canary_violations
                run.canary_violations += extra
                w.canary_violations += extra
        elif kind == "canary_install":
            run.canary_seen = run.canary_seen or "install line"
        elif kind == "canary_overflow":
            self.canary_overflow.append((side, ts))
        elif kind == "canary_perturb":
            self.canary_perturb.append(ts)
        elif kind == "pool_warning":
            m = _POOL_WARN_RE.search(msg)
            run.pool_warning = True
            if m:
                run.pool_tokens = run.pool_tokens or int(m.group(1))
                run.context_len = run.context_len or int(m.group(2))

    def _json_request(self, ts: str, msg: str, side: str, run: Run) -> None:
        try:
            doc = json.loads(msg)
        except ValueError:
            return
        event = doc.get("event") if isinstance(doc, dict) else None
        if event not in ("request.received", "request.finished"):
            return
        self.lines_matched += 1
        self.side_request_lines[side] += 1
        obj = doc.get("obj") if isinstance(doc.get("obj"), dict) else {}
        rid = _str(doc.get("rid") or obj.get("rid"))
        room = _str(obj.get("bootstrap_room"))
        if event == "request.received":
            run.saw_request(ts)
            self._bind_room(side, rid, room)
            return
        meta = ((doc.get("out") or {}) if isinstance(doc.get("out"), dict) else {}).get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type", "?") if isinstance(meta, dict) else "?"
        pt, ct = _opt_int(meta.get("prompt_tokens")), _opt_int(meta.get("completion_tokens"))
        self._finished(rid or _str(meta.get("id")), room, str(reason), pt, ct, ts, side, run, "JSON request.finished")

    def _bind_room(self, side: str, rid: str | None, room: str | None) -> None:
        if not (rid and room):
            return
        if side == "prefill":
            self.p_records.setdefault(rid.encode(), PrefillRecord()).room = room.encode()
        else:
            self.d_rid_room[rid.encode()] = room.encode()

    def _finished(
        self, rid: str | None, room: str | None, reason: str, pt: int | None, ct: int | None, ts: str, side: str,
        run: Run, how: str,
    ) -> None:  # fmt: skip
        if rid and rid.startswith("HEALTH_CHECK"):
            return
        if side == "prefill":
            self._bind_room(side, rid, room)
            return
        w = self.win(ts)
        out = self._outcome_of(rid, room, ts, run)
        if reason == "abort":
            out.failed = True
            out.reason = out.reason or "finished with abort"
            return
        if not out.completed:
            w.decode_requests += 1
            run.saw_request(ts)
        out.completed = True
        out.evidence = out.evidence or f"decode {how}"
        if ct is not None:
            out.output_len = ct
        if pt == 1 and ct:
            w.placeholder += 1
            self.notes.append(
                RequestNote(
                    side, rid, room, ts, "placeholder_signature",
                    f"finished '{reason}' with prompt_tokens=1 and {ct} completion tokens",
                    "served from a 1-token stub",
                )
            )  # fmt: skip

    def _outcome_of(self, rid: str | None, room: str | None, ts: str, run: Run) -> DecodeOutcome:
        """_decode_outcome for the rare-line handlers, which hold decoded strings."""
        return self._decode_outcome(
            rid.encode() if rid else None, room.encode() if room else None, ts.encode(), run
        )

    def _decode_outcome(self, rid: bytes | None, room: bytes | None, ts: bytes, run: Run) -> DecodeOutcome:
        if room is None and rid is not None:
            room = self.d_rid_room.get(rid)
        if room is not None:
            out = self.d_rooms.get(room)
            if out is None:
                out = self.d_rooms[room] = DecodeOutcome(time=ts, run=run)
            if rid is not None:
                self.d_rid_room.setdefault(rid, room)
            return out
        key = rid or b"?" + ts
        out = self.d_rids.get(key)
        if out is None:
            out = self.d_rids[key] = DecodeOutcome(time=ts, run=run)
        return out


def _str(v: Any) -> str | None:
    return None if v is None or v == "None" else str(v)


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------


def _coverage_of(out: DecodeOutcome, prefill_checksum: bool | None) -> str:
    if out.mismatch:
        return "mismatch"
    run = out.run
    if run is None or run.checksum is None:
        return "unknown"
    if not run.checksum:
        return "absent"
    if run.checksum_skipped_at is not None and out.time >= run.checksum_skipped_at.encode():
        return "skipped"
    if prefill_checksum is False:
        return "skipped"  # one side only: digest 0, skipped silently
    return "verified (inferred)"


def _judge_abort(note: RequestNote, sc: _Scanner, have_decode: bool) -> str:
    """Status of one request aborted on prefill; 'TRANSFERRED' only with evidence of the handoff."""
    rec = sc.p_records.get(note.rid.encode()) if note.rid else None
    note.room = note.room or (rec.room.decode() if rec and rec.room else None)
    out = sc.d_rooms.get(note.room.encode()) if note.room else None
    v = rel.parse_version(note.version)
    fate = rel.stub_fate(v)
    if out is not None and out.completed and not out.failed:
        return f"TRANSFERRED: decode finished it ({out.output_len} output tokens, {out.evidence})"
    if out is not None and out.failed:
        return f"stopped on decode ({out.reason or 'failed'})"
    if rec is not None and rec.transfer_mb:
        return f"TRANSFERRED: prefill's ReqTimeStats show a completed transfer of {rec.transfer_mb:.2f} MB"
    if rel.stub_reaches_decode(v) is False:
        return f"not handed over: SGLang {note.version} {fate}"
    stub = rec is not None and rec.input_len == 1
    if stub and rel.stub_reaches_decode(v):
        return f"POSSIBLE: SGLang {note.version} {fate}; prefill processed the stub, no decode record confirms it"
    if not have_decode:
        return "decode log not given"
    if note.room is None:
        return "unmatched: no bootstrap_room for this rid in the prefill log"
    return "no decode record for this room"


def _pool_severity(v: rel.Version | None) -> tuple[Severity, str]:
    reaches = rel.stub_reaches_decode(v)
    if reaches:
        return Severity.CRITICAL, f"in SGLang {rel.label(v)} an over-pool prompt is {rel.stub_fate(v)}"
    if reaches is None:
        return Severity.WARNING, "release unknown: in 0.5.19 an over-pool prompt is handed to decode as a stub"
    return Severity.WARNING, f"SGLang {rel.label(v)} refuses such prompts ({rel.stub_fate(v)})"


def _checks(r: Run) -> dict[str, Any]:
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


def scan_logs(
    prefill_log: str,
    decode_log: str | None = None,
    since: str | None = None,
    until: str | None = None,
    model: str | None = None,
    window: str = "hour",
    version: str | None = None,
) -> LogReport:
    sc = _Scanner(since, until, model, window, version)
    gc_was_on = gc.isenabled()
    gc.disable()  # the scan builds millions of tuples and no reference cycles; collections would only cost time
    try:
        sc.scan_file(prefill_log, "prefill")
        if decode_log:
            sc.scan_file(decode_log, "decode")
    finally:
        if gc_was_on:
            gc.enable()
    files = {"prefill": prefill_log}
    if decode_log:
        files["decode"] = decode_log
    runs = [r for r in sc.runs if r.start or r.model or r.pool_tokens or r.requests]
    p_runs = [r for r in runs if r.side == "prefill" and r.checksum is not None]
    prefill_checksum = p_runs[-1].checksum if p_runs else None
    findings: list[Finding] = []

    candidates = possible = unmatched = 0
    for note in sc.too_long:
        note.status = _judge_abort(note, sc, decode_log is not None)
        w = sc.win(note.time)
        if note.status.startswith("TRANSFERRED"):
            candidates += 1
            w.candidates += 1
        elif note.status.startswith("POSSIBLE"):
            possible += 1
        elif not note.status.startswith("not handed over") and not note.status.startswith("stopped"):
            unmatched += 1
        sc.notes.append(note)

    coverage: dict[str, int] = {}
    unverified: list[str] = []
    for key, out in itertools.chain(sc.d_rooms.items(), sc.d_rids.items()):
        if not (out.completed or out.mismatch):
            continue
        cov = _coverage_of(out, prefill_checksum)
        coverage[cov] = coverage.get(cov, 0) + 1
        w = sc.win(out.time[: sc.wlen].decode())
        w.coverage[cov] = w.coverage.get(cov, 0) + 1
        if cov not in ("verified (inferred)", "mismatch") and len(unverified) < 1000:
            unverified.append(key.decode("utf-8", "replace"))
    for n in sc.notes:
        if n.side == "decode" and n.room and n.room.encode() in sc.d_rooms:
            n.coverage = _coverage_of(sc.d_rooms[n.room.encode()], prefill_checksum)

    def count(kind: str) -> int:
        return sum(1 for n in sc.notes if n.kind == kind)

    def where(side: str) -> str:
        return files.get(side, "")

    if candidates:
        wins = sorted({_window_label(n.time[: sc.wlen], window) for n in sc.notes if "TRANSFERRED" in n.status})
        findings.append(
            Finding(
                "aborted-but-transferred", Severity.CRITICAL, "requests",
                f"{candidates} request(s) were aborted on prefill as too long and their KV was still handed over "
                f"(decode decoded them, or prefill logged a completed transfer); their responses may contain another "
                f"request's KV (windows: {', '.join(wins)})",
                "treat those responses as suspect; upgrade to SGLang >= 0.5.22 and keep context length <= pool",
                where("decode") or where("prefill"),
            )
        )  # fmt: skip
    if possible:
        findings.append(
            Finding(
                "possible-stub-handoff", Severity.WARNING, "requests",
                f"{possible} request(s) were rejected on a prefill release that hands the 1-token stub to decode, "
                "and prefill processed the stub; no decode record confirms or rules out the handoff",
                "audit the decode log of the same period (with --enable-request-time-stats-logging or --log-requests)",
                where("prefill"),
            )
        )  # fmt: skip
    if unmatched:
        findings.append(
            Finding(
                "too-long-unmatched", Severity.WARNING, "requests",
                f"{unmatched} too-long abort(s) on prefill could not be followed to decode",
                "enable --enable-request-time-stats-logging or --log-requests on both sides to join by bootstrap_room",
                where("prefill"),
            )
        )  # fmt: skip
    any_version = next((rel.parse_version(r.version) for r in runs if r.version), None)
    for kind, rule, sev, what, fix in (
        ("placeholder_signature", "placeholder-signature", Severity.CRITICAL,
         "decode finished request(s) with prompt_tokens=1 (a 1-token stub was decoded as if complete)",
         "treat those responses as suspect; upgrade to SGLang >= 0.5.22"),
        ("checksum_mismatch", "checksum-mismatch", Severity.CRITICAL,
         "KV checksum mismatch(es): corrupted or foreign KV reached decode (rejected with 500)",
         "find the transfer path that corrupts pages; check transfer failures in the same windows"),
        ("context_corruption", "context-corruption", Severity.CRITICAL,
         "decode detected context corruption (metadata room mismatch)",
         "check deferred release and transfer failures around these times"),
        ("kv_canary_violation", "kv-canary-violation", Severity.CRITICAL,
         "KV canary violation line(s): an engine's pool held stale or foreign KV",
         "treat responses in those windows as suspect; the canary checks one engine's pool, so pair it with the KV "
         "checksum for the handoff"),
        ("over_pool_served", "over-pool-served", Severity.CRITICAL,
         "prefill processed request(s) whose input exceeded its KV pool",
         "keep context length <= pool on both sides"),
        ("deferred_release_timeout", "deferred-release-timeout", Severity.WARNING,
         "decode released KV pages without prefill's drain acknowledgement",
         "raise SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT on decode and check prefill health "
         "(decode holds pages; prefill has no deferred release to configure)"),
        ("truncated", "auto-truncated", Severity.WARNING,
         "prompt(s) were silently truncated (--allow-auto-truncate)",
         "turn --allow-auto-truncate off on both sides"),
        ("transfer_failed", "transfer-failures", Severity.WARNING,
         "KV transfer failure line(s)", "check network/transfer-engine health; with Mooncake, bound batches with "
         "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES (SGLang >= 0.5.20)"),
        ("bootstrap_failed", "transfer-failures", Severity.WARNING,
         "bootstrap/handshake failure line(s)", "check the bootstrap server and decode health"),
    ):  # fmt: skip
        n = count(kind)
        if n:
            findings.append(Finding(rule, sev, "requests", f"{n} {what}", fix))
    for r in runs:
        if not r.counted:
            continue
        v = rel.parse_version(r.version)
        if r.pool_warning or (r.pool_tokens and r.context_len and r.context_len > r.pool_tokens):
            sev, why = _pool_severity(v)
            findings.append(
                Finding(
                    "pool-below-context", sev, r.side,
                    f"the run started {r.start or '?'} had a KV pool of {r.pool_tokens} tokens below its context "
                    f"length {r.context_len}; one full-length request cannot fit; {why}",
                    f"lower --context-length to <= {r.pool_tokens} or give the pool more memory on {r.side}",
                    where(r.side),
                )
            )  # fmt: skip
    if sc.canary_overflow:
        sides = sorted({s for s, _ in sc.canary_overflow})
        findings.append(
            Finding(
                "kv-canary-coverage-gap", Severity.WARNING, "/".join(sides),
                f"{len(sc.canary_overflow)} step(s) skipped the per-forward canary verify (overflow), first at "
                f"{sc.canary_overflow[0][1]}: those forwards ran unchecked",
                "check the pool sizing the warning names; raise the canary's capacity or lower batch size",
            )
        )  # fmt: skip
    if sc.canary_perturb:
        findings.append(
            Finding(
                "kv-canary-perturbation", Severity.INFO, "servers",
                f"the canary's test perturbation ran ({len(sc.canary_perturb)} line(s), first at "
                f"{sc.canary_perturb[0]}): violations in these logs may have been injected on purpose",
                "turn the canary perturbation off outside tests",
            )
        )  # fmt: skip
    over_pool = count("too_long") + count("kv_budget") + count("over_capacity") + count("over_context")
    if over_pool:
        findings.append(
            Finding(
                "over-pool-requests", Severity.INFO, "requests",
                f"{over_pool} request(s) had an input above the context or pool limit (listed per request)",
                "compare with the aborted-but-transferred rule; rejected requests alone are not a leak",
            )
        )  # fmt: skip
    if coverage.get("skipped"):
        findings.append(
            Finding(
                "checksum-skipped", Severity.WARNING, "requests",
                f"{coverage['skipped']} decoded request(s) were admitted with the KV checksum skipped (layout differs "
                "or checksum on one side only)",
                "make both sides' KV layouts identical and enable the checksum on both",
            )
        )  # fmt: skip
    if coverage.get("absent"):
        old = any_version is not None and rel.has_kv_checksum(any_version) is False
        findings.append(
            Finding(
                "checksum-absent", Severity.WARNING, "requests",
                f"{coverage['absent']} decoded request(s) ran without a KV checksum"
                + (f" (SGLang {rel.label(any_version)} has none)" if old else ""),
                "upgrade to SGLang >= 0.5.22: the KV checksum exists from 0.5.21" if old
                else "start both sides with --disaggregation-enable-kv-checksum (SGLang >= 0.5.21)",
            )
        )  # fmt: skip
    findings += _input_findings(sc, runs, files, model)
    notes = sorted(sc.notes, key=lambda n: n.time)
    return LogReport(
        files=files,
        bytes_scanned=sc.bytes_scanned,
        lines_matched=sc.lines_matched,
        runs=runs,
        windows=sc.windows,
        requests=notes,
        coverage=coverage,
        unverified_sample=unverified,
        findings=findings,
        window_kind=window,
        checks=[_checks(r) for r in runs if r.counted and (r.start or r.requests)],
    )


def _input_findings(sc: _Scanner, runs: list[Run], files: dict[str, str], model: str | None) -> list[Finding]:
    """Say loudly when a file held nothing we recognise: no findings must never mean 'not read'."""
    out: list[Finding] = []
    for side, path in files.items():
        side_runs = [r for r in runs if r.side == side and r.start]
        if sc.side_lines.get(side, 0) == 0:
            out.append(
                Finding(
                    "log-unrecognised", Severity.WARNING, side,
                    f"{path} holds no line in a format SGLang 0.5.19 .. 0.5.23 writes (start-up, batch or request "
                    "lines); nothing was checked for it",
                    "give the SGLang server's own log (stdout/stderr of the launch), not a router or proxy log",
                    path,
                )
            )  # fmt: skip
            continue
        if not side_runs:
            out.append(
                Finding(
                    "no-startup-line", Severity.WARNING, side,
                    f"{path} has no `server_args=` or `max_total_num_tokens=` start-up line: the model, release, KV "
                    "checksum and pool size of this server are unknown, so coverage and pool rules could not run",
                    "include the log from the server's start (or pass --sglang-version and audit the configuration "
                    "with `kvfence audit sglang`)",
                    path,
                )
            )  # fmt: skip
        if sc.side_request_lines.get(side, 0) == 0:
            out.append(
                Finding(
                    "no-request-lines", Severity.WARNING, side,
                    f"{path} has no per-request line (ReqTimeStats, --log-requests, or an abort line): no request "
                    "could be followed through the handoff",
                    "start SGLang with --enable-request-time-stats-logging (or --log-requests)",
                    path,
                )
            )  # fmt: skip
    if model is not None and not any(r.counted and r.start for r in runs):
        out.append(
            Finding(
                "model-filter-matched-nothing", Severity.WARNING, "servers",
                f"--model {model!r} matched no server run ({len([r for r in runs if r.start])} run(s) seen: "
                + ", ".join(sorted({r.model or '?' for r in runs if r.start})) + "); nothing was counted",
                "check the model name against the runs listed (served_model_name or model_path)",
            )
        )  # fmt: skip
    return out


def render_report(r: LogReport, max_requests: int = 50) -> str:
    from kvfence.audit.findings import findings_table, summary_line

    out: list[str] = []
    gb = r.bytes_scanned / 1e9
    out.append(f"scanned {gb:.3f} GB, {r.lines_matched} matching lines; files: {r.files}")
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
        out.append("checks active per run (requests = request lines seen while that run served):")
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
            cov = ", ".join(f"{k}={v}" for k, v in sorted(w.coverage.items())) or "-"
            rows.append(
                (
                    _window_label(key, r.window_kind), w.prefill_seqs, w.decode_requests,
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
            "checksum coverage of decoded requests: " + ", ".join(f"{k}={v}" for k, v in sorted(r.coverage.items()))
        )
    if r.requests:
        out.append("")
        shown = sorted(r.requests, key=lambda n: ("TRANSFERRED" not in n.status, n.time))[:max_requests]
        rows = [(n.time, n.side, n.kind, n.rid or "-", n.room or "-", n.detail, n.status) for n in shown]
        out.append(render_table(["TIME", "SIDE", "KIND", "RID", "ROOM", "DETAIL", "STATUS"], rows, wrap={5: 50, 6: 40}))
        if len(r.requests) > max_requests:
            out.append(f"... {len(r.requests) - max_requests} more request(s) in --json output")
    out.append("")
    out.append(findings_table(r.findings))
    out.append("")
    out.append(summary_line(r.findings))
    return "\n".join(out) + "\n"


def iter_lines_baseline(path: str) -> Iterator[bytes]:
    """Plain buffered line iteration: a baseline the benchmark compares against."""
    with open(path, "rb", buffering=1 << 20) as f:
        yield from f


def file_size(path: str) -> int:
    return os.path.getsize(path)
