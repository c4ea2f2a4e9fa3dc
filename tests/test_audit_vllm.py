"""`kvfence audit vllm` and `kvfence probe --kv-params`: the launch-command reader against vLLM 0.32's own
KVTransferConfig (read from the installed wheel's source, when there is one) and kvfence's own vLLM launch lines,
the rules, the exit codes and CI outputs, and the probe against a real HTTP server (kvfence's API).

The vLLM-process tests (vLLM's own argument parser, a live decode instance) are tests/test_audit_vllm_live.py.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kvfence.audit import exit_status as ex
from kvfence.audit import kv_params_probe as kp
from kvfence.audit import vllm as vl
from kvfence.audit import vllm_server as vsrv
from kvfence.cli import main
from kvfence.integrations.vllm.launch import VllmSpec, kvfence_transfer_config
from tests.helpers.api_fakes import FakeEngine, serve


def _wheel_source() -> Path | None:
    venv = Path(os.environ.get("KVFENCE_VLLM_VENV", "/work/venv-vllm"))
    for base in [*venv.glob("lib/python*/site-packages"), *map(Path, sys.path)]:
        p = base / "vllm" / "config" / "kv_transfer.py"
        if p.is_file():
            return p
    return None


WHEEL = _wheel_source()
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="vLLM is not installed here ($KVFENCE_VLLM_VENV)")


def _kv_transfer_class() -> ast.ClassDef:
    assert WHEEL is not None
    tree = ast.parse(WHEEL.read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVTransferConfig")


@needs_wheel
def test_field_list_is_vllms_own() -> None:
    cls = _kv_transfer_class()
    fields = tuple(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    assert fields == vsrv.KV_TRANSFER_FIELDS


@needs_wheel
def test_load_failure_policy_values_and_default_are_vllms_own() -> None:
    cls = _kv_transfer_class()
    node = next(
        n for n in cls.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "kv_load_failure_policy"
    )
    literal = node.annotation
    assert isinstance(literal, ast.Subscript)
    values = tuple(e.value for e in literal.slice.elts)  # type: ignore[attr-defined]
    assert values == vsrv.LOAD_FAILURE_POLICIES
    assert isinstance(node.value, ast.Constant) and node.value.value == vsrv.DEFAULT_LOAD_FAILURE_POLICY


@needs_wheel
def test_constant_defaults_are_vllms_own() -> None:
    cls = _kv_transfer_class()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and isinstance(n.value, ast.Constant):
            if n.target.id == "engine_id":  # None, then a fresh uuid in __post_init__
                continue
            assert vsrv.KV_DEFAULTS[n.target.id] == n.value.value, n.target.id


@needs_wheel
def test_roles_are_vllms_own() -> None:
    tree = ast.parse(WHEEL.read_text(encoding="utf-8"))  # type: ignore[union-attr]
    roles: set[str] = set()
    for n in tree.body:
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in ("KVProducer", "KVConsumer"):
            roles |= {e.value for e in n.value.slice.elts}  # type: ignore[attr-defined]
    assert roles == set(vsrv.KV_ROLES)


def _launch(role: str, **extra: object) -> str:
    """The command line kvfence's own launcher runs for a KvfenceConnector instance."""
    spec = VllmSpec(role, "/models/tiny", kvfence_transfer_config(role, dict(extra)), block_size=32, max_model_len=1024)
    return shlex.join(["python", "-m", "vllm.entrypoints.openai.api_server", *spec.args("127.0.0.1", 8000)])


def test_kvfences_own_launch_lines_are_read_back() -> None:
    snap = vsrv.from_launch("decode", _launch("decode", lease_s=5), "command line")
    assert snap is not None
    assert snap.kv_transfer == kvfence_transfer_config("decode", {"lease_s": 5})
    assert snap.args["max_model_len"] == 1024 and snap.args["block_size"] == 32
    assert snap.args["enable_prefix_caching"] is False and not snap.problems


def test_dotted_form_is_read_like_vllms_parser() -> None:
    line = ("vllm serve m --kv-transfer-config.kv_connector NixlConnector --kv-transfer-config.kv_role=kv_consumer "
            "--kv_transfer_config.kv_connector_extra_config.lease 10 "
            "--kv-transfer-config.kv_connector_extra_config.hosts+ a,b")  # fmt: skip
    snap = vsrv.from_launch("decode", line, "command line")
    assert snap is not None and snap.args["model"] == "m" and not snap.problems
    assert snap.kv_transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                "kv_connector_extra_config": {"lease": 10, "hosts": ["a", "b"]}}  # fmt: skip


def test_dotted_keys_replace_the_json_whole() -> None:
    """vLLM 0.32 does not merge the two forms (checked with its parser in tests/test_audit_vllm_live.py): the
    connector given in the JSON is lost, and the audit says so."""
    line = ("vllm serve m --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\"}' "
            "--kv-transfer-config.kv_load_failure_policy=fail")  # fmt: skip
    snap = vsrv.from_launch("decode", line, "command line")
    assert snap is not None and snap.kv_transfer == {"kv_load_failure_policy": "fail"}
    assert any("dropping kv_connector, kv_role" in p for p in snap.problems), snap.problems
    rules = {f.rule for f in vl.audit(None, snap)}
    assert {"launch-command-invalid", "kv-connector-missing"} <= rules


def test_unknown_field_and_bad_policy_are_launch_problems() -> None:
    snap = vsrv.from_launch(
        "decode",
        'vllm serve m --kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_consumer",'
        '"kv_load_failure_policy":"retry","kv_lease":3}\'',
        "command line",
    )
    assert snap is not None
    rules = {f.rule for f in vl.audit(None, snap)}
    assert "launch-command-invalid" in rules
    assert any("kv_lease" in p for p in snap.problems) and any("retry" in p for p in snap.problems)


NIXL_SCRIPT = """#!/bin/sh
# decode
export UCX_TLS=tcp
VLLM_NIXL_SIDE_CHANNEL_PORT=5600 vllm serve /models/llama \\
  --max-model-len 4096 --block-size 16 \\
  --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute"}' \\
  > decode.log 2>&1 &
"""


def test_script_findings_point_at_the_line(tmp_path: Path) -> None:
    path = tmp_path / "decode.sh"
    path.write_text(NIXL_SCRIPT)
    snap, _ = vsrv.load_snapshot("decode", str(path))
    assert snap.env["UCX_TLS"] == "tcp" and snap.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    found = {f.rule: f for f in vl.audit(None, snap)}
    assert found["kv-load-failure-policy-recompute"].line == 6
    assert found["kv-content-unverified"].severity == vl.Severity.WARNING


class Result(NamedTuple):
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    def run(*argv: str) -> Result:
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


KVF_P, KVF_D = _launch("prefill"), _launch("decode")
NIXL_P = 'vllm serve /m --kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\''
NIXL_D = ("vllm serve /m --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\","
          "\"kv_load_failure_policy\":\"fail\"}'")  # fmt: skip


def test_kvfence_pair_is_clean(cli) -> None:
    r = cli("audit", "vllm", "--prefill", KVF_P, "--decode", KVF_D, "--json")
    doc = json.loads(r.out)
    assert r.code == ex.CLEAN and doc["findings"] == [], doc
    assert doc["servers"]["decode"]["connector"] == "KvfenceConnector"


def test_nixl_pair_warns_that_decode_verifies_nothing(cli) -> None:
    r = cli("audit", "vllm", "--prefill", NIXL_P, "--decode", NIXL_D, "--json")
    assert r.code == ex.WARNINGS
    assert [f["rule"] for f in json.loads(r.out)["findings"]] == ["kv-content-unverified"]


def test_swapped_roles_and_one_sided_kvfence_are_critical(cli, tmp_path: Path) -> None:
    sarif, junit = tmp_path / "a.sarif", tmp_path / "a.xml"
    r = cli("audit", "vllm", "--prefill", NIXL_D, "--decode", KVF_D, "--sarif", str(sarif), "--junit", str(junit))
    assert r.code == ex.CRITICAL, r.out
    assert "kv-role-mismatch" in r.out and "kvfence-connector-one-side" in r.out
    levels = {x["ruleId"]: x["level"] for x in json.loads(sarif.read_text())["runs"][0]["results"]}
    assert levels["kv-role-mismatch"] == "error"
    assert 'name="kvfence-connector-one-side"' in junit.read_text()


def test_kvfence_with_recompute_is_critical(cli) -> None:
    d = KVF_D.replace('"kv_load_failure_policy":"fail"', '"kv_load_failure_policy":"recompute"')
    assert d != KVF_D
    r = cli("audit", "vllm", "--decode", d, "--json")
    assert r.code == ex.CRITICAL
    assert "kv-load-failure-policy-recompute" in {f["rule"] for f in json.loads(r.out)["findings"]}


def test_tool_errors_and_usage(cli, tmp_path: Path) -> None:
    r = cli("audit", "vllm", "--decode", str(tmp_path / "missing.sh"), "--sarif", str(tmp_path / "e.sarif"))
    assert r.code == ex.COULD_NOT_CHECK and len(r.err.strip().splitlines()) == 1
    assert json.loads((tmp_path / "e.sarif").read_text())["runs"][0]["invocations"][0]["executionSuccessful"] is False
    assert cli("audit", "vllm").code == ex.USAGE
    assert cli("audit", "vllm", "--decode", "echo hello world").code == ex.COULD_NOT_CHECK


def test_saved_server_info_is_read(tmp_path: Path) -> None:
    doc = {"vllm_config": {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                           "model_config": {"model": "/m", "max_model_len": 8192},
                           "cache_config": {"block_size": 16, "num_gpu_blocks": 100}}}  # fmt: skip
    path = tmp_path / "info.json"
    path.write_text(json.dumps(doc))
    snap, _ = vsrv.load_snapshot("decode", str(path))
    assert snap.pool_tokens == 1600
    assert "context-exceeds-pool" in {f.rule for f in vl.audit(None, snap)}


# -- the probe against a real HTTP server: kvfence's own API, which ignores kv_transfer_params -------------------


@pytest.fixture(scope="module")
def kvfence_api() -> Iterator[str]:
    server = serve(FakeEngine(context_length=1024))
    try:
        yield server.url
    finally:
        server.stop()


def test_probe_reports_a_server_that_answers_fabricated_params(cli, kvfence_api: str) -> None:
    r = cli("probe", kvfence_api, "--model", "fake-model", "--kv-params", "nixl", "--json")
    doc = json.loads(r.out)
    assert r.code == ex.WARNINGS, doc
    assert [c["verdict"] for c in doc["cases"]] == ["200, same tokens", "200, same tokens"]
    assert "reused reference" in doc["not_established"][0]


def test_probe_refuses_a_non_loopback_target(cli) -> None:
    r = cli("probe", "http://192.0.2.1:8000", "--model", "m", "--kv-params", "kvfence")
    assert r.code == ex.COULD_NOT_CHECK and "loopback" in r.err


def test_probe_verdicts() -> None:
    ref = [1, 2, 3]
    cases = [kp.CaseResult("a", 500, None, ref), kp.CaseResult("b", 200, [1, 2, 4], ref),
             kp.CaseResult("c", 200, [1, 2, 3], ref), kp.CaseResult("d", 200, None, ref)]  # fmt: skip
    found = {f.rule: f.severity for f in kp.judge(cases, "nixl")}
    assert found == {"kv-params-b": vl.Severity.CRITICAL, "kv-params-c": vl.Severity.WARNING}


def test_fabricated_kvfence_message_is_well_formed() -> None:
    """The probe's kvfence-shaped params parse as kvfence's own consume message (so a refusal is the connector's
    verdict on the reference, not on a malformed message)."""
    from kvfence.integrations.vllm.params import ConsumeParams

    ids = kp.prompt(1, 40)
    c = ConsumeParams.parse(kp.fabricated("kvfence", ids, "unknown"))
    assert c.tokens_expected == 40


def test_probe_table_output(cli, kvfence_api: str) -> None:
    r = cli("probe", kvfence_api, "--model", "fake-model", "--kv-params", "mooncake")
    assert r.code == ex.WARNINGS
    assert "unknown-remote-request" in r.out and "200, same tokens" in r.out and "exit code 1" in r.out


def test_prefill_without_kv_params_is_usage(cli, kvfence_api: str) -> None:
    r = cli("probe", kvfence_api, "--model", "fake-model", "--prefill", kvfence_api)
    assert r.code == ex.USAGE and "--kv-params" in r.err
