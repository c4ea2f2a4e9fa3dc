"""Rules of `kvfence audit sglang`, each on fixtures shaped like SGLang's real /server_info, /model_info
and launch command lines (tests/fixtures/sglang/)."""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from kvfence.audit import sglang as sg
from kvfence.audit.findings import Severity, exit_code
from kvfence.cli import main

FIX = Path(__file__).parent / "fixtures" / "sglang"


def _load(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _bundle(role: str, model: str = "llama", **overrides) -> dict:
    info = _load(f"server_info_{role}_0.5.23.json")
    info.update(overrides)
    return {"server_info": info, "model_info": _load(f"model_info_{model}.json")}


def _snap(role: str, model: str = "llama", env: dict | None = None, **overrides) -> sg.ServerSnapshot:
    b = _bundle(role, model, **overrides)
    if env is not None:
        b["env"] = env
    return sg.snapshot_from_bundle(role, f"{role}.json", b)


GOOD_ENV = {sg.ENV_MOONCAKE_BATCH: "1024", sg.ENV_DEFERRED_RELEASE: "1"}


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
    p = _snap("prefill", env=GOOD_ENV, version="0.5.21.post1")
    d = _snap("decode", env=GOOD_ENV, version="0.5.20")
    found = [f for f in sg.audit(p, d) if f.rule == "version-below-0.5.22"]
    sev = {f.role: f.severity for f in found}
    assert sev == {"prefill": Severity.WARNING, "decode": Severity.CRITICAL}


def test_context_above_pool_on_decode():
    p = _snap("prefill", env=GOOD_ENV)
    d = _snap("decode", env=GOOD_ENV, max_total_num_tokens=20000)
    found = [f for f in sg.audit(p, d) if f.rule == "context-exceeds-pool"]
    assert [(f.role, f.severity) for f in found] == [("decode", Severity.CRITICAL)]
    assert "32768" in found[0].message and "20000" in found[0].message


def test_pool_from_internal_states_and_context_from_v1_models():
    b = _bundle("prefill", context_length=None, max_total_num_tokens=None)
    b["server_info"]["internal_states"][0]["memory_usage"]["token_capacity"] = 16000
    b["v1_models"] = _load("v1_models_llama.json")
    s = sg.snapshot_from_bundle("prefill", "x", b)
    assert sg.context_length(s) == 32768
    assert sg.pool_tokens(s)[0] == 16000
    assert "context-exceeds-pool" in _rules(sg.audit(s, None))


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
    d = sg.snapshot_from_bundle(
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
    kinds = {m: sg.pool_kind(_snap("prefill", model=m))[0] for m in ["llama", "deepseek_v3", "glm5", "deepseek_v4"]}
    assert kinds == {"llama": "mha", "deepseek_v3": "mla", "glm5": "dsa", "deepseek_v4": "dsv4"}


def test_deferred_release_explicitly_off_on_decode():
    env = {**GOOD_ENV, sg.ENV_DEFERRED_RELEASE: "0"}
    found = [f for f in sg.audit(_snap("prefill", env=GOOD_ENV), _snap("decode", env=env)) if "deferred" in f.rule]
    assert [(f.rule, f.role, f.severity) for f in found] == [
        ("deferred-decode-release-off", "decode", Severity.CRITICAL)
    ]


def test_deferred_release_default_depends_on_version():
    env = {sg.ENV_MOONCAKE_BATCH: "1024"}  # no deferred-release variable: the version default decides
    old = _snap("decode", env=env, version="0.5.20")
    new = _snap("decode", env=env, version="0.5.21")
    assert "deferred-decode-release-off" in _rules(sg.audit(None, old))
    assert "deferred-decode-release-off" not in _rules(sg.audit(None, new))


def test_mooncake_unbounded_batches():
    env = {sg.ENV_MOONCAKE_BATCH: "0", sg.ENV_DEFERRED_RELEASE: "1"}
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
    s = sg.snapshot_from_bundle("prefill", "x", _bundle("decode"))  # decode server passed as prefill
    assert _rules(sg.audit(s, None)).get("role-mode-mismatch") == Severity.CRITICAL


def test_launch_command_parsing_env_prefix_and_flags():
    args, env = sg.parse_launch_command((FIX / "launch_prefill_0.5.19.sh").read_text())
    assert env["MC_TCP_BIND_ADDRESS"] == "10.0.0.11"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert args["model_path"] == "/models/DeepSeek-V3-0324"
    assert args["context_length"] == 131072 and args["max_total_tokens"] == 98304 and args["page_size"] == 64
    assert args["trust_remote_code"] is True and args["kv_canary"] == "log"
    assert args["disaggregation_mode"] == "prefill"


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
    rules = {f["rule"] for f in doc["findings"]}
    assert code == 2 and doc["exit_code"] == 2
    assert {"context-exceeds-pool", "deferred-decode-release-off", "version-below-0.5.22"} <= rules
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
    assert code == 2 and {"context-exceeds-pool", "mooncake-unbounded-batch"} <= rules


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
    assert code == 2
    assert [f["role"] for f in doc["findings"] if f["rule"] == "context-exceeds-pool"] == ["decode"]
    saved = json.loads((tmp_path / "b" / "decode.json").read_text())
    assert saved["server_info"]["max_total_num_tokens"] == 16384
    assert saved["model_info"]["architectures"] == ["LlamaForCausalLM"]
