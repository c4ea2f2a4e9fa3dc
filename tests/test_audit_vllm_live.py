"""`kvfence audit vllm` and `kvfence probe --kv-params` against vLLM itself: its own argument parser reads the same
KV transfer config from the same launch lines, and a real prefill + decode pair with kvfence's connector (started
once for the module, in parallel) is audited live and probed with fabricated kv_transfer_params (vLLM #52234), which
it must refuse: every case fails closed, exit code 0.

Run in a venv with vLLM (`.ci/vllm.sh`): `python -m pytest -q -m vllm tests/test_audit_vllm_live.py`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed here (docs/vllm.md: its own venv, .ci/vllm.sh)")

from kvfence.audit import exit_status as ex  # noqa: E402
from kvfence.audit import vllm_server as vsrv  # noqa: E402
from kvfence.auth.keys import ENV_KEY, ClusterKey  # noqa: E402
from kvfence.cli import main  # noqa: E402
from kvfence.config import resolve_model_dir  # noqa: E402
from kvfence.integrations.vllm.launch import VllmServer, VllmSpec, kvfence_transfer_config, start_all  # noqa: E402

NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_load_failure_policy":"fail"}'
LINES = [
    shlex.join(
        VllmSpec("d", "/m", kvfence_transfer_config("decode", {"lease_s": 5}), block_size=32).args("127.0.0.1", 8000)
    ),
    f"--model /m --max-model-len 4096 --kv-transfer-config '{NIXL}' --enable-prefix-caching",
    "--model /m --kv-transfer-config.kv_connector MooncakeConnector --kv_transfer_config.kv_role=kv_consumer "
    "--kv-transfer-config.kv_connector_extra_config.hosts+ a,b --kv-transfer-config.kv_port 20001",
    f"--model /m --kv-transfer-config '{NIXL}' --kv-transfer-config.kv_load_failure_policy recompute",
]


def _vllm_parse(argv: list[str]) -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)  # `vllm serve`'s and the api_server's parser


@pytest.mark.parametrize("line", LINES, ids=["kvfence-launcher", "nixl-json", "dotted", "json-then-dotted"])
def test_vllms_own_parser_reads_the_same_config(line: str) -> None:
    argv = shlex.split(line)
    ours, kv, problems, _ = vsrv.parse_argv(argv)
    theirs = _vllm_parse(argv)
    assert kv is not None
    for key, value in kv.items():
        assert getattr(theirs.kv_transfer_config, key) == value, key
    unset = set(vsrv.KV_TRANSFER_FIELDS) - set(kv) - {"engine_id", "kv_buffer_device"}
    for key in unset:  # what we call absent is vLLM's default, not a value from the line
        assert getattr(theirs.kv_transfer_config, key) == vsrv.KV_DEFAULTS[key], key
    for key in ("max_model_len", "enable_prefix_caching", "block_size"):
        if key in ours:
            assert getattr(theirs, key) == ours[key], key
    assert bool(problems) == (line is LINES[3])


def test_json_without_role_is_refused_by_both() -> None:
    argv = ["--model", "/m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}']
    with pytest.raises(SystemExit):
        _vllm_parse(argv)
    _, kv, problems, _ = vsrv.parse_argv(argv)
    assert vsrv.config_problems(kv or {}) and not problems  # the config, not the line, is what vLLM refuses


# -- a live pair --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer, VllmServer]]:
    """(prefill, decode) with KvfenceConnector, and a plain instance with no connector, started in parallel."""
    model = resolve_model_dir(None)
    key = ClusterKey.generate()
    env = {ENV_KEY: key.to_hex(), "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: /server_info shows the config
    common: dict[str, Any] = {"block_size": 32, "max_model_len": 1024, "kv_cache_gib": 1, "env": env}
    specs = [VllmSpec("prefill", model, kvfence_transfer_config("prefill"), **common),
             VllmSpec("decode", model, kvfence_transfer_config("decode"), **common),
             VllmSpec("plain", model, None, block_size=32, max_model_len=1024, kv_cache_gib=1)]  # fmt: skip
    servers = start_all(specs, timeout_s=900, log_dir=tmp_path_factory.mktemp("vllm-audit-logs"))
    try:
        yield servers[0], servers[1], servers[2]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def pair(instances: tuple[VllmServer, VllmServer, VllmServer]) -> tuple[VllmServer, VllmServer]:
    return instances[0], instances[1]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_live_pair_audits_clean(pair: tuple[VllmServer, VllmServer], capsys: pytest.CaptureFixture[str]) -> None:
    prefill, decode = pair
    code, doc = _cli(capsys, "audit", "vllm", "--prefill", prefill.url, "--decode", decode.url, "--json")
    assert code == ex.CLEAN, doc
    d = doc["servers"]["decode"]
    assert d["connector"] == "KvfenceConnector" and d["kv_role"] == "kv_consumer" and d["max_model_len"] == 1024
    assert d["version"] and d["pool_tokens"] and d["pool_tokens"] >= 1024


@pytest.mark.parametrize("shape", ["kvfence", "nixl"])
def test_kvfence_decode_fails_closed_on_fabricated_params(
    pair: tuple[VllmServer, VllmServer], capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    prefill, decode = pair
    argv = ["probe", decode.url, "--model", decode.spec.model, "--kv-params", shape, "--json"]
    if shape == "kvfence":
        argv += ["--prefill", prefill.url]
    code, doc = _cli(capsys, *argv)
    assert code == ex.CLEAN, doc
    cases = {c["case"]: c for c in doc["cases"]}
    expected = {"unknown-remote-request", "out-of-range-block-ids"} | (
        {"reused-reference"} if shape == "kvfence" else set()
    )  # noqa: E501
    assert set(cases) == expected, doc
    assert all(c["verdict"] == "failed closed" and c["status"] != 200 for c in cases.values()), doc


def test_an_instance_without_connector_answers_fabricated_params(
    instances: tuple[VllmServer, VllmServer, VllmServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """A vLLM instance with no KV connector takes fabricated NIXL params and answers 200 with its own tokens: not
    failing closed is a warning; its live audit (no dev mode) cannot see the config, also a warning."""
    plain = instances[2]
    code, doc = _cli(capsys, "probe", plain.url, "--model", plain.spec.model, "--kv-params", "nixl", "--json")
    assert code == ex.WARNINGS, doc
    assert [c["verdict"] for c in doc["cases"]] == ["200, same tokens", "200, same tokens"], doc
    code, doc = _cli(capsys, "audit", "vllm", "--decode", plain.url, "--json")
    assert code == ex.WARNINGS and [f["rule"] for f in doc["findings"]] == ["kv-transfer-config-unknown"], doc
    assert doc["servers"]["decode"]["version"] and doc["servers"]["decode"]["block_size"] == 32
