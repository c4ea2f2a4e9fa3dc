"""What each rare SGLang log line means for the audit: one handler per line kind, in a dispatch table.

What it knows: for each kind of kvfence.audit.logs.formats that is not a batch, time-stats or start-up line, how
to read its fields (rid, bootstrap room, sizes, reasons) and what it changes: the window counters, the notable
requests (kvfence.audit.logs.notes, each with its log line), the decode outcome of a request (failed, finished,
mismatched), the run's canary and checksum state. `HANDLERS` maps a kind to its handler; every kind the scanner
can hand over has one (tests check this against FORMATS).
What it does not know: how lines are found (kvfence.audit.logs.scanner) or judged (.verdict, .rules).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvfence.audit.logs import formats as fm
from kvfence.audit.logs.notes import RequestNote
from kvfence.audit.logs.scanner import Event, PrefillAbort, Scanner, _str

Handler = Callable[[Scanner, Event], None]

REQUEST_LINE_KINDS = ("receive", "finish", "too_long", "kv_budget", "capacity", "context_reject")


def _ids(ev: Event) -> tuple[str | None, str | None]:
    rid_m = fm.RID_RE.search(ev.msg)
    room_m = fm.ROOM_RE.search(ev.msg)
    return (rid_m.group(1) if rid_m else None), (room_m.group(1) if room_m else None)


def _counted(sc: Scanner, ev: Event) -> None:
    sc.lines_matched += 1
    if ev.kind in REQUEST_LINE_KINDS:
        sc.side_request_lines[ev.side] += 1


def on_abort(sc: Scanner, ev: Event) -> None:
    """`Input length (N tokens) exceeds ...` / `Request prompt exceeds the KV memory budget`, `, self.rid='R'`."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    if not sc.once(ev.kind + ev.side, rid, None):
        return
    sc.count_request(ev.side, ev.run, rid, ev.ts)
    if ev.kind == "too_long":
        m = fm.TOO_LONG_RE.search(ev.msg)
        detail = f"input {m.group(1)} tokens > allowed {m.group(2)}" if m else "input above the allowed length"
    else:
        m = fm.BUDGET_RE.search(ev.msg)
        detail = f"input {m.group(1)} tokens above the KV memory budget" if m else "above the KV memory budget"
    sc.win(ev.ts).too_long += 1
    note = RequestNote(ev.side, rid, room, ev.ts, ev.kind, detail, version=ev.run.version, line=sc.line_of(ev))
    if ev.side == "prefill":
        if note.room is None and rid is not None:
            bound = sc.p_rid_room.get(rid.encode())
            note.room = bound.decode() if bound else None
        a = PrefillAbort(note)
        sc.aborts_by_order.append(a)
        if rid is not None:
            sc.aborts[rid.encode()] = a
        return
    note.status, note.evidence = "rejected on decode", f"decode {ev.kind} line"
    sc.book.add(note)
    sc.str_outcome(rid, room, ev.ts, ev.run).failed = True


def on_truncated(sc: Scanner, ev: Event) -> None:
    """`Request length is longer than the KV cache pool size or ...` / `... Truncating the input.`"""
    if ev.kind == "context_truncated" and "Truncating the input" not in ev.msg:
        return
    _counted(sc, ev)
    m = fm.TRUNC_RE.search(ev.msg) if ev.kind == "truncated" else fm.CTX_RE.search(ev.msg)
    sc.win(ev.ts).truncated += 1
    detail = f"input {m.group(1)} tokens truncated to {m.group(2)}" if m else "input truncated"
    sc.book.add(RequestNote(ev.side, None, None, ev.ts, "truncated", detail, "served truncated",
                            evidence=f"{ev.side} truncation line", line=sc.line_of(ev)))  # fmt: skip


def on_capacity(sc: Scanner, ev: Event) -> None:
    """`Request R exceeds the maximum number of tokens: N > CAP` (disaggregation prefill/decode capacity)."""
    if " exceeds the maximum number of tokens: " not in ev.msg:
        return
    _counted(sc, ev)
    rid, room = _ids(ev)
    m = fm.CAP_RE.search(ev.msg)
    rid = m.group(1) if m else rid
    if not sc.once(ev.kind + ev.side, rid, None):
        return
    sc.count_request(ev.side, ev.run, rid, ev.ts)
    sc.win(ev.ts).decode_capacity_rejects += 1
    detail = f"input {m.group(2)} tokens > {ev.side} capacity {m.group(3)}" if m else "over capacity"
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, "over_capacity", detail, f"rejected on {ev.side}",
                            evidence=f"{ev.side} capacity line", line=sc.line_of(ev)))  # fmt: skip
    if ev.side == "decode":
        out = sc.str_outcome(rid, room, ev.ts, ev.run)
        out.failed, out.reason = True, out.reason or "over decode capacity"


def on_context_reject(sc: Scanner, ev: Event) -> None:
    """`[http_server] Error: The input (N tokens) is longer than the model's context length (M tokens).`"""
    _counted(sc, ev)
    rid, room = _ids(ev)
    m = fm.CTX_RE.search(ev.msg)
    sc.win(ev.ts).context_rejects += 1
    detail = f"input {m.group(1)} tokens > context {m.group(2)}" if m else ev.msg[:120]
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, "over_context", detail, "rejected (400)",
                            evidence="http_server error line", line=sc.line_of(ev)))  # fmt: skip


def on_receive(sc: Scanner, ev: Event) -> None:
    """`Receive: obj=GenerateReqInput(..., rid='R', ..., bootstrap_room=B, ...)` (--log-requests, text)."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    sc.count_request(ev.side, ev.run, rid, ev.ts)
    sc.bind_room(ev.side, rid, room)


def on_finish(sc: Scanner, ev: Event) -> None:
    """`Finish: obj=..., out={..., 'meta_info': {'id': ..., 'finish_reason': ..., 'prompt_tokens': N, ...}}`."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    fid = fm.FIN_ID_RE.search(ev.msg)
    reason = fm.FIN_REASON_RE.search(ev.msg)
    pt, ct = fm.FIN_PROMPT_RE.search(ev.msg), fm.FIN_COMPLETION_RE.search(ev.msg)
    finished(
        sc, ev, rid or (fid.group(1) if fid else None), room, reason.group(1) if reason else "?",
        int(pt.group(1)) if pt else None, int(ct.group(1)) if ct else None, "Finish line",
    )  # fmt: skip


def on_json_request(sc: Scanner, ev: Event) -> None:
    """`{"timestamp": ..., "event": "request.received" | "request.finished", "rid": ..., "obj": ..., "out": ...}`."""
    try:
        doc = json.loads(ev.msg)
    except ValueError:
        return
    event = doc.get("event") if isinstance(doc, dict) else None
    if event not in ("request.received", "request.finished"):
        return
    sc.lines_matched += 1
    sc.side_request_lines[ev.side] += 1
    obj = doc.get("obj") if isinstance(doc.get("obj"), dict) else {}
    rid = _str(doc.get("rid") or obj.get("rid"))
    room = _str(obj.get("bootstrap_room"))
    if event == "request.received":
        sc.count_request(ev.side, ev.run, rid, ev.ts)
        sc.bind_room(ev.side, rid, room)
        return
    meta = ((doc.get("out") or {}) if isinstance(doc.get("out"), dict) else {}).get("meta_info") or {}
    reason = (meta.get("finish_reason") or {}).get("type", "?") if isinstance(meta, dict) else "?"
    pt, ct = _opt_int(meta.get("prompt_tokens")), _opt_int(meta.get("completion_tokens"))
    finished(sc, ev, rid or _str(meta.get("id")), room, str(reason), pt, ct, "JSON request.finished")


def finished(
    sc: Scanner, ev: Event, rid: str | None, room: str | None, reason: str, pt: int | None, ct: int | None, how: str
) -> None:
    """A request finished (a --log-requests Finish line or JSON event): on decode, its outcome."""
    if rid and rid.startswith("HEALTH_CHECK"):
        return
    sc.count_request(ev.side, ev.run, rid, ev.ts)
    if ev.side == "prefill":
        sc.bind_room(ev.side, rid, room)
        if rid:
            sc.p_rid_room.pop(rid.encode())
        return
    out = sc.str_outcome(rid, room, ev.ts, ev.run)
    if reason == "abort":
        out.failed = True
        out.reason = out.reason or "finished with abort"
        return
    if not out.completed and not out.failed:
        if ct is not None:
            out.output_len = ct
        key = (room or rid or "?").encode()
        sc.complete(out, sc.win(ev.ts), f"decode {how}", sc.line_of(ev), key)
    if pt == 1 and ct:
        sc.win(ev.ts).placeholder += 1
        sc.book.add(
            RequestNote(
                ev.side, rid, room, ev.ts, "placeholder_signature",
                f"finished '{reason}' with prompt_tokens=1 and {ct} completion tokens", "served from a 1-token stub",
                evidence=f"decode {how}", line=sc.line_of(ev),
            )
        )  # fmt: skip


def on_transfer_failure(sc: Scanner, ev: Event) -> None:
    """`Prefill transfer failed ...`, `Decode transfer failed ...`, bootstrap / handshake failures."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    if not sc.once(ev.kind + ev.side, rid, room):
        return
    sc.win(ev.ts).transfer_failures += 1
    why = ev.msg.split(" with exception ", 1)[1][:160] if " with exception " in ev.msg else ""
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, ev.kind, why, "aborted", evidence=f"{ev.side} {ev.kind} line",
                            line=sc.line_of(ev)))  # fmt: skip
    if ev.side == "decode":
        o = sc.str_outcome(rid, room, ev.ts, ev.run)
        o.failed, o.reason = True, ev.kind


def on_checksum_mismatch(sc: Scanner, ev: Event) -> None:
    """`KV checksum mismatch req=R bootstrap_room=B expected=0x.. got=0x..` (decode, 0.5.21+)."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    m = fm.MISMATCH_REQ_RE.search(ev.msg)
    rid = m.group(1) if m else rid
    if not sc.once(ev.kind, rid, room):
        return
    sc.win(ev.ts).checksum_mismatches += 1
    line = sc.line_of(ev)
    o = sc.str_outcome(rid, room, ev.ts, ev.run)
    o.failed, o.mismatch, o.reason = True, True, "checksum mismatch"
    sc.count_coverage(o, (room or rid or "?").encode())
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, "checksum_mismatch", ev.msg[:200], "rejected (500)",
                            coverage="mismatch", evidence="decode checksum line", line=line))  # fmt: skip


def on_checksum_skipped(sc: Scanner, ev: Event) -> None:
    """`KV checksum skipped: prefill layout signature ... differs ...` (decode, 0.5.23): unverified from here on."""
    _counted(sc, ev)
    if ev.run.checksum_skipped_at is None:
        ev.run.checksum_skipped_at = ev.ts
        ev.run.checksum_skipped_line = sc.line_of(ev)


def on_corruption(sc: Scanner, ev: Event) -> None:
    """`Context corruption detected: Request R ...` (decode's metadata room check)."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    if not sc.once(ev.kind, rid, room):
        return
    sc.win(ev.ts).corruption += 1
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, "context_corruption", ev.msg[:200], "rejected",
                            evidence="decode corruption line", line=sc.line_of(ev)))  # fmt: skip
    o = sc.str_outcome(rid, room, ev.ts, ev.run)
    o.failed, o.reason = True, "context corruption"


def on_deferred_timeout(sc: Scanner, ev: Event) -> None:
    """`Deferred KV release for room B timed out after ...; releasing anyway.` (decode)."""
    _counted(sc, ev)
    rid, room = _ids(ev)
    m = fm.DEFERRED_ROOM_RE.search(ev.msg)
    room = m.group(1) if m else room
    if not sc.once(ev.kind, room, None):
        return
    sc.win(ev.ts).deferred_timeouts += 1
    sc.book.add(RequestNote(ev.side, rid, room, ev.ts, "deferred_release_timeout", ev.msg[:200],
                            "pages released undrained", evidence="decode deferred-release line",
                            line=sc.line_of(ev)))  # fmt: skip


def on_canary_violation(sc: Scanner, ev: Event) -> None:
    """`kv_canary violation: launch_tag=... fail_reason=...` (its detail lines follow on lines of their own)."""
    _counted(sc, ev)
    sc.win(ev.ts).canary_violations += 1
    ev.run.canary_violations += 1
    ev.run.canary_seen = ev.run.canary_seen or "violation lines"
    m = fm.CANARY_TAG_RE.search(ev.msg)
    detail = f"launch_tag={m.group(1)} fail_reason={m.group(2)}" if m else ev.msg[:160]
    sc.book.add(RequestNote(ev.side, None, None, ev.ts, "kv_canary_violation", detail, "stale or foreign KV",
                            evidence="canary violation line", line=sc.line_of(ev)))  # fmt: skip


def on_canary_stats(sc: Scanner, ev: Event) -> None:
    """`[canary] step=N protected_tokens=N sweep_passes=N violations=N ...`: violations not logged one by one."""
    _counted(sc, ev)
    ev.run.canary_seen = "stats lines"
    m = fm.CANARY_STATS_RE.search(ev.msg)
    if m and int(m.group(1)) > ev.run.canary_violations:
        extra = int(m.group(1)) - ev.run.canary_violations
        ev.run.canary_violations += extra
        sc.win(ev.ts).canary_violations += extra
        sc.book.add_count("kv_canary_violation", extra, ev.side, sc.line_of(ev))


def on_canary_install(sc: Scanner, ev: Event) -> None:
    """`install_canary: disaggregation_mode=... config=...`: the canary ran in this server."""
    _counted(sc, ev)
    ev.run.canary_seen = ev.run.canary_seen or "install line"


def on_canary_overflow(sc: Scanner, ev: Event) -> None:
    """`kv-canary: per-forward verify skipped this step due to overflow ...`: a step ran unchecked."""
    _counted(sc, ev)
    sc.canary_overflow += 1
    sc.canary_overflow_sides.add(ev.side)
    if sc.canary_overflow_first is None:
        sc.canary_overflow_first = (ev.side, ev.ts, sc.line_of(ev))


def on_canary_perturb(sc: Scanner, ev: Event) -> None:
    """`kv_canary perturb ...`: the canary's test perturbation is on (violations may be injected)."""
    _counted(sc, ev)
    sc.canary_perturb += 1
    if sc.canary_perturb_first is None:
        sc.canary_perturb_first = (ev.side, ev.ts, sc.line_of(ev))


def on_pool_warning(sc: Scanner, ev: Event) -> None:
    """`KV pool holds N tokens, fewer than --context-length M. ...` (0.5.23 start-up)."""
    _counted(sc, ev)
    m = fm.POOL_WARN_RE.search(ev.msg)
    ev.run.pool_warning = True
    ev.run.pool_line = sc.line_of(ev)
    if m:
        ev.run.pool_tokens = ev.run.pool_tokens or int(m.group(1))
        ev.run.context_len = ev.run.context_len or int(m.group(2))


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


HANDLERS: dict[str, Handler] = {
    "too_long": on_abort,
    "kv_budget": on_abort,
    "truncated": on_truncated,
    "context_truncated": on_truncated,
    "capacity": on_capacity,
    "context_reject": on_context_reject,
    "receive": on_receive,
    "finish": on_finish,
    "json_request": on_json_request,
    "transfer_failed": on_transfer_failure,
    "bootstrap_failed": on_transfer_failure,
    "checksum_mismatch": on_checksum_mismatch,
    "checksum_skipped": on_checksum_skipped,
    "corruption": on_corruption,
    "deferred_timeout": on_deferred_timeout,
    "canary_violation": on_canary_violation,
    "canary_stats": on_canary_stats,
    "canary_install": on_canary_install,
    "canary_overflow": on_canary_overflow,
    "canary_perturb": on_canary_perturb,
    "pool_warning": on_pool_warning,
}
