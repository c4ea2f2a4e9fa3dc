"""Rules of `kvfence audit sglang`, on /server_info bodies built from SGLang 0.5.23's own field list and
defaults, /model_info bodies, a /metrics scrape and launch command lines (tests/fixtures/sglang/, see README.md)."""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from kvfence.audit import sglang as sg
from kvfence.audit import sglang_server as srv
from kvfence.audit.findings import Severity, exit_code
from kvfence.audit.sglang_cli import parse_launch_command
from kvfence.cli import main

FIX = Path(__file__).parent / "fixtures" / "sglang"


def _load(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _bundle(role: str, model: str = "llama", **overrides) -> dict:
    info = _load(f"server_info_{role}_0.5.23.json")
    info.update(overrides)
    return {"server_info": info, "model_info": _load(f"model_info_{model}.json")}


def _snap(role: str, model: str = "llama", env: dict | None = None, **overrides) -> srv.ServerSnapshot:
    b = _bundle(role, model, **overrides)
    if env is not None:
        b["env"] = env
    return srv.snapshot_from_bundle(role, f"{role}.json", b)


GOOD_ENV = {srv.ENV_MOONCAKE_BATCH: "1024", srv.ENV_DEFERRED_RELEASE: "1"}


def _rules(findings) -> dict[str, Severity]:
    out: dict[str, Severity] = {}
    for f in findings:
        out[f.rule] = max(out.get(f.rule, Severity.INFO), f.severity)
    return out


def test_healthy_deployment_is_clean():
    p, d = _snap("prefill", env=GOOD_ENV), _snap("decode", env=GOOD_ENV)
    found = sg.audit(p, d)
    assert [f for f in found if f.severity > Severity.INFO] == []
    assert exit_code(found) == 0


def test_version_below_0_5_22():
    found = [
        f
        for f in sg.audit(_snap("prefill", env=GOOD_ENV, version="0.5.21.post1"), _snap("decode", version="0.5.19"))
        if f.rule == "version-below-0.5.22"
    ]
    assert {f.role: f.severity for f in found} == {"prefill": Severity.WARNING, "decode": Severity.CRITICAL}
    mid = [f for f in sg.audit(_snap("prefill", version="0.5.20"), None) if f.rule == "version-below-0.5.22"]
    assert mid[0].severity == Severity.WARNING and "retired before any KV is sent" in mid[0].message


def test_context_above_pool_severity_follows_the_release():
    p = _snap("prefill", env=GOOD_ENV)
    d = _snap("decode", env=GOOD_ENV, max_total_num_tokens=20000)
    found = [f for f in sg.audit(p, d) if f.rule == "context-exceeds-pool"]
    assert [(f.role, f.severity) for f in found] == [("decode", Severity.WARNING)]  # 0.5.23 refuses such prompts
    assert "32768" in found[0].message and "20000" in found[0].message
    old = _snap("decode", env=GOOD_ENV, max_total_num_tokens=20000, version="0.5.19")
    assert _rules(sg.audit(None, old))["context-exceeds-pool"] == Severity.CRITICAL


def test_pool_from_internal_states_and_context_from_v1_models():
    b = _bundle("prefill", context_length=None, max_total_num_tokens=None, launch_command=None)
    b["server_info"]["internal_states"][0]["memory_usage"]["token_capacity"] = 16000
    b["server_info"]["internal_states"][0]["context_length"] = None
    b["v1_models"] = _load("v1_models_llama.json")
    s = srv.snapshot_from_bundle("prefill", "x", b)
    assert srv.context_length(s) == (32768, "/v1/models max_model_len")
    assert srv.pool_tokens(s).value == 16000
    assert "context-exceeds-pool" in _rules(sg.audit(s, None))


def test_server_info_without_context_length_uses_max_req_input_len(capsys):
    # --context-length not given: context_length is None, but max_req_input_len = pool - 6 shows the pool binds
    path = str(FIX / "server_info_decode_0.5.23_no_context.json")
    code = main(["audit", "sglang", "--decode", path, "--env", f"{srv.ENV_MOONCAKE_BATCH}=64", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and [f["rule"] for f in doc["findings"] if f["severity"] != "info"] == ["pool-bounds-prompts"]
    assert doc["servers"]["decode"]["max_req_input_len"] == 19994


def test_context_from_metrics_scrape():
    b = _bundle("decode", context_length=None, max_total_num_tokens=None, max_req_input_len=None, launch_command=None)
    b["server_info"]["internal_states"] = []
    b["metrics"] = (FIX / "metrics_decode_0.5.23.txt").read_text()
    s = srv.snapshot_from_bundle("decode", "d.json", b)
    assert srv.context_length(s).value == 32768 and srv.pool_tokens(s).value == 20000
    rules = _rules(sg.audit(None, s))
    assert rules["context-exceeds-pool"] == Severity.WARNING
    assert rules["metrics-transfer-failures"] == rules["metrics-deferred-release-timeouts"] == Severity.WARNING


def test_environment_exposed_in_server_info():
    b = _bundle("decode")
    b["server_info"]["internal_states"][0]["env_vars"] = {srv.ENV_DEFERRED_RELEASE: "0", srv.ENV_MOONCAKE_BATCH: "64"}
    s = srv.snapshot_from_bundle("decode", "d.json", b)
    assert s.env_known and srv.mooncake_batch_limit(s).value == 64
    found = [f for f in sg.audit(None, s) if f.rule == "deferred-decode-release-off"]
    assert found and "internal_states[].env_vars" in found[0].message


@pytest.mark.parametrize(
    "key,p_val,d_val,rule",
    [
        ("context_length", 32768, 16384, "pd-context-length-mismatch"),
        ("page_size", 1, 64, "pd-page-size-mismatch"),
        ("kv_cache_dtype", "auto", "fp8_e4m3", "pd-kv-dtype-mismatch"),
        ("dtype", "bfloat16", "float16", "pd-dtype-mismatch"),
        ("model_path", "/models/Meta-Llama-3.1-8B-Instruct", "/models/Qwen2.5-7B-Instruct", "pd-model-mismatch"),
        ("disaggregation_decode_allocation_policy", "early", "prefill_complete", "pd-allocation-policy-mismatch"),
    ],
)
def test_prefill_decode_mismatch(key, p_val, d_val, rule):
    p = _snap("prefill", env=GOOD_ENV, **{key: p_val})
    d = _snap("decode", env=GOOD_ENV, **{key: d_val})
    rules = _rules(sg.audit(p, d))
    assert rules.get(rule) == Severity.CRITICAL
    same = _rules(
        sg.audit(_snap("prefill", env=GOOD_ENV, **{key: p_val}), _snap("decode", env=GOOD_ENV, **{key: p_val}))
    )
    assert rule not in same


def test_model_mismatch_from_model_info_architectures():
    p = _snap("prefill", env=GOOD_ENV)
    d = srv.snapshot_from_bundle(
        "decode", "d", {**_bundle("decode"), "model_info": _load("model_info_deepseek_v3.json"), "env": GOOD_ENV}
    )
    assert _rules(sg.audit(p, d)).get("pd-model-mismatch") == Severity.CRITICAL


def test_checksum_off_on_both_sides():
    p = _snap("prefill", env=GOOD_ENV, disaggregation_enable_kv_checksum=False)
    d = _snap("decode", env=GOOD_ENV, disaggregation_enable_kv_checksum=False)
    assert _rules(sg.audit(p, d)).get("kv-checksum-off") == Severity.WARNING


def test_checksum_on_one_side_only():
    p = _snap("prefill", env=GOOD_ENV, disaggregation_enable_kv_checksum=True)
    d = _snap("decode", env=GOOD_ENV, disaggregation_enable_kv_checksum=False)
    found = [f for f in sg.audit(p, d) if f.rule == "kv-checksum-one-side"]
    assert len(found) == 1 and found[0].severity == Severity.CRITICAL and "prefill" in found[0].message


def test_page_size_unknown_is_never_a_mismatch():
    p = _snap("prefill", env=GOOD_ENV, page_size=64)
    d = _snap("decode", env=GOOD_ENV, page_size=None)
    assert srv.page_size(d).value is None and srv.page_size(d).source.startswith("unknown")
    rules = _rules(sg.audit(p, d))
    assert "pd-page-size-mismatch" not in rules and "kv-checksum-skipped-layout" not in rules


def test_launch_scripts_without_page_size_say_unknown(capsys):
    main(["audit", "sglang", "--prefill", str(FIX / "launch_prefill_0.5.19.sh"), "--decode",
          str(FIX / "launch_decode_0.5.19.sh"), "--sglang-version", "0.5.19", "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["servers"]["prefill"]["page_size"] == 64 and doc["servers"]["decode"]["page_size"] is None
    assert "pd-page-size-mismatch" not in {f["rule"] for f in doc["findings"]}


def test_checksum_on_for_deepseek_v4_pool():
    p = _snap("prefill", model="deepseek_v4", env=GOOD_ENV, kv_canary="none")
    d = _snap("decode", model="deepseek_v4", env=GOOD_ENV, kv_canary="none")
    assert _rules(sg.audit(p, d)).get("kv-checksum-uncovered-layout") == Severity.CRITICAL


def test_checksum_skipped_when_layouts_differ():
    p = _snap("prefill", env=GOOD_ENV, tp_size=2)
    d = _snap("decode", env=GOOD_ENV, tp_size=4)
    assert _rules(sg.audit(p, d)).get("kv-checksum-skipped-layout") == Severity.WARNING


def test_checksum_unavailable_before_0_5_21():
    p = _snap("prefill", env=GOOD_ENV, version="0.5.20", disaggregation_enable_kv_checksum=False)
    d = _snap("decode", env=GOOD_ENV, version="0.5.20", disaggregation_enable_kv_checksum=False)
    rules = _rules(sg.audit(p, d))
    assert rules.get("kv-checksum-unavailable") == Severity.WARNING and "kv-checksum-off" not in rules


def test_no_checksum_advice_for_releases_without_it():
    p = _snap("prefill", model="deepseek_v3", env=GOOD_ENV, version="0.5.20", kv_canary="log",
              disaggregation_enable_kv_checksum=False)  # fmt: skip
    d = _snap("decode", model="deepseek_v3", env=GOOD_ENV, version="0.5.20", kv_canary="none",
              disaggregation_enable_kv_checksum=False)  # fmt: skip
    found = sg.audit(p, d)
    for f in found:
        assert "rely on the KV checksum" not in f.fix and "enable --disaggregation-enable-kv-checksum" not in f.fix
    canary = next(f for f in found if f.rule == "kv-canary-unsupported-pool")
    assert "0.5.20 has no KV checksum" in canary.fix


def test_kvfence_suggestions_are_not_called_sglang_defaults():
    env = {srv.ENV_DEFERRED_RELEASE: "1"}
    f = next(f for f in sg.audit(_snap("prefill", env=env), None) if f.rule == "mooncake-unbounded-batch")
    assert "kvfence's suggestion: 1024" in f.fix and "SGLang's default 0" in f.fix


def test_canary_off_on_mha():
    p = _snap("prefill", env=GOOD_ENV, kv_canary="none")
    found = [f for f in sg.audit(p, _snap("decode", env=GOOD_ENV)) if f.rule == "kv-canary-off"]
    assert [(f.role, f.severity) for f in found] == [("prefill", Severity.WARNING)]


@pytest.mark.parametrize("model", ["deepseek_v3", "glm5", "qwen3_next"])
def test_canary_set_for_unsupported_pool(model):
    p = _snap("prefill", model=model, env=GOOD_ENV, kv_canary="log")
    d = _snap("decode", model=model, env=GOOD_ENV, kv_canary="none")
    found = [f for f in sg.audit(p, d) if f.rule == "kv-canary-unsupported-pool"]
    assert [(f.role, f.severity) for f in found] == [("prefill", Severity.CRITICAL)]


def test_pool_kind_detection_from_model_info():
    kinds = {m: srv.pool_kind(_snap("prefill", model=m))[0] for m in ["llama", "deepseek_v3", "glm5", "deepseek_v4"]}
    assert kinds == {"llama": "mha", "deepseek_v3": "mla", "glm5": "dsa", "deepseek_v4": "dsv4"}


def test_deferred_release_explicitly_off_on_decode():
    env = {**GOOD_ENV, srv.ENV_DEFERRED_RELEASE: "0"}
    found = [f for f in sg.audit(_snap("prefill", env=GOOD_ENV), _snap("decode", env=env)) if "deferred" in f.rule]
    assert [(f.rule, f.role, f.severity) for f in found] == [
        ("deferred-decode-release-off", "decode", Severity.CRITICAL)
    ]


def test_deferred_release_default_depends_on_version():
    env = {srv.ENV_MOONCAKE_BATCH: "1024"}  # no deferred-release variable: the version default decides
    old = _snap("decode", env=env, version="0.5.20")
    new = _snap("decode", env=env, version="0.5.21")
    assert "deferred-decode-release-off" in _rules(sg.audit(None, old))
    assert "deferred-decode-release-off" not in _rules(sg.audit(None, new))


@pytest.mark.parametrize(
    "version,backend,supported",
    [("0.5.23", "fake", False), ("0.5.21", "mori", False), ("0.5.22", "mori", True), ("0.5.20", "mori", True),
     ("0.5.23", "mooncake_tcp", True), ("0.5.21", "ascend", True)],
)  # fmt: skip
def test_deferred_release_depends_on_backend_and_release(version, backend, supported):
    d = _snap("decode", env=GOOD_ENV, version=version, disaggregation_transfer_backend=backend)
    rules = _rules(sg.audit(None, d))
    assert ("deferred-decode-release-unsupported" in rules) is not supported
    if not supported:
        f = next(f for f in sg.audit(None, d) if f.rule == "deferred-decode-release-unsupported")
        assert "no setting enables it" in f.fix and "prefill has no deferred release" in f.message


def test_mooncake_unbounded_batches():
    env = {srv.ENV_MOONCAKE_BATCH: "0", srv.ENV_DEFERRED_RELEASE: "1"}
    found = [f for f in sg.audit(_snap("prefill", env=env), None) if f.rule == "mooncake-unbounded-batch"]
    assert len(found) == 1 and found[0].severity == Severity.WARNING
    nixl = _snap("prefill", env=env, disaggregation_transfer_backend="nixl")
    assert "mooncake-unbounded-batch" not in _rules(sg.audit(nixl, None))


def test_allow_auto_truncate():
    both = _rules(sg.audit(_snap("prefill", allow_auto_truncate=True), _snap("decode", allow_auto_truncate=True)))
    one = _rules(sg.audit(_snap("prefill"), _snap("decode", allow_auto_truncate=True)))
    assert both["allow-auto-truncate"] == Severity.WARNING
    assert one["allow-auto-truncate"] == Severity.CRITICAL


def test_role_mode_mismatch():
    s = srv.snapshot_from_bundle("prefill", "x", _bundle("decode"))  # decode server passed as prefill
    assert _rules(sg.audit(s, None)).get("role-mode-mismatch") == Severity.CRITICAL


def test_launch_command_parsing_env_prefix_and_flags():
    cmd = parse_launch_command((FIX / "launch_prefill_0.5.19.sh").read_text(), (0, 5, 19))
    assert cmd.env["MC_TCP_BIND_ADDRESS"] == "10.0.0.11" and cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    args = cmd.args
    assert args["model_path"] == "/models/DeepSeek-V3-0324" and args["page_size"] == 64
    assert args["context_length"] == 1048576 and args["max_total_tokens"] == 681280  # --context-length 1Mi
    assert args["trust_remote_code"] is True and args["kv_canary"] == "log"
    assert args["disaggregation_mode"] == "prefill" and cmd.problems == []
    decode = parse_launch_command((FIX / "launch_decode_0.5.19.sh").read_text(), (0, 5, 19))
    assert decode.args["tp_size"] == 4  # `--tp 4`: argparse's unique-prefix match of --tp-size


@pytest.mark.parametrize(
    "value,parsed",
    [("1Mi", 1048576), ("681280", 681280), ("128k", 128000), ("25.6k", 25600), ("1M", 1000000), ("2Gi", 2 << 30)],
)
def test_size_suffixes_as_sglang_reads_them(value, parsed):
    cmd = parse_launch_command(f"sglang serve /m --context-length {value} --max-prefill-tokens={value}", (0, 5, 23))
    assert cmd.args["context_length"] == parsed == cmd.args["max_prefill_tokens"] and cmd.problems == []


@pytest.mark.parametrize("value", ["1.5Mi", "1mi", "1KB", "1 Mi"])
def test_size_values_sglang_refuses_are_reported(value):
    cmd = parse_launch_command(f"python -m sglang.launch_server --model-path /m --context-length '{value}'")
    assert "context_length" not in cmd.args and cmd.problems and cmd.problems[0].startswith("--context-length")


def test_flags_sglang_would_refuse(capsys):
    cmd = "python -m sglang.launch_server --model-path /m --cuda-graph-bs 4 --no-such-flag 1 --page-size 1k"
    code = main(["audit", "sglang", "--prefill", cmd, "--sglang-version", "0.5.23", "--json"])
    doc = json.loads(capsys.readouterr().out)
    bad = next(f for f in doc["findings"] if f["rule"] == "launch-command-invalid")
    assert "ambiguous option --cuda-graph-bs" in bad["message"]
    assert "unrecognized argument --no-such-flag" in bad["message"]
    assert "--page-size: invalid literal" in bad["message"] and code >= 1
    assert doc["servers"]["prefill"]["page_size"] is None


def test_incident_launch_scripts_exit_2_via_cli(capsys):
    code = main(
        [
            "audit",
            "sglang",
            "--prefill",
            str(FIX / "launch_prefill_0.5.19.sh"),
            "--decode",
            str(FIX / "launch_decode_0.5.19.sh"),
            "--sglang-version",
            "0.5.19",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    sev = {f["rule"]: f["severity"] for f in doc["findings"] if f["role"] == "prefill"}
    assert code == 2 and doc["exit_code"] == 2
    assert sev["context-exceeds-pool"] == "critical"  # 1Mi (1,048,576) context over a 681,280-token pool on 0.5.19
    assert {"deferred-decode-release-off", "version-below-0.5.22"} <= {f["rule"] for f in doc["findings"]}
    assert doc["servers"]["decode"]["deferred_decode_release"]["value"] is False


def test_env_file_overrides_version_default(capsys):
    code = main(
        [
            "audit",
            "sglang",
            "--decode",
            str(FIX / "launch_decode_0.5.19.sh"),
            "--decode-env-file",
            str(FIX / "decode.env"),
            "--sglang-version",
            "0.5.19",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 2  # still 0.5.19
    assert doc["servers"]["decode"]["deferred_decode_release"]["value"] is True
    assert "deferred-decode-release-off" not in {f["rule"] for f in doc["findings"]}


def test_literal_command_with_env_flag(capsys):
    cmd = (
        "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=0 python -m sglang.launch_server --model-path /m/Llama "
        "--disaggregation-mode prefill --context-length 8192 --max-total-tokens 4096"
    )
    code = main(["audit", "sglang", "--prefill", cmd, "--sglang-version", "0.5.23", "--json"])
    doc = json.loads(capsys.readouterr().out)
    rules = {f["rule"] for f in doc["findings"]}
    assert code == 1 and {"context-exceeds-pool", "mooncake-unbounded-batch"} <= rules


def test_text_table_output(capsys):
    p = FIX / "server_info_prefill_0.5.23.json"
    d = FIX / "server_info_decode_0.5.23.json"
    code = main(
        [
            "audit",
            "sglang",
            "--prefill",
            str(p),
            "--decode",
            str(d),
            "--env",
            "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=1024",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "no findings" in out
    assert "ROLE" in out and "prefill" in out and "exit code 0" in out


def test_json_that_is_not_server_info_is_loud(tmp_path, capsys):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"status": "ok", "uptime": 5}))
    code = main(["audit", "sglang", "--prefill", str(p), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and [f["rule"] for f in doc["findings"]] == ["input-unrecognised"]


def test_sarif_and_junit_outputs(tmp_path, capsys):
    sarif, junit = tmp_path / "s.sarif", tmp_path / "j.xml"
    code = main(["audit", "sglang", "--prefill", str(FIX / "launch_prefill_0.5.19.sh"), "--sglang-version", "0.5.19",
                 "--sarif", str(sarif), "--junit", str(junit)])  # fmt: skip
    capsys.readouterr()
    run = json.loads(sarif.read_text())["runs"][0]
    res = next(r for r in run["results"] if r["ruleId"] == "context-exceeds-pool")
    assert code == 2 and res["level"] == "error"
    assert res["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith("launch_prefill_0.5.19.sh")
    from xml.etree import ElementTree as ET

    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) >= {r.id for r in sg.RULES}
    assert cases["context-exceeds-pool"].find("failure") is not None
    assert cases["pd-model-mismatch"].find("failure") is None


# ----------------------------------------------------------------------------------------------
# Live URLs: a fake SGLang server that only has the deprecated endpoints.
# ----------------------------------------------------------------------------------------------


def _serve(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, t


def test_live_urls_with_deprecated_endpoints(tmp_path, capsys):
    from fastapi import FastAPI

    def make(role: str, pool: int):
        app = FastAPI()
        info = copy.deepcopy(_load(f"server_info_{role}_0.5.23.json"))
        info["max_total_num_tokens"] = pool

        @app.get("/get_server_info")
        def get_server_info():
            return info

        @app.get("/get_model_info")
        def get_model_info():
            return _load("model_info_llama.json")

        return app

    (pu, ps, pt), (du, ds, dt) = _serve(make("prefill", 262144)), _serve(make("decode", 16384))
    try:
        code = main(
            ["audit", "sglang", "--prefill", pu, "--decode", du, "--json", "--save-bundle", str(tmp_path / "b")]
        )
    finally:
        ps.should_exit = ds.should_exit = True
        pt.join(5)
        dt.join(5)
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [f["role"] for f in doc["findings"] if f["rule"] == "context-exceeds-pool"] == ["decode"]
    saved = json.loads((tmp_path / "b" / "decode.json").read_text())
    assert saved["server_info"]["max_total_num_tokens"] == 16384
    assert saved["model_info"]["architectures"] == ["LlamaForCausalLM"]


def test_metrics_label_values_with_commas_equals_and_quotes():
    from kvfence.audit.metrics import parse_metrics

    text = (
        "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
        'sglang:num_transfer_failed_reqs_total{model_name="org/m,v=2",engine_type="decode",note="a \\"b\\", c=d"} 3\n'
        'sglang:max_total_num_tokens{model_name="org/m,v=2",engine_type="decode"} 20000\n'
    )
    m = parse_metrics(text, "scrape")
    assert m.label_values("model_name") == {"org/m,v=2"} and m.label_values("engine_type") == {"decode"}
    assert m.label_values("note") == {'a "b", c=d'}
    assert m.counter("sglang:num_transfer_failed_reqs_total", engine_type="decode") == 3
    assert m.gauge_min("sglang:max_total_num_tokens") == 20000


def test_a_broken_scrape_is_a_read_error():
    from kvfence.audit.metrics import parse_metrics
    from kvfence.errors import KvfenceError

    with pytest.raises(KvfenceError, match="not a Prometheus text scrape"):
        parse_metrics('sglang:x{model_name="unterminated} 1\n', "scrape")
