"""`kvfence audit logs` on log fixtures written in SGLang's exact line formats (tests/fixtures/sglang/*.log)."""

from __future__ import annotations

import json
from pathlib import Path

from kvfence.audit import logs as lg
from kvfence.audit.findings import Severity
from kvfence.cli import main

FIX = Path(__file__).parent / "fixtures" / "sglang"
P19, D19 = str(FIX / "prefill_0.5.19_incident.log"), str(FIX / "decode_0.5.19_incident.log")
P23, D23 = str(FIX / "prefill_0.5.23_checksum.log"), str(FIX / "decode_0.5.23_checksum.log")


def _rules(report) -> dict[str, Severity]:
    return {f.rule: f.severity for f in report.findings}


def _note(report, rid):
    return next(n for n in report.requests if n.rid == rid)


def test_runs_read_from_startup_lines():
    r = lg.scan_logs(P19, D19)
    runs = {(x.side, x.pool_tokens, x.context_len, x.checksum) for x in r.runs}
    assert runs == {("prefill", 98304, 131072, False), ("decode", 262144, 131072, False)}


def test_aborted_on_prefill_but_decoded_is_a_candidate():
    r = lg.scan_logs(P19, D19)
    note = _note(r, "9b1e0f6c2d3a4b5c8e7f6a5b4c3d2e1f")
    assert note.room == "5820173649218374605"
    assert note.status.startswith("TRANSFERRED") and "187 output tokens" in note.status
    assert _rules(r)["aborted-but-transferred"] == Severity.CRITICAL


def test_too_long_stopped_on_decode_is_not_a_candidate():
    r = lg.scan_logs(P19, D19)
    note = _note(r, "e2d4c6b8a0f1e3d5c7b9a1f3e5d7c9b0")
    assert note.status.startswith("stopped on decode")
    assert sum("TRANSFERRED" in n.status for n in r.requests) == 1


def test_stub_on_prefill_without_decode_log_is_a_candidate():
    r = lg.scan_logs(P19)  # decode log missing: the 1-token stub processed by prefill still shows it
    statuses = {n.rid: n.status for n in r.requests if n.kind == "too_long"}
    assert statuses["9b1e0f6c2d3a4b5c8e7f6a5b4c3d2e1f"].startswith("TRANSFERRED: prefill processed the 1-token stub")
    assert statuses["73f5e7d9b1a3c5e7f9a1b3c5d7e9f1a3"] == "decode log not given"


def test_unmatched_too_long_is_a_warning():
    r = lg.scan_logs(P19, D19)
    assert _note(r, "73f5e7d9b1a3c5e7f9a1b3c5d7e9f1a3").status.startswith("unmatched")
    assert _rules(r)["too-long-unmatched"] == Severity.WARNING


def test_transfer_failures_deduplicated_across_ranks():
    r = lg.scan_logs(P19, D19)
    fails = [n for n in r.requests if n.kind == "transfer_failed"]
    # prefill logged the same request on TP0 and TP2, decode on TP0/TP1 for one room and TP0 for another
    assert sorted((n.side, n.room) for n in fails) == [
        ("decode", "2291835077712364081"),
        ("decode", "7094412358861920733"),
        ("prefill", "2291835077712364081"),
    ]


def test_batch_lines_aggregate_per_window():
    r = lg.scan_logs(P19, D19, window="hour")
    w10 = r.windows["2026-03-02 10"]
    assert (w10.prefill_batches, w10.prefill_seqs, w10.prefill_tokens) == (3, 4, 1024 + 4608 + 1)
    assert w10.decode_batches == 2 and abs(w10.decode_max_usage - 0.42) < 1e-9
    assert r.windows["2026-03-02 11"].prefill_seqs == 1


def test_checksum_coverage_absent_before_0_5_21():
    r = lg.scan_logs(P19, D19)
    assert r.coverage == {"absent": 4}
    assert _rules(r)["checksum-absent"] == Severity.WARNING


def test_checksum_verified_mismatch_and_skipped():
    r = lg.scan_logs(P23, D23, window="minute")
    assert r.coverage == {"verified (inferred)": 2, "mismatch": 1, "skipped": 2}
    assert r.windows["2026-03-05 09:31"].coverage == {"skipped": 2}
    rules = _rules(r)
    assert rules["checksum-mismatch"] == Severity.CRITICAL and rules["checksum-skipped"] == Severity.WARNING
    assert _note(r, "d-bad-3").kind == "checksum_mismatch"


def test_too_long_joined_through_finish_lines():
    r = lg.scan_logs(P23, D23)
    note = _note(r, "p-too-long-1")
    assert note.room == "700001" and note.status.startswith("stopped on decode")
    assert "aborted-but-transferred" not in _rules(r)


def test_since_until_filter():
    r = lg.scan_logs(P19, D19, since="2026-03-02 11:00", until="2026-03-02 11:59")
    assert not any(n.kind == "too_long" and n.time < "2026-03-02 11" for n in r.requests)
    assert set(r.windows) == {"2026-03-02 11"}
    assert "aborted-but-transferred" not in _rules(r)


def test_model_filter_skips_other_models():
    r = lg.scan_logs(P23, D23, model="deepseek")
    assert r.requests == [] and r.coverage == {}
    assert all(not x.counted for x in r.runs if x.start)
    kept = lg.scan_logs(P23, D23, model="Llama-3.1")
    assert kept.coverage


def test_placeholder_signature_in_finish_line(tmp_path):
    line = (
        "[2026-03-05 10:00:00] Finish: obj=GenerateReqInput(rid='d-stub', bootstrap_room=42), "
        "out={'text': 'x', 'meta_info': {'id': 'd-stub', 'finish_reason': {'type': 'length', 'length': 0}, "
        "'prompt_tokens': 1, 'completion_tokens': 12, 'cached_tokens': 0}}\n"
    )
    p, d = tmp_path / "p.log", tmp_path / "d.log"
    p.write_text("")
    d.write_text(line)
    r = lg.scan_logs(str(p), str(d))
    assert _rules(r)["placeholder-signature"] == Severity.CRITICAL


def test_marker_text_inside_a_prompt_is_ignored(tmp_path):
    # A user prompt that quotes an SGLang error must not count as that error.
    line = (
        "[2026-03-05 10:00:00] Receive: obj=GenerateReqInput(text='why does KV checksum mismatch req=x "
        "bootstrap_room=1 happen? also Prefill transfer failed for request rank=0', rid='u1', bootstrap_room=7)\n"
    )
    p = tmp_path / "p.log"
    p.write_text(line)
    r = lg.scan_logs(str(p))
    assert r.requests == [] and r.findings == []


def test_cli_json_and_exit_code(capsys):
    code = main(["audit", "logs", P19, D19, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["exit_code"] == 2
    assert any(f["rule"] == "aborted-but-transferred" for f in doc["findings"])
    assert "2026-03-02 10:00" in doc["windows"]


def test_cli_table(capsys):
    code = main(["audit", "logs", P23, D23, "--window", "minute"])
    out = capsys.readouterr().out
    assert code == 2 and "CHECKSUM COVERAGE" in out and "skipped=2" in out


def test_chunk_boundaries_do_not_lose_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(lg, "CHUNK_BYTES", 97)  # lines straddle many chunk boundaries
    r = lg.scan_logs(P19, D19)
    monkeypatch.setattr(lg, "CHUNK_BYTES", 32 << 20)
    ref = lg.scan_logs(P19, D19)
    assert r.coverage == ref.coverage
    assert [(n.kind, n.rid, n.status) for n in r.requests] == [(n.kind, n.rid, n.status) for n in ref.requests]
    assert {k: v.prefill_tokens for k, v in r.windows.items()} == {k: v.prefill_tokens for k, v in ref.windows.items()}


def test_benchmark_generator_writes_parseable_log(tmp_path):
    from kvfence.bench.logscan import write_log

    p, d = str(tmp_path / "p.log"), str(tmp_path / "d.log")
    write_log(p, "prefill", 300_000)
    write_log(d, "decode", 300_000)
    r = lg.scan_logs(p, d)
    assert r.lines_matched > 1000
    assert any(n.kind == "too_long" for n in r.requests)
    assert sum(w.prefill_batches for w in r.windows.values()) > 0
