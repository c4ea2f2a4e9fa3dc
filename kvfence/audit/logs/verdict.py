"""The verdict on one request aborted on prefill as too long: was its KV handed to decode anyway, and on what
evidence.

What it knows: the evidence in the order it is trusted: per-request lines first (decode finished the request's
room: its ReqTimeStats, Finish line or JSON event; decode stopped it: a failure line; prefill's ReqTimeStats show a
completed transfer, or that prefill processed the 1-token stub), then the release rule when no per-request line
decides (kvfence.audit.sglang_releases: 0.5.19 hands the stub to decode, 0.5.20 retires it after the forward,
0.5.21+ before bootstrap). Each verdict names the evidence it used.
What it does not know: whether decode served a stub that no line mentions; without a release, nothing decides.
"""

from __future__ import annotations

from typing import NamedTuple

from kvfence.audit import sglang_releases as rel
from kvfence.audit.logs.scanner import DecodeOutcome, PrefillAbort


class Verdict(NamedTuple):
    status: str  # starts with TRANSFERRED, POSSIBLE, HANDED OVER, stopped, not handed over, or an unknown
    evidence: str  # the lines (or the rule) it rests on
    line: int | None = None  # the decode line that shows it (for TRANSFERRED by decode), else None


TRANSFERRED, POSSIBLE, RELEASE_RULE = "TRANSFERRED", "POSSIBLE", "HANDED OVER"


def judge_abort(a: PrefillAbort, out: DecodeOutcome | None, have_decode: bool) -> Verdict:
    """Status of one request aborted on prefill; TRANSFERRED only with per-request evidence of the handoff."""
    note = a.note
    v = rel.parse_version(note.version)
    fate = rel.stub_fate(v)
    if out is not None and out.completed and not out.failed:
        return Verdict(
            f"{TRANSFERRED}: decode finished it ({out.output_len} output tokens, {out.evidence})",
            out.evidence,
            out.line,
        )
    if out is not None and out.failed:
        return Verdict(f"stopped on decode ({out.reason or 'failed'})", f"decode {out.reason or 'failure'} line")
    if a.transfer_mb:
        return Verdict(
            f"{TRANSFERRED}: prefill's ReqTimeStats show a completed transfer of {a.transfer_mb:.2f} MB",
            "prefill ReqTimeStats transfer_total",
        )
    reaches = rel.stub_reaches_decode(v)
    if reaches is False:
        return Verdict(f"not handed over: SGLang {note.version} {fate}", f"release rule (SGLang {note.version})")
    if reaches:
        if a.input_len == 1:
            return Verdict(
                f"{POSSIBLE}: SGLang {note.version} {fate}; prefill processed the stub, no decode record confirms it",
                f"prefill ReqTimeStats input_len=1 and the release rule (SGLang {note.version})",
            )
        return Verdict(
            f"{RELEASE_RULE} (release rule): SGLang {note.version} {fate}; no per-request line says whether decode "
            "served it",
            f"release rule (SGLang {note.version}); no ReqTimeStats or request log for it",
        )
    if not have_decode:
        return Verdict("decode log not given; release unknown", "none")
    if note.room is None:
        return Verdict("unmatched: no bootstrap_room for this rid in the prefill log; release unknown", "none")
    return Verdict("no decode record for this room; release unknown", "none")
