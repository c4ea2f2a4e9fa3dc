"""Scan SGLang prefill/decode logs: was this deployment affected by the KV handoff leak, when, how often.

What it knows (SGLang's own log formats, 0.5.19 .. 0.5.23):
- Line prefix `[YYYY-MM-DD HH:MM:SS(.mmm)( DPn)( TPn)( EPn)...] message`.
- Scheduler batch lines `Prefill batch, #new-seq: N, #new-token: N, ..., token usage: U, ...` and
  `Decode batch, #running-req: N, #token: N, token usage: U, ...` (hybrid pools say `full token ...`).
- Startup lines `server_args=ServerArgs(...)` and `max_total_num_tokens=..., ..., context_len=..., ...`;
  each starts a server run with its own configuration (model, checksum on/off, pool size).
- Request lines: `Input length (N tokens) exceeds the maximum allowed length (M tokens)...,
  self.rid='R'` (scheduler abort of a too-long prompt), the auto-truncate warning, decode's
  `Request R exceeds the maximum number of tokens: N > CAP`, `Req Time Stats(rid=..., bootstrap_room=...,
  input len=..., output len=..., type=...)` / `ReqTimeStats(rid=..., input_len=..., ...)`,
  `--log-requests` `Receive: obj=...` / `Finish: obj=..., out={...}`, transfer failures
  (`Prefill|Decode transfer failed for request rank=.. rid.. bootstrap_room..`), `Prefill bootstrap failed`,
  `KV checksum mismatch req=.. bootstrap_room=..`, `KV checksum skipped: ...`, `Context corruption
  detected`, `Deferred KV release for room R timed out ...`.
What it does not know: requests that left no line. Checksum "verified" is inferred (SGLang logs no
per-request success line): checksum on in this run, no skip line, no mismatch for the request.

Speed: files are read in large binary chunks; batch lines go through one compiled regex per chunk,
rare lines are located with bytes.find (memmem) on a fixed needle and parsed only then.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.findings import Finding, Severity, render_table

CHUNK_BYTES = 32 << 20
_WINDOW_LEN = {"minute": 16, "10min": 15, "hour": 13, "day": 10}

_PREFIX_RE = re.compile(rb"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?[^\]\n]*\] ")
_BATCH_RE = re.compile(
    rb"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\] "
    rb"(?:Prefill batch[^#\n]*#new-seq: (\d+), #new-token: (\d+)[^\n]*?token usage: ([\d.]+)"
    rb"|Decode batch[^#\n]*#running-req: (\d+), #[a-z ]*token: (\d+), [a-z ]*token usage: ([\d.]+))"
)

# (needle searched with bytes.find, kind, text(s) the message must start with)
_RARE: list[tuple[bytes, str, bytes | tuple[bytes, ...]]] = [
    (b"server_args=", "server_args", b"server_args="),
    (b"max_total_num_tokens=", "startup", b"max_total_num_tokens="),
    (b"exceeds the maximum allowed length", "too_long", b"Input length ("),
    (b"Request length is longer than the KV cache pool", "truncated", b"Request length is longer"),
    (b" exceeds the maximum number of tokens: ", "decode_capacity", b"Request "),
    (
        b"is longer than the model's context length",
        "context_reject",
        (b"The input (", b"[http_server] Error: The input (", b"Error: The input ("),
    ),
    (b"] Receive: obj=", "receive", b"Receive: obj="),
    (b"] Finish: obj=", "finish", b"Finish: obj="),
    (b"transfer failed for request", "transfer_failed", (b"Prefill transfer failed", b"Decode transfer failed")),
    (b"bootstrap failed for request", "bootstrap_failed", b"Prefill bootstrap failed"),
    (b"KV checksum mismatch", "checksum_mismatch", b"KV checksum mismatch"),
    (b"KV checksum skipped", "checksum_skipped", b"KV checksum skipped"),
    (b"Context corruption detected", "corruption", b"Context corruption detected"),
    (b"Deferred KV release for room", "deferred_timeout", b"Deferred KV release for room"),
]

_RID_RE = re.compile(r"\brid=['\"]?([^'\",\s)]+)")
_ROOM_RE = re.compile(r"bootstrap_room=(\d+)")
_TOO_LONG_RE = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")
_TRUNC_RE = re.compile(r"len\(req\.origin_input_ids\)=(\d+), max_req_input_len=(\d+)")
_DCAP_RE = re.compile(r"Request (\S+) exceeds the maximum number of tokens: (\d+) > (\d+)")
_CTX_REJECT_RE = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_TS_LINE_RE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\] Req ?Time ?Stats\(rid=([^,\n]+), (?:bootstrap_room=(\w+), )?"
    r"input[ _]len=(\d+), [^\n]*?output[ _]len=(\d+)[^\n]*?type=(\w+)\)"
)
_FIN_ID_RE = re.compile(r"'id': '([^']+)'")
_FIN_REASON_RE = re.compile(r"'finish_reason': \{'type': '(\w+)'")
_FIN_PROMPT_RE = re.compile(r"'prompt_tokens': (\d+)")
_FIN_COMPLETION_RE = re.compile(r"'completion_tokens': (\d+)")
_STARTUP_RE = re.compile(r"max_total_num_tokens=(\d+).*?context_len=(\d+)")
_MISMATCH_REQ_RE = re.compile(r"req=['\"]?([^'\",\s]+)")


def _server_arg(text: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=('([^']*)'|\"([^\"]*)\"|[^,)]+)", text)
    if not m:
        return None
    return m.group(2) if m.group(2) is not None else (m.group(3) if m.group(3) is not None else m.group(1))


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One server start inside one log file, with what its startup lines said."""

    side: str
    start: str
    model: str | None = None
    checksum: bool | None = None  # None: no server_args line seen
    canary: str | None = None
    auto_truncate: bool | None = None
    pool_tokens: int | None = None
    context_len: int | None = None
    checksum_skipped_at: str | None = None
    counted: bool = True  # False when --model excludes it

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class DecodeOutcome:
    time: str = ""
    completed: bool = False
    output_len: int = 0
    failed: bool = False
    reason: str = ""
    run: Run | None = None
    mismatch: bool = False


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes_scanned": self.bytes_scanned,
            "lines_matched": self.lines_matched,
            "runs": [r.to_dict() for r in self.runs],
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


class _Scanner:
    def __init__(self, since: str | None, until: str | None, model: str | None, window: str) -> None:
        self.since = since.encode() if since else None
        self.until = until.encode() if until else None
        self.since_s = since
        self.until_s = until
        self.model = model
        self.window = window
        self.wlen = _WINDOW_LEN[window]
        self.windows: dict[str, Window] = {}
        self.runs: list[Run] = []
        self.bytes_scanned = 0
        self.lines_matched = 0
        # prefill side
        self.p_rid_room: dict[str, str] = {}
        self.p_stub_rids: set[str] = set()  # too-long rid later processed with input len 1
        self.too_long: list[RequestNote] = []
        # decode side
        self.d_rooms: dict[str, DecodeOutcome] = {}
        self.d_rid_room: dict[str, str] = {}
        self.d_rids: dict[str, DecodeOutcome] = {}  # outcomes with no room known
        self.notes: list[RequestNote] = []
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
        self.runs.append(run)
        with open(path, "rb") as f:
            tail = b""
            while True:
                block = f.read(CHUNK_BYTES)
                self.bytes_scanned += len(block)
                if not block:
                    if tail:
                        run = self.scan_chunk(tail + b"\n", side, run)
                    break
                buf = tail + block if tail else block
                cut = buf.rfind(b"\n")
                if cut < 0:
                    tail = buf
                    continue
                run = self.scan_chunk(buf[: cut + 1], side, run)
                tail = buf[cut + 1 :]

    def scan_chunk(self, chunk: bytes, side: str, run: Run) -> Run:
        events: list[tuple[int, str, int, int]] = []  # (line start, kind, line end, message start)
        for needle, kind, head in _RARE:
            pos = chunk.find(needle)
            while pos >= 0:
                ls = chunk.rfind(b"\n", 0, pos) + 1
                le = chunk.find(b"\n", pos)
                if le < 0:
                    le = len(chunk)
                m = _PREFIX_RE.match(chunk, ls)
                if m is not None and chunk.startswith(head, m.end()):
                    events.append((ls, kind, le, m.end()))
                pos = chunk.find(needle, le)
        events.sort()
        seg_start = 0
        for ls, kind, le, ms in events:
            if kind in ("server_args", "startup"):
                if run.counted:
                    self.scan_bulk(chunk, seg_start, ls, side, run)
                seg_start = ls
                run = self.start_run(run, side, kind, chunk[ls:le].decode("utf-8", "replace"), ms - ls)
                continue
            if not run.counted:
                continue
            line = chunk[ls:le].decode("utf-8", "replace")
            self.handle(kind, line, ms - ls, side, run)
        if run.counted:
            self.scan_bulk(chunk, seg_start, len(chunk), side, run)
        return run

    def scan_bulk(self, chunk: bytes, start: int, end: int, side: str, run: Run) -> None:
        """The frequent line kinds of one segment: batch lines (vectorised) and request time stats."""
        self.scan_batches(chunk, start, end)
        if chunk.find(b"Time Stats(", start, end) < 0 and chunk.find(b"ReqTimeStats(", start, end) < 0:
            return
        text = chunk[start:end].decode("utf-8", "replace")
        for ts, rid, room_s, in_len, out_len, typ in _TS_LINE_RE.findall(text):
            if not self.in_range(ts):
                continue
            self.lines_matched += 1
            room = room_s if room_s and room_s != "None" else None
            self._time_stats(rid, room, int(in_len), int(out_len), typ, ts, side, run)

    def scan_batches(self, chunk: bytes, start: int, end: int) -> None:
        """Aggregate Prefill/Decode batch lines of chunk[start:end] per window, vectorised with numpy."""
        import numpy as np

        rows = _BATCH_RE.findall(chunk, start, end)
        if not rows:
            return
        ts, p_seq, p_tok, p_use, _, _, d_use = (np.array(c) for c in zip(*rows, strict=True))
        keep = np.ones(len(ts), dtype=bool)
        if self.since is not None:
            keep &= ts >= self.since
        if self.until is not None:
            keep &= ts.astype(f"S{len(self.until)}") <= self.until
        self.lines_matched += int(keep.sum())
        is_p = p_seq != b""
        keys = ts.astype(f"S{self.wlen}")
        for sel, prefill in ((keep & is_p, True), (keep & ~is_p, False)):
            if not sel.any():
                continue
            uniq, inv = np.unique(keys[sel], return_inverse=True)
            counts = np.bincount(inv, minlength=len(uniq))
            usage = (p_use if prefill else d_use)[sel].astype(np.float64)
            max_use = np.zeros(len(uniq))
            np.maximum.at(max_use, inv, usage)
            if prefill:
                seqs = np.bincount(inv, weights=p_seq[sel].astype(np.int64), minlength=len(uniq))
                toks = np.bincount(inv, weights=p_tok[sel].astype(np.int64), minlength=len(uniq))
            for j, key in enumerate(uniq.tolist()):
                w = self.win(key.decode())
                if prefill:
                    w.prefill_batches += int(counts[j])
                    w.prefill_seqs += int(seqs[j])
                    w.prefill_tokens += int(toks[j])
                    w.prefill_max_usage = max(w.prefill_max_usage, float(max_use[j]))
                else:
                    w.decode_batches += int(counts[j])
                    w.decode_max_usage = max(w.decode_max_usage, float(max_use[j]))

    # -- runs ----------------------------------------------------------------------------------
    def start_run(self, run: Run, side: str, kind: str, line: str, ms: int) -> Run:
        ts = line[1:20]
        msg = line[ms:]
        if kind == "startup" and run.start and run.pool_tokens is None:
            new = run  # the startup line that follows this run's server_args line
        else:
            new = Run(side=side, start=ts)
            self.runs.append(new)
        if kind == "server_args":
            new.model = _server_arg(msg, "served_model_name") or _server_arg(msg, "model_path")
            if new.model in (None, "None"):
                new.model = _server_arg(msg, "model_path")
            cs = _server_arg(msg, "disaggregation_enable_kv_checksum")
            new.checksum = cs == "True" if cs is not None else False
            new.canary = _server_arg(msg, "kv_canary")
            tr = _server_arg(msg, "allow_auto_truncate")
            new.auto_truncate = tr == "True" if tr is not None else None
            model_path = _server_arg(msg, "model_path") or ""
            if self.model is None:
                new.counted = True
            else:
                needle = self.model.lower()
                new.counted = needle in (new.model or "").lower() or needle in model_path.lower()
        else:
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

    def handle(self, kind: str, line: str, ms: int, side: str, run: Run) -> None:
        ts = line[1:20]
        if not self.in_range(ts):
            return
        msg = line[ms:]
        self.lines_matched += 1
        w = self.win(ts)
        rid_m = _RID_RE.search(msg)
        rid = rid_m.group(1) if rid_m else None
        room_m = _ROOM_RE.search(msg)
        room = room_m.group(1) if room_m else None
        if kind == "too_long":
            if not self.once(kind + side, rid, None):
                return
            m = _TOO_LONG_RE.search(msg)
            n, cap = (m.group(1), m.group(2)) if m else ("?", "?")
            w.too_long += 1
            note = RequestNote(side, rid, room, ts, "too_long", f"input {n} tokens > allowed {cap}")
            if side == "prefill":
                self.too_long.append(note)
            else:
                note.status = "rejected on decode"
                self.notes.append(note)
                self._decode_outcome(rid, room, ts, run).failed = True
        elif kind == "truncated":
            m = _TRUNC_RE.search(msg)
            w.truncated += 1
            detail = f"input {m.group(1)} tokens truncated to {m.group(2)}" if m else "input truncated"
            self.notes.append(RequestNote(side, None, None, ts, "truncated", detail, "served truncated"))
        elif kind == "decode_capacity":
            m = _DCAP_RE.search(msg)
            rid = m.group(1) if m else rid
            if not self.once(kind, rid, None):
                return
            w.decode_capacity_rejects += 1
            detail = f"input {m.group(2)} tokens > decode capacity {m.group(3)}" if m else "over decode capacity"
            self.notes.append(RequestNote(side, rid, room, ts, "over_decode_pool", detail, "rejected on decode"))
            if side == "decode":
                self._decode_outcome(rid, room, ts, run).failed = True
        elif kind == "context_reject":
            m = _CTX_REJECT_RE.search(msg)
            w.context_rejects += 1
            detail = f"input {m.group(1)} tokens > context {m.group(2)}" if m else msg[:120]
            self.notes.append(RequestNote(side, rid, room, ts, "over_context", detail, "rejected (400)"))
        elif kind == "receive":
            if side == "prefill" and rid and room:
                self.p_rid_room[rid] = room
            elif side == "decode" and rid and room:
                self.d_rid_room[rid] = room
        elif kind == "finish":
            fid = _FIN_ID_RE.search(msg)
            rid = rid or (fid.group(1) if fid else None)
            reason = _FIN_REASON_RE.search(msg)
            reason_s = reason.group(1) if reason else "?"
            pt = _FIN_PROMPT_RE.search(msg)
            ct = _FIN_COMPLETION_RE.search(msg)
            if rid and rid.startswith("HEALTH_CHECK"):
                return
            if side == "prefill":
                if rid and room:
                    self.p_rid_room[rid] = room
                return
            out = self._decode_outcome(rid, room, ts, run)
            if reason_s == "abort":
                out.failed = True
                out.reason = out.reason or "finished with abort"
                return
            if not out.completed:
                w.decode_requests += 1
            out.completed = True
            if ct:
                out.output_len = int(ct.group(1))
            if pt and int(pt.group(1)) == 1 and ct and int(ct.group(1)) > 0:
                w.placeholder += 1
                self.notes.append(
                    RequestNote(
                        side,
                        rid,
                        room,
                        ts,
                        "placeholder_signature",
                        f"finished '{reason_s}' with prompt_tokens=1 and {ct.group(1)} completion tokens",
                        "served from a 1-token stub",
                    )
                )
        elif kind in ("transfer_failed", "bootstrap_failed"):
            if not self.once(kind + side, rid, room):
                return
            w.transfer_failures += 1
            why = msg.split(" with exception ", 1)[1][:160] if " with exception " in msg else ""
            self.notes.append(RequestNote(side, rid, room, ts, kind, why, "aborted"))
            if side == "decode":
                o = self._decode_outcome(rid, room, ts, run)
                o.failed, o.reason = True, kind
        elif kind == "checksum_mismatch":
            m = _MISMATCH_REQ_RE.search(msg)
            rid = m.group(1) if m else rid
            if not self.once(kind, rid, room):
                return
            w.checksum_mismatches += 1
            self.notes.append(RequestNote(side, rid, room, ts, "checksum_mismatch", msg[:200], "rejected (500)"))
            o = self._decode_outcome(rid, room, ts, run)
            o.failed, o.mismatch, o.reason = True, True, "checksum mismatch"
        elif kind == "checksum_skipped":
            if run.checksum_skipped_at is None:
                run.checksum_skipped_at = ts
        elif kind == "corruption":
            if not self.once(kind, rid, room):
                return
            w.corruption += 1
            self.notes.append(RequestNote(side, rid, room, ts, "context_corruption", msg[:200], "rejected"))
            o = self._decode_outcome(rid, room, ts, run)
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

    def _time_stats(
        self, rid: str, room: str | None, in_len: int, out_len: int, typ: str, ts: str, side: str, run: Run
    ) -> None:
        if typ == "prefill" or side == "prefill":
            if room:
                self.p_rid_room[rid] = room
            if in_len == 1:
                self.p_stub_rids.add(rid)
            if run.pool_tokens and in_len > run.pool_tokens:
                note = RequestNote(side, rid, room, ts, "over_pool_served", f"input {in_len} > pool {run.pool_tokens}")
                self.notes.append(note)
        else:
            out = self._decode_outcome(rid, room, ts, run)
            if out_len > 0 and not out.failed:
                if not out.completed:
                    self.win(ts).decode_requests += 1
                out.completed = True
                out.output_len = out_len

    def _decode_outcome(self, rid: str | None, room: str | None, ts: str, run: Run) -> DecodeOutcome:
        if room is None and rid is not None:
            room = self.d_rid_room.get(rid)
        if room is not None:
            out = self.d_rooms.get(room)
            if out is None:
                out = self.d_rooms[room] = DecodeOutcome(time=ts, run=run)
            if rid is not None:
                self.d_rid_room.setdefault(rid, room)
            return out
        key = rid or f"?{ts}"
        out = self.d_rids.get(key)
        if out is None:
            out = self.d_rids[key] = DecodeOutcome(time=ts, run=run)
        return out


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
    if run.checksum_skipped_at is not None and out.time >= run.checksum_skipped_at:
        return "skipped"
    if prefill_checksum is False:
        return "skipped"  # one side only: digest 0, skipped silently
    return "verified (inferred)"


def scan_logs(
    prefill_log: str,
    decode_log: str | None = None,
    since: str | None = None,
    until: str | None = None,
    model: str | None = None,
    window: str = "hour",
) -> LogReport:
    sc = _Scanner(since, until, model, window)
    sc.scan_file(prefill_log, "prefill")
    if decode_log:
        sc.scan_file(decode_log, "decode")
    runs = [r for r in sc.runs if r.start or r.model or r.pool_tokens]  # drop empty implicit runs
    p_runs = [r for r in runs if r.side == "prefill" and r.checksum is not None]
    prefill_checksum = p_runs[-1].checksum if p_runs else None
    findings: list[Finding] = []

    # Aborted on prefill, then handed to decode?
    candidates = 0
    unmatched = 0
    for note in sc.too_long:
        room = note.room or (sc.p_rid_room.get(note.rid) if note.rid else None)
        note.room = room
        out = sc.d_rooms.get(room) if room else None
        stub = note.rid in sc.p_stub_rids
        w = sc.win(note.time)
        if out is not None and out.completed and not out.failed:
            note.status = f"TRANSFERRED: decode finished it ({out.output_len} output tokens)"
            candidates += 1
            w.candidates += 1
        elif out is not None and out.failed:
            note.status = f"stopped on decode ({out.reason or 'failed'})"
        elif stub:
            note.status = "TRANSFERRED: prefill processed the 1-token stub (no decode record)"
            candidates += 1
            w.candidates += 1
        elif decode_log is None:
            note.status = "decode log not given"
            unmatched += 1
        elif room is None:
            note.status = "unmatched: no bootstrap_room for this rid in the prefill log"
            unmatched += 1
        else:
            note.status = "no decode record for this room"
            unmatched += 1
        sc.notes.append(note)

    # Checksum coverage per decode request
    coverage: dict[str, int] = {}
    unverified: list[str] = []
    all_out = list(sc.d_rooms.items()) + list(sc.d_rids.items())
    for key, out in all_out:
        if not (out.completed or out.mismatch):
            continue
        cov = _coverage_of(out, prefill_checksum)
        coverage[cov] = coverage.get(cov, 0) + 1
        w = sc.win(out.time)
        w.coverage[cov] = w.coverage.get(cov, 0) + 1
        if cov not in ("verified (inferred)", "mismatch") and len(unverified) < 1000:
            unverified.append(key)
    room_of_note = {}
    for n in sc.notes:
        if n.side == "decode" and n.room and n.room in sc.d_rooms:
            room_of_note[id(n)] = _coverage_of(sc.d_rooms[n.room], prefill_checksum)
            n.coverage = room_of_note[id(n)]

    def count(kind: str) -> int:
        return sum(1 for n in sc.notes if n.kind == kind)

    if candidates:
        findings.append(
            Finding(
                "aborted-but-transferred",
                Severity.CRITICAL,
                "requests",
                f"{candidates} request(s) were aborted on prefill as too long and still reached decode; their "
                "responses may contain another request's KV (windows: "
                + ", ".join(
                    sorted({_window_label(n.time[: sc.wlen], window) for n in sc.notes if "TRANSFERRED" in n.status})
                )
                + ")",
                "treat those responses as suspect; upgrade to SGLang >= 0.5.22 and keep context length <= pool",
            )
        )
    if unmatched:
        findings.append(
            Finding(
                "too-long-unmatched",
                Severity.WARNING,
                "requests",
                f"{unmatched} too-long abort(s) on prefill could not be followed to decode",
                "enable --enable-request-time-stats-logging or --log-requests on both sides to join by bootstrap_room",
            )
        )
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
        ("over_pool_served", "over-pool-served", Severity.CRITICAL,
         "prefill processed request(s) whose input exceeded its KV pool",
         "keep context length <= pool on both sides"),
        ("deferred_release_timeout", "deferred-release-timeout", Severity.WARNING,
         "decode released KV pages without prefill's drain acknowledgement",
         "raise SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT; check prefill health"),
        ("truncated", "auto-truncated", Severity.WARNING,
         "prompt(s) were silently truncated (--allow-auto-truncate)",
         "turn --allow-auto-truncate off on both sides"),
        ("transfer_failed", "transfer-failures", Severity.WARNING,
         "KV transfer failure line(s)", "check network/Mooncake health; bound batches with "
         "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"),
        ("bootstrap_failed", "transfer-failures", Severity.WARNING,
         "bootstrap failure line(s)", "check the bootstrap server and decode health"),
    ):  # fmt: skip
        n = count(kind)
        if n:
            findings.append(Finding(rule, sev, "requests", f"{n} {what}", fix))
    over_pool = count("too_long") + count("over_decode_pool") + count("over_context")
    if over_pool:
        findings.append(
            Finding(
                "over-pool-requests",
                Severity.INFO,
                "requests",
                f"{over_pool} request(s) had an input above the context or pool limit (listed per request)",
                "compare with the aborted-but-transferred rule; rejected requests alone are not a leak",
            )
        )
    n_skipped = coverage.get("skipped", 0)
    n_absent = coverage.get("absent", 0)
    if n_skipped:
        findings.append(
            Finding(
                "checksum-skipped",
                Severity.WARNING,
                "requests",
                f"{n_skipped} decoded request(s) were admitted with the KV checksum skipped (layout differs or "
                "checksum on one side only)",
                "make both sides' KV layouts identical and enable the checksum on both",
            )
        )
    if n_absent:
        findings.append(
            Finding(
                "checksum-absent",
                Severity.WARNING,
                "requests",
                f"{n_absent} decoded request(s) ran without a KV checksum",
                "start both sides with --disaggregation-enable-kv-checksum (SGLang >= 0.5.21)",
            )
        )
    files = {"prefill": prefill_log}
    if decode_log:
        files["decode"] = decode_log
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
    )


def render_report(r: LogReport, max_requests: int = 50) -> str:
    from kvfence.audit.findings import findings_table, summary_line

    out: list[str] = []
    gb = r.bytes_scanned / 1e9
    out.append(f"scanned {gb:.3f} GB, {r.lines_matched} matching lines; files: {r.files}")
    if r.runs:
        out.append("")
        rows = [
            (
                x.side,
                x.start or "?",
                x.model or "?",
                x.pool_tokens or "?",
                x.context_len or "?",
                {None: "?", True: "on", False: "off"}[x.checksum],
                x.checksum_skipped_at or "",
                "yes" if x.counted else "no (--model)",
            )
            for x in r.runs
        ]
        out.append(
            render_table(["SIDE", "STARTED", "MODEL", "POOL", "CONTEXT", "CHECKSUM", "SKIPPED AT", "COUNTED"], rows)
        )
    if r.windows:
        out.append("")
        rows = []
        for key, w in sorted(r.windows.items()):
            cov = ", ".join(f"{k}={v}" for k, v in sorted(w.coverage.items())) or "-"
            rows.append(
                (
                    _window_label(key, r.window_kind),
                    w.prefill_seqs,
                    w.decode_requests,
                    f"{max(w.prefill_max_usage, w.decode_max_usage):.2f}",
                    w.too_long + w.decode_capacity_rejects + w.context_rejects,
                    w.truncated,
                    w.transfer_failures,
                    w.checksum_mismatches + w.corruption,
                    w.candidates + w.placeholder,
                    cov,
                )
            )
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
    """Plain buffered line iteration: the baseline the benchmark compares against."""
    with open(path, "rb", buffering=1 << 20) as f:
        yield from f


def file_size(path: str) -> int:
    return os.path.getsize(path)
