"""`kvfence audit logs` on logs built from SGLang's own log calls (tests/fixtures/sglang/, see its README.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from kvfence.audit import logs as lg
from kvfence.audit.findings import Severity
from kvfence.cli import main

FIX = Path(__file__).parent / "fixtures" / "sglang"
P19, D19 = str(FIX / "prefill_0.5.19_incident.log"), str(FIX / "decode_0.5.19_incident.log")
P19_DEFAULT = str(FIX / "prefill_0.5.19_default_logging.log")
D19_DEFAULT = str(FIX / "decode_0.5.19_default_logging.log")
P23_GLM, D23_GLM = str(FIX / "prefill_0.5.23_glm5.log"), str(FIX / "decode_0.5.23_glm5.log")
P21 = str(FIX / "prefill_0.5.21_fixed.log")
P23, D23 = str(FIX / "prefill_0.5.23_checksum.log"), str(FIX / "decode_0.5.23_checksum.log")
METRICS = str(FIX / "metrics_decode_0.5.23.txt")


def _rules(report) -> dict[str, Severity]:
    out: dict[str, Severity] = {}
    for f in report.findings:
        out[f.rule] = max(out.get(f.rule, Severity.INFO), f.severity)
    return out


def _note(report, rid):
    return next(n for n in report.requests if n.rid == rid)


def _line(text: str, ts: str = "2026-03-05 10:00:00") -> str:
    return f"[{ts}] {text}\n"


# --- defect 1: the start-up line is a dict repr ------------------------------------------------


def test_dict_server_args_line_gives_model_checksum_and_release():
    r = lg.scan_logs(P23, D23)
    runs = {(x.side, x.start): x for x in r.runs}
    first = runs[("prefill", "2026-03-05 08:00:01")]
    assert first.model == "meta-llama/Llama-3.1-8B-Instruct" and first.checksum is True and first.canary == "log"
    assert (first.version, first.version_source) == ("0.5.23", "server_args fields")
    assert runs[("decode", "2026-03-05 08:00:03")].log_requests_format == "json"


def test_model_filter_keeps_runs_named_in_the_dict_line(capsys):
    code = main(["audit", "logs", P23, D23, "--model", "Llama-3.1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["checksum_coverage"]["verified (inferred)"] == 2
    assert all(run["counted"] for run in doc["runs"])


def test_serverargs_repr_form_is_read_without_evaluating_it():
    fields = lg.parse_server_args(
        "server_args=ServerArgs(model_path='/m/x', disaggregation_enable_kv_checksum=True, page_size=64, "
        "stat_loggers=__import__('os').system('false'))"
    )
    assert fields["model_path"] == "/m/x" and fields["disaggregation_enable_kv_checksum"] is True
    assert fields["page_size"] == 64 and fields["stat_loggers"] == "__import__('os').system('false')"


def test_dict_with_an_object_repr_still_yields_every_key():
    fields = lg.parse_server_args(
        "server_args={'model_path': '/m/y', 'mode': <Mode.LOG: 'log'>, 'hook': <function f at 0x7f>, "
        "'nested': {'a': [1, '}']}, 'page_size': 16}"
    )
    assert fields == {
        "model_path": "/m/y", "mode": "<Mode.LOG: 'log'>", "hook": "<function f at 0x7f>", "nested": {"a": [1, "}"]},
        "page_size": 16,
    }  # fmt: skip


# --- defect 2: a leak candidate needs evidence of the handoff ----------------------------------


def test_rejected_prompt_on_a_fixed_release_is_not_a_candidate():
    r = lg.scan_logs(P21)  # 0.5.21 logs input_len=1 for the retired request
    note = _note(r, "fixed-rejected-1")
    assert note.status.startswith("not handed over: SGLang 0.5.21 retired before bootstrap")
    assert "aborted-but-transferred" not in _rules(r) and "possible-stub-handoff" not in _rules(r)


def test_decoded_abort_is_a_candidate():
    r = lg.scan_logs(P19, D19)
    note = _note(r, "9b1e0f6c2d3a4b5c")
    assert note.room == "5820173649218374605" and note.status.startswith("TRANSFERRED: decode finished it (187")
    assert _rules(r)["aborted-but-transferred"] == Severity.CRITICAL
    assert _note(r, "e2d4c6b8a0f1e3d5").status.startswith("stopped on decode")


def test_prefill_transfer_is_evidence_without_the_decode_log():
    r = lg.scan_logs(P19)
    assert _note(r, "9b1e0f6c2d3a4b5c").status == (
        "TRANSFERRED: prefill's ReqTimeStats show a completed transfer of 0.07 MB"
    )
    # the other stub moved no bytes: possible on 0.5.19, but not proof
    assert _note(r, "e2d4c6b8a0f1e3d5").status.startswith("POSSIBLE: SGLang 0.5.19 handed to decode")
    assert _rules(r)["possible-stub-handoff"] == Severity.WARNING


def test_unknown_release_without_evidence_is_not_critical(tmp_path):
    p = tmp_path / "p.log"
    p.write_text(
        _line("Input length (40000 tokens) exceeds the maximum allowed length (32762 tokens). Use a shorter input "
              "or enable --allow-auto-truncate., self.rid='r1'")
        + _line("ReqTimeStats(rid=r1, bootstrap_room=9, input_len=1, cached_input_len=0, output_len=0, attempts=0, "
                "type=prefill): bootstrap_queue_duration=0.00ms, queue_duration=0.00ms, forward_duration=0.00ms, "
                "entry_time=1.000, transfer_speed=0.00 GB/s, transfer_total=0.00 MB")
    )  # fmt: skip
    r = lg.scan_logs(str(p))
    assert r.requests[0].status == "decode log not given; release unknown" and r.requests[0].evidence == "none"
    assert max(f.severity for f in r.findings) == Severity.WARNING


# --- defect 6: signals that were ignored --------------------------------------------------------


def test_kv_budget_abort_and_pool_warning():
    r = lg.scan_logs(P23, D23)
    budget = _note(r, "p-budget-2")
    assert budget.kind == "kv_budget" and "25000" in budget.detail
    assert budget.status.startswith("not handed over: SGLang 0.5.23")
    small = next(x for x in r.runs if x.start == "2026-03-05 09:30:01")
    assert small.pool_warning and (small.pool_tokens, small.context_len) == (20000, 32768)
    assert _rules(r)["pool-below-context"] == Severity.WARNING


def test_pool_below_context_is_critical_on_0_5_19():
    r = lg.scan_logs(P19, D19)
    found = [f for f in r.findings if f.rule == "pool-below-context"]
    assert [(f.role, f.severity) for f in found] == [("prefill", Severity.CRITICAL)]


def test_canary_lines():
    r = lg.scan_logs(P23, D23)
    assert _rules(r)["kv-canary-violation"] == Severity.CRITICAL
    dec = next(x for x in r.runs if x.side == "decode")
    assert dec.canary_violations == 1 and dec.canary_seen == "stats lines"


def test_canary_overflow_and_perturbation(tmp_path):
    p = tmp_path / "p.log"
    p.write_text(
        _line("kv-canary: per-forward verify skipped this step due to overflow (total=9000, capacity=4096); check "
              "ServerArgs / pool sizing")
        + _line("kv_canary perturb req_to_token: req_pool_idx=3 position=7 original_slot=11 new_slot=12")
    )  # fmt: skip
    rules = _rules(lg.scan_logs(str(p)))
    assert rules["kv-canary-coverage-gap"] == Severity.WARNING and rules["kv-canary-perturbation"] == Severity.INFO


def test_json_request_log_gives_decode_outcomes():
    r = lg.scan_logs(P23, D23, window="minute")
    assert r.coverage == {"verified (inferred)": 2, "mismatch": 1, "skipped": 2}
    assert r.windows["2026-03-05 09:31"].coverage == {"skipped": 2}
    assert r.windows["2026-03-05 08:01"].decode_requests == 2


def test_metrics_scrape_adds_failure_counters(capsys):
    code = main(["audit", "logs", P21, "--decode-metrics", METRICS, "--json"])
    doc = json.loads(capsys.readouterr().out)
    rules = {f["rule"] for f in doc["findings"]}
    assert {"metrics-transfer-failures", "metrics-deferred-release-timeouts", "metrics-pool-below-context"} <= rules
    assert doc["metrics"]["decode"]["deferred_release"] == {"drained": 5, "timeout": 2, "error": None}
    assert code == 1


# --- defect 7: unrecognised input is loud -------------------------------------------------------


def test_unrecognised_file_is_a_finding_and_nonzero(tmp_path, capsys):
    p = tmp_path / "router.log"
    p.write_text("2026-03-05T10:00:00Z INFO request routed to prefill-0\n" * 20)
    code = main(["audit", "logs", str(p)])
    out = capsys.readouterr().out
    assert code == 1 and "log-unrecognised" in out and "no findings" not in out


def test_log_without_startup_or_request_lines(tmp_path):
    p = tmp_path / "p.log"
    p.write_text(_line("Prefill batch, #new-seq: 1, #new-token: 9, #cached-token: 0, token usage: 0.01, "
                       "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, "
                       "input throughput (token/s): 1.00"))  # fmt: skip
    rules = _rules(lg.scan_logs(str(p)))
    assert rules["no-startup-line"] == Severity.WARNING and rules["no-request-lines"] == Severity.WARNING
    assert "log-unrecognised" not in rules


def test_model_filter_that_matches_nothing_is_loud():
    r = lg.scan_logs(P23, D23, model="deepseek")
    assert r.requests == [] and r.coverage == {}
    assert _rules(r)["model-filter-matched-nothing"] == Severity.WARNING


# --- defect 8: wording -------------------------------------------------------------------------


def test_no_checksum_flag_advice_for_a_release_without_it():
    r = lg.scan_logs(P19, D19)
    absent = next(f for f in r.findings if f.rule == "checksum-absent")
    assert "0.5.19 has none" in absent.message and "--disaggregation-enable-kv-checksum" not in absent.fix


# --- report shapes -----------------------------------------------------------------------------


def test_checks_table_per_run():
    r = lg.scan_logs(P23, D23)
    dec = next(c for c in r.checks if c["side"] == "decode")
    assert dec["kv_checksum"] == "on, skipped from 2026-03-05 09:31:00"
    assert dec["request_log"] == "json" and dec["deferred_decode_release"] == "SGLang 0.5.23 default on"
    assert (dec["from"], dec["to"]) == ("2026-03-05 08:01:02", "2026-03-05 09:31:11")
    old = next(c for c in lg.scan_logs(P19, D19).checks if c["side"] == "prefill")
    assert old["kv_checksum"] == "n/a (SGLang 0.5.19 has none)" and old["pool_vs_context"] == "681280 < context 1048576"


def test_cli_table_json_sarif_and_junit(tmp_path, capsys):
    sarif, junit = tmp_path / "a.sarif", tmp_path / "a.xml"
    code = main(["audit", "logs", P19, D19, "--json", "--sarif", str(sarif), "--junit", str(junit)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["exit_code"] == 2 and "2026-03-02 10:00" in doc["windows"]
    s = json.loads(sarif.read_text())
    run = s["runs"][0]
    assert s["version"] == "2.1.0" and run["tool"]["driver"]["name"] == "kvfence audit logs"
    levels = {res["ruleId"]: res["level"] for res in run["results"]}
    assert levels["aborted-but-transferred"] == "error" and levels["checksum-absent"] == "warning"
    assert all(run["tool"]["driver"]["rules"][res["ruleIndex"]]["id"] == res["ruleId"] for res in run["results"])
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert cases["aborted-but-transferred"].find("failure").get("type") == "critical"
    assert cases["checksum-mismatch"].find("failure") is None
    assert int(suite.get("tests")) == len(cases) >= len(lg.RULES)
    assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in cases.values())
    code = main(["audit", "logs", P23, D23, "--window", "minute"])
    out = capsys.readouterr().out
    assert code == 2 and "CHECKSUM COVERAGE" in out and "skipped=2" in out and "KV CANARY" in out


# --- scanner mechanics -------------------------------------------------------------------------


def test_transfer_failures_deduplicated_across_ranks():
    r = lg.scan_logs(P19, D19)
    fails = [n for n in r.requests if n.kind == "transfer_failed"]
    assert sorted((n.side, n.room) for n in fails) == [
        ("decode", "2291835077712364081"),
        ("decode", "7094412358861920733"),
        ("prefill", "2291835077712364081"),
    ]


def test_batch_lines_aggregate_per_window():
    r = lg.scan_logs(P19, D19, window="hour")
    w10 = r.windows["2026-03-02 10"]
    assert (w10.prefill_batches, w10.prefill_seqs, w10.prefill_tokens) == (3, 4, 1024 + 4608 + 1)
    assert w10.decode_batches == 2 and abs(w10.decode_max_usage - 0.55) < 1e-9
    assert r.windows["2026-03-02 11"].prefill_seqs == 1


def test_since_until_filter():
    r = lg.scan_logs(P19, D19, since="2026-03-02 11:00", until="2026-03-02 11:59")
    assert not any(n.time < "2026-03-02 11" for n in r.requests)
    assert set(r.windows) == {"2026-03-02 11"} and r.windows["2026-03-02 11"].prefill_batches == 1
    assert "aborted-but-transferred" not in _rules(r)


def test_marker_text_inside_a_prompt_is_ignored(tmp_path):
    # A user prompt that quotes an SGLang error must not count as that error.
    line = _line(
        "Receive: obj=GenerateReqInput(text='why does KV checksum mismatch req=x bootstrap_room=1 happen? also "
        "[2026-01-01 00:00:00] Prefill transfer failed for request rank=0', rid='u1', bootstrap_room=7)"
    )
    p = tmp_path / "p.log"
    p.write_text(line)
    r = lg.scan_logs(str(p))
    assert r.requests == [] and {f.rule for f in r.findings} == {"no-startup-line"}


def test_chunk_boundaries_do_not_lose_lines(monkeypatch):
    from kvfence.audit.logs import reader

    ref = lg.scan_logs(P23, D23, window="minute")
    monkeypatch.setattr(reader, "CHUNK_BYTES", 97)  # lines straddle many window boundaries, some longer than one
    r = lg.scan_logs(P23, D23, window="minute")
    assert r.coverage == ref.coverage and len(r.runs) == len(ref.runs)
    assert [(n.kind, n.rid, n.status, n.line) for n in r.requests] == [
        (n.kind, n.rid, n.status, n.line) for n in ref.requests
    ]
    assert {k: v.prefill_tokens for k, v in r.windows.items()} == {k: v.prefill_tokens for k, v in ref.windows.items()}


def test_benchmark_generator_writes_parseable_log(tmp_path):
    from kvfence.bench.logscan import write_log

    p, d = str(tmp_path / "p.log"), str(tmp_path / "d.log")
    write_log(p, "prefill", 300_000)
    write_log(d, "decode", 300_000)
    r = lg.scan_logs(p, d)
    assert r.lines_matched > 1000
    assert any(n.kind == "too_long" for n in r.requests)
    assert sum(w.prefill_batches for w in r.windows.values()) > 0 and r.coverage.get("verified (inferred)", 0) > 100


# --- issue 24 -----------------------------------------------------------------------------------


def test_clean_0_5_23_glm5_pair_is_clean(capsys):
    code = main(["audit", "logs", P23_GLM, D23_GLM, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [f for f in doc["findings"] if f["severity"] != "info"] == [] and code == 0
    assert {(r["side"], r["version"], r["version_source"]) for r in doc["runs"]} == {
        ("prefill", "0.5.23", "server_args fields"), ("decode", "0.5.23", "server_args fields"),
    }  # fmt: skip
    (abort,) = [n for n in doc["requests"] if n["kind"] == "too_long"]
    assert abort["status"].startswith("not handed over: SGLang 0.5.23") and abort["evidence"].startswith("release")
    assert next(c for c in doc["checks"] if c["side"] == "decode")["deferred_decode_release"] == (
        "SGLang 0.5.23 default on"
    )


def test_log_requests_on_decode_count_each_request_once():
    # each decoded request writes Receive, ReqTimeStats and Finish on decode; prefill writes Receive, stats, Finish
    r = lg.scan_logs(P23_GLM, D23_GLM)
    decode = next(c for c in r.checks if c["side"] == "decode")
    prefill = next(c for c in r.checks if c["side"] == "prefill")
    assert decode["requests"] == 3 and prefill["requests"] == 4  # three served, one rejected
    assert sum(w.decode_requests for w in r.windows.values()) == 3 and r.coverage == {"verified (inferred)": 3}


def test_default_logging_abort_on_0_5_19_follows_the_release_rule():
    r = lg.scan_logs(P19_DEFAULT, D19_DEFAULT)
    note = _note(r, "dflt-long-1")
    assert note.status.startswith("HANDED OVER (release rule): SGLang 0.5.19 handed to decode as a 1-token stub")
    assert note.evidence.startswith("release rule (SGLang 0.5.19)")
    rules = _rules(r)
    assert "too-long-unmatched" not in rules and rules["possible-stub-handoff"] == Severity.WARNING
    assert rules["pool-below-context"] == Severity.CRITICAL
    handoff = next(f for f in r.findings if f.rule == "possible-stub-handoff")
    assert "release rule alone" in handoff.message


def test_every_verdict_names_its_evidence():
    for p, d in ((P19, D19), (P19_DEFAULT, D19_DEFAULT), (P23, D23), (P23_GLM, D23_GLM)):
        for n in lg.scan_logs(p, d).requests:
            assert n.evidence, (p, n)


def test_foreign_fields_leave_the_release_unknown(tmp_path):
    from kvfence.audit import sglang_flags

    fields = {n: None for n, (a, b) in sglang_flags.FIELDS.items() if a <= 4 <= b}
    assert lg.infer_release(set(fields)) == ("0.5.23", "server_args fields")
    fields["enable_something_new"] = False  # a field no release 0.5.19 .. 0.5.23 has
    p = tmp_path / "p.log"
    p.write_text(_line("server_args=" + repr(fields), "2026-05-01 00:00:00"))
    r = lg.scan_logs(str(p))
    assert r.runs[0].version is None and "enable_something_new" in r.runs[0].version_source
    assert _rules(r)["release-unknown"] == Severity.INFO


def test_a_field_dropped_by_a_patch_still_names_the_release():
    from kvfence.audit import sglang_flags

    d = {n for n, (a, b) in sglang_flags.FIELDS.items() if a <= 3 <= b}  # 0.5.22
    only_22 = sorted(n for n, (a, b) in sglang_flags.FIELDS.items() if a <= 3 <= b and b == 3)
    assert lg.infer_version(d - set(only_22[:1])) == "0.5.22"
    assert lg.infer_version(set(list(d)[:40])) is None  # an incomplete line says nothing


def test_every_rare_line_kind_has_a_handler():
    from kvfence.audit.logs.formats import FREQUENT_KINDS
    from kvfence.audit.logs.handlers import HANDLERS

    rare = {f.kind for f in lg.FORMATS if f.head and f.kind not in FREQUENT_KINDS} - {"server_args", "startup"}
    assert rare == set(HANDLERS)


def test_gzip_log_reads_like_the_plain_one(tmp_path):
    import gzip

    gz = tmp_path / "prefill.log.gz"
    gz.write_bytes(gzip.compress(Path(P19).read_bytes()))
    a, b = lg.scan_logs(P19, D19), lg.scan_logs(str(gz), D19)
    assert [(n.kind, n.status, n.line) for n in a.requests] == [(n.kind, n.status, n.line) for n in b.requests]
    assert {f.rule for f in a.findings} == {f.rule for f in b.findings}


def test_listing_is_bounded_but_counts_are_exact(tmp_path, monkeypatch):
    from kvfence.audit.logs import notes

    monkeypatch.setattr(notes, "LISTED_PER_KIND", 3)
    p = tmp_path / "p.log"
    p.write_text("".join(
        _line(f"Prefill transfer failed for request rank=0 req.rid='r{i}' req.bootstrap_room={i} with exception "
              f"KVTransferError(bootstrap_room={i}): dead", f"2026-03-05 10:00:{i:02d}")
        for i in range(20)
    ))  # fmt: skip
    r = lg.scan_logs(str(p))
    assert len(r.requests) == 3 and r.requests_not_listed == {"transfer_failed": 17}
    assert next(f for f in r.findings if f.rule == "transfer-failures").message.startswith("20 ")


@pytest.mark.slow
def test_memory_stays_bounded_as_the_log_grows(tmp_path):
    """Peak RSS of a scan in a process of its own, on a 50 MB and a 500 MB log pair: the growth is under a fixed
    bound (per-request state is bounded; the file is read in windows), not proportional to the size."""
    from kvfence.bench.logscan import _SCAN, child_usage, write_log

    rss = {}
    for mb in (50, 500):
        p, d = str(tmp_path / f"p{mb}.log"), str(tmp_path / f"d{mb}.log")
        write_log(p, "prefill", mb * 500_000)
        write_log(d, "decode", mb * 500_000)
        _, _, rss[mb], out = child_usage([sys.executable, "-c", _SCAN, p, d])
        assert json.loads(out)["decoded"] > mb * 300  # the scan did its work
        os.remove(p)
        os.remove(d)
    assert rss[500] - rss[50] < 64 << 20, {k: v >> 20 for k, v in rss.items()}
