"""`kvfence probe` validated against kvfence itself (router + prefill + decode on loopback).

Three deployments of the tiny Llama, started once for the module and in parallel (each takes
15-30 s to come up on 2 cores): normal mode; the `placeholder_handoff` fault with verification
off (prefill sends one page and a manifest claiming 1 token, decode admits it and decodes over
pages nobody wrote for this request); the same fault with verification on. The probe must pass
the first with --expect-deterministic (kvfence on CPU is batch-invariant for greedy decoding),
catch the second as temperature-0 drift that depends on other traffic, and see the third fail
every request cleanly with the integrity reason, never report a leak.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvfence.cli import main

# nine worker processes come up for the module; the verdict on hand-made replies is test_probe_verdict.py
pytestmark = pytest.mark.slow

CTX, POOL, PAGE = 128, 256, 4  # small pool: churn requests recycle the pages a golden prompt used
MODES = {
    "normal": [],
    "noverify-fault": ["--no-verify", "--inject-fault", "placeholder_handoff"],
    "verify-fault": ["--inject-fault", "placeholder_handoff"],
}
PROBE_ARGS = ["--model", "tiny", "--max-requests", "60", "--time-budget", "60", "--golden", "2", "--canaries", "4",
              "--aborts", "2", "--max-tokens", "8", "--concurrency", "4", "--request-timeout", "30",
              "--expect-deterministic", "--no-progress", "--json"]  # fmt: skip
IN_LIMIT = {"calibration", "golden-idle", "golden-replay", "churn", "canary", "golden-load", "golden-after"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher's own session: it and its three children
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """mode -> base URL of a running `kvfence serve` deployment; all started at once, stopped at the end."""
    logs = tmp_path_factory.mktemp("probe-kvfence-logs")
    procs: dict[str, tuple[subprocess.Popen, str, Path]] = {}
    try:
        for mode, extra in MODES.items():
            port = _free_port()
            log = logs / f"{mode}.log"
            cmd = [sys.executable, "-m", "kvfence", "serve", "--model", str(tiny_llama_dir),
                   "--served-model-name", "tiny", "--port", str(port), "--context-length", str(CTX),
                   "--max-total-tokens", str(POOL), "--page-size", str(PAGE),
                   "--log-level", "warning", *extra]  # fmt: skip
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            procs[mode] = (proc, f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + 240
        for mode, (proc, url, log) in procs.items():
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"{mode} server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"{mode} server not ready:\n{log.read_text()[-3000:]}")
                time.sleep(0.25)
        yield {mode: url for mode, (_, url, _) in procs.items()}
    finally:
        for proc, _, _ in procs.values():
            _stop(proc)


def _probe(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["probe", url, *PROBE_ARGS])
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == code
    return code, doc


def _rules(doc: dict, severity: str) -> set[str]:
    return {f["rule"] for f in doc["findings"] if f["severity"] == severity}


def test_normal_kvfence_passes_and_is_deterministic(servers: dict[str, str], capsys) -> None:
    code, doc = _probe(servers["normal"], capsys)
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []
    assert code == 0
    assert doc["facts"]["context_length"] == CTX and doc["facts"]["pool_tokens"] == POOL
    # Per-header calibration sizes the boundary prompts exactly: ctx-1 fits (with 1 token to generate), ctx does not.
    boundary = {r["sent_tokens"]: r for r in doc["replies"] if r["check"] == "boundary"}
    assert sorted(boundary) == [CTX - 1, CTX, CTX + 1]
    assert boundary[CTX - 1]["status"] == 200 and boundary[CTX - 1]["prompt_tokens"] == CTX - 1
    assert boundary[CTX]["status"] == 400 and boundary[CTX + 1]["status"] == 400
    by_check: dict[str, list[str]] = {}
    for r in doc["replies"]:
        by_check.setdefault(r["check"], []).append(r["text"])
    assert by_check["golden-replay"] == by_check["golden-idle"] == by_check["golden-after"]
    assert sorted(by_check["golden-load"]) == sorted(by_check["golden-idle"])
    assert all(r["server_integrity"] == "verified" for r in doc["replies"] if r["status"] == 200)


def test_placeholder_handoff_without_verification_is_caught(servers: dict[str, str], capsys) -> None:
    code, doc = _probe(servers["noverify-fault"], capsys)
    assert code == 2
    critical = _rules(doc, "critical")
    # Decode reads pages nobody wrote for this request: the same prompt answers differently after other traffic.
    assert "golden-drift-replay" in critical
    assert critical <= {"golden-drift-replay", "golden-drift-after-load", "golden-drift-under-load"}
    assert "handoff-unverified" in _rules(doc, "warning")
    golden = [r for r in doc["replies"] if r["check"].startswith("golden")]
    assert golden and all(r["status"] == 200 for r in golden)  # a 200 with the wrong answer: that is the danger
    idle = [r["text"] for r in doc["replies"] if r["check"] == "golden-idle"]
    replay = [r["text"] for r in doc["replies"] if r["check"] == "golden-replay"]
    assert idle != replay


def test_placeholder_handoff_with_verification_fails_cleanly(servers: dict[str, str], capsys) -> None:
    code, doc = _probe(servers["verify-fault"], capsys)
    assert code == 1  # errors are warnings; nothing leaked
    assert _rules(doc, "critical") == set()
    assert not {"canary-leak", "golden-drift-replay", "golden-drift-under-load"} & {f["rule"] for f in doc["findings"]}
    errors = [f for f in doc["findings"] if f["rule"] == "server-errors"]
    assert len(errors) == 1 and "token_count_mismatch" in errors[0]["message"]
    in_limit = [r for r in doc["replies"] if r["check"] in IN_LIMIT]
    assert in_limit and all(r["status"] == 500 for r in in_limit)  # never a 200 with garbage
    assert all("token_count_mismatch" in r["error"] for r in in_limit)
    aborts = [r for r in doc["replies"] if r["check"] == "midstream-abort"]
    # each abort saw the failure first, or was cut after the one token prefill sampled from the request's own KV
    # and streams before decode's verdict (docs/handoff.md): a chunk without a record, never a verified one
    failed_first = [r for r in aborts if "token_count_mismatch" in (r.get("error") or "")]
    cut_early = [r for r in aborts if not r.get("error") and r.get("server_integrity") is None]
    assert aborts and len(failed_first) + len(cut_early) == len(aborts), aborts
    assert all(r["text"] == "" for r in failed_first)
