"""The log scanner: one pass over a prefill log, then one over a decode log, with bounded state.

What it knows: how to walk a file window by window (kvfence.audit.logs.reader), pull every line it reads out of a
window with one regex `findall` (kvfence.audit.logs.formats), aggregate the frequent lines (`Prefill batch` /
`Decode batch`, `ReqTimeStats`) per time window without per-line Python work beyond a dict lookup, hand each
rarer line to its handler (a table it is given: kvfence.audit.logs.handlers.HANDLERS, one function per line
kind), and keep per-request state only while it can matter:
- a request is counted once per run however many lines it writes (ReqTimeStats, --log-requests Receive/Finish, a
  JSON pair), by its rid among the recently seen ones (kvfence.audit.logs.recent);
- prefill: rid -> bootstrap room while a request is open (from Receive lines), and a record for each request
  aborted on prefill (too long, KV budget), which waits for the decode log: these are the only per-request
  records kept to the end, one small record per abort;
- decode: the outcome of each recent request (by room, else rid), counted into the checksum coverage and the
  window once, when it completes; the outcomes of the rooms that prefill aborts wait for are kept to the end.
So memory grows with time windows, server runs and aborts, never with the number of requests or bytes.
What it does not know: the verdict on an abort (kvfence.audit.logs.verdict) or the findings (.rules).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Any, NamedTuple

from kvfence.audit.logs import formats as fm
from kvfence.audit.logs.notes import NoteBook, RequestNote
from kvfence.audit.logs.reader import LineCursor, open_log, windows
from kvfence.audit.logs.recent import Recent
from kvfence.audit.logs.run import Run
from kvfence.audit.logs.startup import infer_release, parse_server_args
from kvfence.audit.logs.window import Window

UNVERIFIED_SAMPLE = 1000
_VERIFIED = ("verified (inferred)", "mismatch")  # coverage labels not sampled as unverified
# Column getters for the rows of formats.FREQUENT_RE (map/compress over them runs without Python work per row).
_KEY, _RARE_HEAD, _RID = itemgetter(fm.KEY), itemgetter(fm.RARE_HEAD), itemgetter(fm.RID)
_NEW_SEQ, _NEW_TOKEN = itemgetter(fm.NEW_SEQ), itemgetter(fm.NEW_TOKEN)
_PREFILL_USAGE, _DECODE_USAGE = itemgetter(fm.PREFILL_USAGE), itemgetter(fm.DECODE_USAGE)


@dataclass(slots=True)
class DecodeOutcome:
    """What decode's lines say about one request, while it is recent (or awaited by a prefill abort)."""

    time: bytes  # when decode first logged it
    run: Run | None
    completed: bool = False
    output_len: int = 0
    failed: bool = False
    reason: str = ""
    mismatch: bool = False
    evidence: str = ""  # the line kind that showed it completed
    line: int | None = None  # that line
    coverage: str = ""  # the checksum coverage it was counted under


@dataclass(slots=True)
class PrefillAbort:
    """A request aborted on prefill (too long, KV budget): its note and what prefill logged about it later."""

    note: RequestNote
    input_len: int | None = None  # ReqTimeStats input_len (1 for the stub)
    transfer_mb: float | None = None  # ReqTimeStats transfer_total
    stats_line: int | None = None


class Event(NamedTuple):
    """One rare line handed to a handler."""

    kind: str
    ts: str
    msg: str
    raw: bytes  # the message as it appears in the file (head + rest), to find its line
    side: str
    run: Run


class Scanner:
    def __init__(
        self,
        since: str | None,
        until: str | None,
        model: str | None,
        window: str,
        version: str | None,
        handlers: Mapping[str, Callable[[Scanner, Event], None]],
    ) -> None:
        self.handlers = handlers  # kind -> handler of a rare line (kvfence.audit.logs.handlers.HANDLERS)
        self.since_s = since
        self.until_s = until
        self.model = model
        self.window = window
        self.version = version
        self.wlen = fm.WINDOW_LEN[window]
        self.frequent_re = fm.FREQUENT_RE[window]
        self.windows: dict[str, Window] = {}
        self.runs: list[Run] = []
        self.bytes_scanned = 0
        self.lines_matched = 0
        self.side_lines: dict[str, int] = {}
        self.side_request_lines: dict[str, int] = {}
        self.book = NoteBook()
        self.cursor = LineCursor()
        self._seen_rids: dict[str, Recent[bytes, bool]] = {}  # side -> rids counted recently
        self._once: Recent[tuple[str, str, str], bool] = Recent()  # per-rank repeats of one event
        # prefill
        self.p_rid_room: Recent[bytes, bytes] = Recent()  # open requests: rid -> room (Receive lines)
        self.aborts: dict[bytes, PrefillAbort] = {}  # rid -> an abort waiting for the decode log
        self.aborts_by_order: list[PrefillAbort] = []  # the same, rid-less ones included, in file order
        # decode
        self.prefill_checksum: bool | None = None  # the last prefill run's checksum setting, for coverage
        self.d_rid_room: Recent[bytes, bytes] = Recent()
        self.outcomes: Recent[bytes, DecodeOutcome | str] = Recent()  # str: completed, counted in bulk (coverage)
        self.awaited: dict[bytes, DecodeOutcome | None] = {}  # rooms prefill aborts wait for -> their outcome
        self.coverage: dict[str, int] = {}
        self.unverified: list[str] = []
        # canary lines that are counted, not listed
        self.canary_perturb = 0
        self.canary_perturb_first: tuple[str, str, int | None] | None = None  # (side, ts, line)
        self.canary_overflow = 0
        self.canary_overflow_sides: set[str] = set()
        self.canary_overflow_first: tuple[str, str, int | None] | None = None

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
        self._seen_rids.setdefault(side, Recent())
        if side == "decode":
            self.begin_decode()
        self.cursor = LineCursor()
        with open_log(path) as f:
            for buf, end in windows(f):
                self.bytes_scanned += end
                self.cursor.window(buf, end)
                run = self.scan_chunk(buf, end, side, run)
                self.cursor.finish()

    def begin_decode(self) -> None:
        """Before the decode log: which rooms the prefill aborts wait for, and prefill's checksum setting."""
        p_runs = [r for r in self.runs if r.side == "prefill" and r.checksum is not None]
        self.prefill_checksum = p_runs[-1].checksum if p_runs else None
        for a in self.aborts_by_order:
            if a.note.room:
                self.awaited.setdefault(a.note.room.encode(), None)

    def scan_chunk(self, buf: bytes | bytearray, end: int, side: str, run: Run) -> Run:
        """Lines buf[:end] (whole lines) of one side; returns the run in force at the end."""
        handlers = self.handlers
        rows = self.frequent_re.findall(buf, 0, end)
        if not rows:
            return run
        if self.since_s or self.until_s:
            rows = [r for r in rows if r[fm.RARE_HEAD] or self.in_range((r[fm.KEY] + r[fm.REST]).decode())]
        self.side_lines[side] += len(rows)
        prev = 0
        for i in compress(range(len(rows)), map(_RARE_HEAD, rows)):
            if run.counted and i > prev:
                self.scan_frequent(rows[prev:i], side, run)
            prev = i + 1
            row = rows[i]
            kind, ts = fm.KIND_OF[row[fm.RARE_HEAD]], (row[fm.KEY] + row[fm.REST]).decode()
            raw = row[fm.RARE_HEAD] + row[fm.RARE_REST]
            msg = raw.decode("utf-8", "replace")
            if kind in ("server_args", "startup"):
                run = self.start_run(run, side, kind, ts, msg, raw)
            elif run.counted and self.in_range(ts):
                handlers[kind](self, Event(kind, ts, msg, raw, side, run))
        if run.counted and prev < len(rows):
            self.scan_frequent(rows[prev:], side, run)
        return run

    def line_of(self, ev: Event) -> int | None:
        return self.cursor.locate(ev.raw)

    # -- frequent lines ------------------------------------------------------------------------
    def scan_frequent(self, rows: list[fm.Row], side: str, run: Run) -> None:
        """Batch lines (aggregated per window) and ReqTimeStats lines, in file order."""
        self.lines_matched += len(rows)
        i = 0
        # Usages are "0.NN" / "1.00" (SGLang formats them with two decimals): the largest string is the largest value.
        for key, grp in itertools.groupby(map(_KEY, rows)):
            n = len(list(grp))
            part = rows[i : i + n] if n < len(rows) else rows
            i += n
            w = self.win(key.decode())
            p = list(compress(part, map(_NEW_SEQ, part)))
            if p:
                w.prefill_batches += len(p)
                w.prefill_seqs += sum(map(int, map(_NEW_SEQ, p)))
                w.prefill_tokens += sum(map(int, map(_NEW_TOKEN, p)))
                w.prefill_max_usage = max(w.prefill_max_usage, float(max(map(_PREFILL_USAGE, p))))
            d = list(filter(None, map(_DECODE_USAGE, part)))
            if d:
                w.decode_batches += len(d)
                w.decode_max_usage = max(w.decode_max_usage, float(max(d)))
            stats = list(compress(part, map(_RID, part)))
            if stats:
                self.side_request_lines[side] += len(stats)
                self._time_stats_rows(w, stats, side, run)

    def _time_stats_rows(self, w: Window, rows: list[fm.Row], side: str, run: Run) -> None:
        """ReqTimeStats lines of one window (managers/schedule_batch.py log_time_stats), in file order.

        The common case is handled in bulk with set operations: a request's only ReqTimeStats line on its side,
        for a request no other line has mentioned; everything else takes the per-request path."""
        rids = list(map(_RID, rows))
        fresh = self._seen_rids[side].add_new(rids)
        if fresh:
            run.requests += fresh
            run.first_request = run.first_request or (rows[0][fm.KEY] + rows[0][fm.REST]).decode()
        run.last_request = (rows[-1][fm.KEY] + rows[-1][fm.REST]).decode()
        if side == "prefill":
            self._prefill_stats(rows, rids, run)
        else:
            self._decode_stats(w, rows, run)

    def _prefill_stats(self, rows: list[fm.Row], rids: list[bytes], run: Run) -> None:
        """Rows of requests aborted earlier (their fate on prefill) and of inputs above the pool, in file order."""
        pool, aborts = run.pool_tokens, self.aborts
        rid_i, in_i = fm.RID, fm.INPUT_LEN
        if aborts or pool:
            notable = [r for r in rows if r[rid_i] in aborts or (pool and int(r[in_i]) > pool)]
            for row in notable:
                rid, room, n = row[fm.RID], row[fm.ROOM], int(row[fm.INPUT_LEN])
                line = self.cursor.locate(b"ReqTimeStats(rid=" + rid + b",")
                a = aborts.get(rid)
                if a is not None:
                    if room and room != b"None" and not a.note.room:
                        a.note.room = room.decode()
                    a.input_len, a.stats_line = n, line
                    if row[fm.TRANSFER_MB]:
                        a.transfer_mb = float(row[fm.TRANSFER_MB])
                if pool and n > pool:
                    ts = (row[fm.KEY] + row[fm.REST]).decode()
                    self.book.add(
                        RequestNote("prefill", rid.decode(), room.decode() if room and room != b"None" else None, ts,
                                    "over_pool_served", f"input {n} > pool {pool}", evidence="prefill ReqTimeStats",
                                    line=line)
                    )  # fmt: skip
        if self.p_rid_room:
            for rid in rids:
                self.p_rid_room.pop(rid)  # the request is done on prefill

    def _decode_stats(self, w: Window, rows: list[fm.Row], run: Run) -> None:
        room_i, rid_i, out_i, key_i, rest_i = fm.ROOM, fm.RID, fm.OUTPUT_LEN, fm.KEY, fm.REST
        keys = [(r[room_i] if r[room_i] and r[room_i] != b"None" else b"rid:" + r[rid_i]) for r in rows]
        seen = self.outcomes.known(set(keys))
        awaited = self.awaited
        bulk: dict[bytes, str] = {}
        pc = self.prefill_checksum
        cov_all = None if run.checksum_skipped_at is not None else coverage_of_run(run, pc)
        for key, row in zip(keys, rows, strict=True):
            if key in seen or key in awaited or key in bulk or row[out_i] == b"0":
                self._decode_stats_slow(w, row, key, run)
                continue
            bulk[key] = cov_all or coverage_of_run(run, pc, row[key_i] + row[rest_i])
        if not bulk:
            return
        self.outcomes.put_many(bulk)
        w.decode_requests += len(bulk)
        counts = {cov_all: len(bulk)} if cov_all else Counter(bulk.values())
        for cov, n in counts.items():
            self.coverage[cov] = self.coverage.get(cov, 0) + n
            w.coverage[cov] = w.coverage.get(cov, 0) + n
        if len(self.unverified) < UNVERIFIED_SAMPLE and any(c not in _VERIFIED for c in counts):
            for key, cov in bulk.items():
                if cov not in _VERIFIED and len(self.unverified) < UNVERIFIED_SAMPLE:
                    self.unverified.append(key.decode("utf-8", "replace"))

    def _decode_stats_slow(self, w: Window, row: fm.Row, key: bytes, run: Run) -> None:
        rid, raw_room = row[fm.RID], row[fm.ROOM]
        room = raw_room if raw_room and raw_room != b"None" else None
        out = self.outcome(rid, room, row[fm.KEY] + row[fm.REST], run)
        if row[fm.OUTPUT_LEN] != b"0" and not out.failed and not out.completed:
            out.output_len = int(row[fm.OUTPUT_LEN])
            line = self.cursor.locate(b"ReqTimeStats(rid=" + rid + b",") if room in self.awaited else None
            self.complete(out, w, "decode ReqTimeStats", line, key)

    # -- runs ----------------------------------------------------------------------------------
    def start_run(self, run: Run, side: str, kind: str, ts: str, msg: str, raw: bytes) -> Run:
        self.lines_matched += 1
        ts = ts[:19]
        line = self.cursor.locate(raw)
        if kind == "startup" and run.start and not run.startup_seen:
            new = run  # the scheduler line that follows this run's server_args line
        else:
            new = Run(side=side, start=ts, version=self.version, line=line)
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
                told = infer_release(set(fields))
                new.version, new.version_source = told.version, told.source
            model_path = _str(fields.get("model_path")) or ""
            if self.model is None:
                new.counted = True
            else:
                needle = self.model.lower()
                new.counted = needle in (new.model or "").lower() or needle in model_path.lower()
        else:
            new.startup_seen = True
            m = fm.STARTUP_RE.search(msg)
            if m:
                new.pool_tokens, new.context_len = int(m.group(1)), int(m.group(2))
                if new.context_len > new.pool_tokens:
                    new.pool_line = new.pool_line or line
            if new is not run:
                new.counted = run.counted if self.model is not None else True
        return new

    # -- per-request state ---------------------------------------------------------------------
    def once(self, kind: str, a: str | None, b: str | None) -> bool:
        """True the first time this (kind, a, b) is seen recently: per-rank repeats of one event count once."""
        key = (kind, a or "", b or "")
        if key in self._once:
            return False
        self._once.put(key, True)
        return True

    def count_request(self, side: str, run: Run, rid: str | None, ts: str) -> None:
        """Count a request once per run, however many lines it writes."""
        if rid is None:
            run.saw_request(ts)
            return
        seen, key = self._seen_rids[side], rid.encode()
        if key in seen:
            run.last_request = ts
            return
        seen.put(key, True)
        run.saw_request(ts)

    def bind_room(self, side: str, rid: str | None, room: str | None) -> None:
        if not (rid and room):
            return
        if side == "prefill":
            a = self.aborts.get(rid.encode())
            if a is not None and not a.note.room:
                a.note.room = room
            self.p_rid_room.put(rid.encode(), room.encode())
        else:
            self.d_rid_room.put(rid.encode(), room.encode())

    def outcome(self, rid: bytes | None, room: bytes | None, ts: bytes, run: Run) -> DecodeOutcome:
        """The decode outcome of a request by room (else rid), created when first seen."""
        if room is None and rid is not None:
            room = self.d_rid_room.get(rid)
        if rid is not None and room is not None:
            self.d_rid_room.put(rid, room)
        if room is not None:
            awaited = self.awaited.get(room)
            if awaited is not None:
                return awaited
            key = room
        else:
            key = b"rid:" + rid if rid is not None else b"?" + ts
        held = self.outcomes.get(key)
        if isinstance(held, str):  # completed and counted in bulk under this coverage
            out = DecodeOutcome(time=ts, run=run, completed=True, coverage=held, evidence="decode ReqTimeStats")
            self.outcomes.put(key, out)
            return out
        if held is None:
            held = DecodeOutcome(time=ts, run=run)
            self.outcomes.put(key, held)
            if room is not None and room in self.awaited:
                self.awaited[room] = held
        return held

    def str_outcome(self, rid: str | None, room: str | None, ts: str, run: Run) -> DecodeOutcome:
        """outcome() for the rare-line handlers, which hold decoded strings."""
        return self.outcome(rid.encode() if rid else None, room.encode() if room else None, ts.encode(), run)

    def complete(self, out: DecodeOutcome, w: Window, evidence: str, line: int | None, key: bytes) -> None:
        """Decode finished this request: count it once in its window and in the checksum coverage."""
        out.completed = True
        out.evidence = out.evidence or evidence
        out.line = out.line or line
        w.decode_requests += 1
        self.count_coverage(out, key)

    def count_coverage(self, out: DecodeOutcome, key: bytes) -> None:
        cov = coverage_of(out, self.prefill_checksum)
        if out.coverage == cov:
            return
        w = self.win(out.time[: self.wlen].decode())
        if out.coverage:  # counted before (completed, then a mismatch line): move it
            self.coverage[out.coverage] -= 1
            w.coverage[out.coverage] -= 1
        out.coverage = cov
        self.coverage[cov] = self.coverage.get(cov, 0) + 1
        w.coverage[cov] = w.coverage.get(cov, 0) + 1
        if cov not in _VERIFIED and len(self.unverified) < UNVERIFIED_SAMPLE:
            self.unverified.append(key.decode("utf-8", "replace"))


def coverage_of(out: DecodeOutcome, prefill_checksum: bool | None) -> str:
    """How the KV checksum covered one decoded request ("verified" is inferred: SGLang logs no success)."""
    if out.mismatch:
        return "mismatch"
    return coverage_of_run(out.run, prefill_checksum, out.time)


def coverage_of_run(run: Run | None, prefill_checksum: bool | None, time: bytes = b"") -> str:
    """Coverage of a request decoded by this run that no mismatch line names, first logged at `time`."""
    if run is None or run.checksum is None:
        return "unknown"
    if not run.checksum:
        return "absent"
    if run.checksum_skipped_at is not None and time >= run.checksum_skipped_at.encode():
        return "skipped"
    if prefill_checksum is False:
        return "skipped"  # one side only: digest 0, skipped silently
    return "verified (inferred)"


def _str(v: Any) -> str | None:
    return None if v is None or v == "None" else str(v)


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None
