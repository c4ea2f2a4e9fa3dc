"""Our SGLang knowledge against SGLang's own source: the PyPI wheels of 0.5.19 .. 0.5.23.

The wheel-reading tests skip, saying why, when the wheels are not cached ($KVFENCE_SGLANG_WHEELS or
~/.cache/kvfence/sglang-wheels; fill it with `pip download --no-deps sglang==0.5.X -d DIR`, 26-39 MB each).
The slow test downloads 0.5.23 into a temp dir itself when it is not cached. Nothing of SGLang is imported:
files are read from the zip, and the one function compared (human_readable_int) is compiled on its own.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.audit import logs as lg
from kvfence.audit import metrics as mt
from kvfence.audit import sglang as sg
from kvfence.audit import sglang_flags
from kvfence.audit import sglang_releases as rel
from kvfence.audit import sglang_server as srv
from kvfence.audit.sglang_cli import human_readable_int
from tests import sglang_wheels as wh

FIX = Path(__file__).parent / "fixtures" / "sglang"
HAVE = wh.available_versions()
needs_wheels = pytest.mark.skipif(
    not HAVE, reason=f"no SGLang wheels cached under {wh.wheel_dir()} (pip download --no-deps sglang==0.5.23 -d DIR)"
)
needs_all = pytest.mark.skipif(
    len(HAVE) < len(wh.VERSIONS), reason=f"needs all of {wh.VERSIONS} under {wh.wheel_dir()}, have {HAVE}"
)


def _in_range(fmt: lg.LineFormat, version: str) -> bool:
    if fmt.releases is None:
        return False
    first, last = (rel.parse_version(x) for x in fmt.releases)
    return first <= rel.parse_version(version) <= last


@needs_all
def test_flag_table_matches_the_wheels():
    assert wh.FLAGS_MODULE.read_text(encoding="utf-8") == wh.render_table(), "run python tests/sglang_wheels.py --write"


@needs_wheels
@pytest.mark.parametrize("fmt", lg.FORMATS, ids=lambda f: f"{f.kind}:{f.source}")
def test_line_formats_occur_in_the_source(fmt):
    for version in HAVE:
        text = wh.source(version, fmt.source) or ""
        present = [frag in text for frag in fmt.fragments]
        if _in_range(fmt, version):
            assert all(present), f"{fmt.kind}: {fmt.source} of {version} lacks {fmt.fragments}"
        else:
            assert not all(present), f"{fmt.kind}: {fmt.source} of {version} has it; fix the release range"


@needs_wheels
@pytest.mark.parametrize("version", wh.VERSIONS)
def test_release_from_the_wheels_own_field_list(version, tmp_path):
    """The start-up line SGLang prints (every field of the record, CLI or not) names its release."""
    if version not in HAVE:
        pytest.skip(f"sglang {version} wheel not cached under {wh.wheel_dir()}")
    fields = wh.field_defaults(version)
    assert set(fields) == wh.record_fields(version)
    if version != "0.5.19":  # msgspec fields without CLI metadata, printed all the same
        assert {"kv_canary_real_data", "reasoning_parser", "tool_call_parser", "stat_loggers",
                "custom_sigquit_handler"} <= set(fields)  # fmt: skip
    line = f"[2026-05-01 00:00:00] server_args={fields!r}\n"
    log = tmp_path / "p.log"
    log.write_text(line)
    run = next(r for r in lg.scan_logs(str(log)).runs if r.start)
    assert (run.version, run.version_source) == (version, "server_args fields")
    assert lg.infer_version(set(fields)) == version


@needs_wheels
def test_record_field_sets_against_the_source():
    """0.5.20+ assemble ServerArgs from the classes in _INPUT_NAMESPACES: each listed class exists, and every field
    SGLang declares without `A[...]` metadata is in our table."""
    for version in HAVE:
        i = wh.VERSIONS.index(version)
        ours = {n for n, (a, b) in sglang_flags.FIELDS.items() if a <= i <= b}
        assert ours == wh.record_fields(version), version


@functools.cache
def _sglang_human_readable_int(version: str):
    """SGLang's own function, compiled alone from utils/common.py (it needs only re, Decimal, argparse)."""
    tree = ast.parse(wh.source(version, "utils/common.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
    ns: dict = {"re": re, "Decimal": Decimal, "argparse": argparse}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "sglang/srt/utils/common.py", "exec"), ns)  # noqa: S102
    return ns["human_readable_int"]


def _outcome(fn, value: str) -> int | str:
    try:
        return fn(value)
    except (ValueError, argparse.ArgumentTypeError):
        return "refused"


_SIZES = st.from_regex(r"\A ?-?\d{0,7}(\.\d{0,3})?(Ki|Mi|Gi|Ti|k|M|G|T|ki|mi|K|m|KB|i)? ?\Z")


@needs_wheels
@settings(max_examples=300, deadline=None)
@given(_SIZES)
def test_human_readable_int_matches_sglang(value):
    for version in HAVE:
        assert _outcome(human_readable_int, value) == _outcome(_sglang_human_readable_int(version), value), version


@needs_wheels
def test_human_readable_int_fields_match_sglang():
    for version in HAVE:
        i = wh.VERSIONS.index(version)
        ours = {o for o, (_, _, kind, a, b) in sglang_flags.OPTIONS.items() if kind == "hri" and a <= i <= b}
        assert {"--context-length", "--max-total-tokens", "--max-prefill-tokens"} <= ours
        assert ours == {o for o, (_, _, k) in wh.extract(version)[1].items() if k == "hri"}


@needs_wheels
def test_release_facts_against_the_source():
    for version in HAVE:
        v = rel.parse_version(version)
        env = wh.source(version, "environ.py")
        default = re.search(r"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE = EnvBool\((\w+)\)", env).group(1)
        assert rel.deferred_release_default(v) is (default == "True"), version
        assert ("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES = EnvInt(0)" in env) is (v >= rel.MOONCAKE_BATCH_ENV_FROM)
        gated = "and self.supports_deferred_decode_kv_release" in wh.source(version, "disaggregation/common/conn.py")
        backends = rel.deferred_release_backends(v)
        for backend in ("mooncake", "nixl", "mori", "fake"):
            conn = wh.source(version, f"disaggregation/{backend}/conn.py") or ""
            if gated:
                flag = "supports_deferred_decode_kv_release = True" in conn
            else:
                flag = "(CommonKVManager)" in conn or ", CommonKVManager)" in conn
            assert (backend in backends) is flag, (version, backend)
        assert "class AscendKVManager(MooncakeKVManager)" in wh.source(version, "disaggregation/ascend/conn.py")
        prefill = wh.source(version, "disaggregation/prefill.py")
        assert ("if is_unadmitted_reject(req):" in prefill) is (v >= (0, 5, 21)), version
        assert ("def _retire_aborted_prefill_result" in prefill) is (v >= (0, 5, 20)), version
        defaults = wh.field_defaults(version)
        assert defaults["disaggregation_transfer_backend"] == "mooncake" and defaults["kv_canary"] == "none"
        assert ("disaggregation_enable_kv_checksum" in defaults) is bool(rel.has_kv_checksum(v))
        assert defaults.get("disaggregation_decode_allocation_policy") == (
            "early" if v >= rel.ALLOCATION_POLICY_FROM else None
        )
        assert "max_req_input_len = max_req_len - 5" in wh.source(version, "managers/tp_worker.py") or (
            "max_req_len - 5," in wh.source(version, "managers/tp_worker.py")
        )


@needs_wheels
def test_metric_names_exist():
    for version in HAVE:
        text = wh.source(version, "observability/metrics_collector.py")
        for name in mt.KNOWN:
            expected = name != mt.DEFERRED_RELEASE or rel.parse_version(version) >= (0, 5, 22)
            assert (f'name="{name}"' in text) is expected, (version, name)
        assert '"engine_type": engine_type' in text and '"model_name": get_serving().served_model_name' in text


@needs_wheels
def test_fixtures_regenerate_identically(tmp_path):
    needed = {"0.5.19", "0.5.21", "0.5.23"}
    if not needed <= set(HAVE):
        pytest.skip(f"the fixtures use {sorted(needed)}; cached: {HAVE}")
    sys.path.insert(0, str(FIX))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIX))
    for path in make_fixtures.write_all(tmp_path):
        assert path.read_bytes() == (FIX / path.name).read_bytes(), f"regenerate {path.name} (make_fixtures.py)"


def _kvfence_options() -> set[str]:
    from kvfence.cli import build_parser

    out: set[str] = set()
    stack = [build_parser()]
    while stack:
        p = stack.pop()
        for action in p._actions:
            out.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return out


def test_flags_named_in_advice_exist_in_sglang():
    """Every --flag our findings tell an operator to set exists in SGLang (or is one of kvfence's own)."""
    texts = []
    for path in FIX.glob("*.log"):
        texts += [f.message + " " + f.fix for f in lg.scan_logs(str(path)).findings]
    for name in ("launch_prefill_0.5.19.sh", "launch_decode_0.5.19.sh", "server_info_decode_0.5.23_no_context.json"):
        for version in ("0.5.19", "0.5.21", "0.5.23"):
            snap, _ = srv.load_snapshot("decode", str(FIX / name), version=version)
            texts += [f.message + " " + f.fix for f in sg.audit(snap, snap)]
    texts += [r.summary for r in lg.RULES + sg.RULES]
    named = {m for t in texts for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", t)}
    unknown = named - set(sglang_flags.OPTIONS) - _kvfence_options()
    assert named and not unknown


@pytest.mark.slow
def test_downloaded_wheel_has_every_format(tmp_path, monkeypatch):
    """Fetch 0.5.23 from PyPI when it is not cached, then check every line format against it."""
    if wh.wheel_path("0.5.23") is None:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "sglang==0.5.23", "-d", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            pytest.skip(f"pip download sglang==0.5.23 failed: {r.stderr[-300:]}")
        monkeypatch.setenv("KVFENCE_SGLANG_WHEELS", str(tmp_path))
        wh._zip.cache_clear()
        wh.source.cache_clear()
    assert wh.wheel_path("0.5.23") is not None and os.path.getsize(wh.wheel_path("0.5.23")) > 1 << 20
    for fmt in lg.FORMATS:
        text = wh.source("0.5.23", fmt.source) or ""
        assert all(frag in text for frag in fmt.fragments) is _in_range(fmt, "0.5.23"), fmt.kind
