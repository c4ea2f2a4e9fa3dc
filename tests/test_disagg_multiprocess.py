"""Disaggregated serving across real processes: KV over TCP, control over zmq, HTTP through the API app.

Two set-ups: (1) prefill and decode as child processes (`python -m kvfence.commands.worker_main`)
registered with a `Router` in this process, so tests see token ids and choose request ids
(fault targeting); (2) the launcher's three processes behind HTTP, used as a user would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg.core_board import CoreBoard
from kvfence.disagg.launcher import LaunchConfig, Launcher, free_port
from kvfence.disagg.router import Router, RouterConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.auth import secure_hub, worker_env

CTX = "256"
ROLES = ("prefill", "decode")


def reference(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 8192), context_length=int(CTX)))
    return engine.generate(prompts, params)


def requests_mix(n: int, seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 16, 17, 40, 90, rng.randrange(1, 150)])
        prompt = [rng.randrange(10, 2000) for _ in range(length)]
        out.append((f"m{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True)))
    return out


class WorkerProcesses:
    """Prefill + decode child processes registered with a Router (ZmqHub) living in this process."""

    def __init__(self, model_dir: Path, log_dir: Path, faults: str | None = None, transport: str = "tcp") -> None:
        self.hub = secure_hub()
        self.router = Router(self.hub, RouterConfig(handoff_deadline_s=20, request_timeout_s=60))
        common = [sys.executable, "-m", "kvfence.commands.worker_main", "--model", str(model_dir)]
        common += ["--context-length", CTX, "--router-address", self.hub.address, "--log-level", "WARNING"]
        common += ["--exit-with-parent", "--transfer-backend", transport, "--torch-threads", "1"]
        fault_args = ["--inject-fault", faults] if faults else []
        self.board = log_dir / "cores"  # as `kvfence serve` does: the two workers pool two threads
        CoreBoard.create(self.board, 2, budget=2)
        boards = {role: ["--core-board", str(self.board), "--core-board-slot", str(i)] for i, role in enumerate(ROLES)}
        self.procs = {
            "prefill": [*common, "--role", "prefill", "--max-total-tokens", "1024", *fault_args, *boards["prefill"]],
            "decode": [*common, "--role", "decode", "--max-total-tokens", "2048", "--handoff-port", str(free_port()),
                       *boards["decode"]],
        }  # fmt: skip
        self.logs = {role: open(log_dir / f"{role}.log", "wb") for role in self.procs}  # noqa: SIM115
        self.popen = {
            role: subprocess.Popen(cmd, stdout=self.logs[role], stderr=subprocess.STDOUT, env=worker_env())
            for role, cmd in self.procs.items()
        }
        self.router.wait_for_workers(timeout=180)
        self.router.start()

    def close(self) -> None:
        self.router.close()  # sends Shutdown
        for p in self.popen.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs.values():
            f.close()


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcesses]:
    w = WorkerProcesses(tiny_llama_dir, tmp_path_factory.mktemp("workers"), faults="corrupt_byte@bad#1")
    yield w
    w.close()
    assert {role: p.returncode for role, p in w.popen.items()} == {"prefill": 0, "decode": 0}


def _run(router: Router, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[Any]]:
    async def one(rid: str, prompt: list[int], sp: SamplingParams) -> list[Any]:
        return [c async for c in router.generate(rid, prompt, sp)]

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*[one(*r) for r in reqs])

    return {r[0]: chunks for r, chunks in zip(reqs, asyncio.run(main()), strict=True)}


def _wait_pools_free(router: Router, timeout: float = 10.0) -> dict[str, Any]:
    """Worker stats (published every 250 ms) once both pools are fully free."""
    deadline = time.monotonic() + timeout
    roles: dict[str, Any] = {}
    while time.monotonic() < deadline:
        roles = router.stats()["roles"]
        if roles and all(r["pages_free"] == r["pages_total"] and r["pages_quarantined"] == 0 for r in roles.values()):
            return roles
        time.sleep(0.1)
    raise AssertionError(f"pools not back to baseline: {roles}")


def _prefix_cache_hits(metrics: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for fam in text_string_to_metric_families(metrics)
        if fam.name == "kvfence_prefix_cache_hits"
        for s in fam.samples
        if s.name == "kvfence_prefix_cache_hits_total"
    )


def test_worker_processes_serve_http_through_the_api_app(workers: WorkerProcesses, tiny_llama_dir: Path) -> None:
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import ServerThread

    app = build_app(workers.router, Tokenizer.from_dir(tiny_llama_dir), ApiSettings(workers.router.model_name))
    reqs = requests_mix(4, seed=3)
    with ServerThread(app) as server:

        async def main() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

                async def one(prompt: list[int], sp: SamplingParams) -> dict[str, Any]:
                    body = {"model": workers.router.model_name, "prompt": prompt, "max_tokens": sp.max_tokens}
                    r = await client.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    return r.json()

                return await asyncio.gather(*[one(p, sp) for _, p, sp in reqs])

        got = asyncio.run(main())
        # a request that fits neither pool is refused with 400 before any worker sees it
        too_long = {"model": workers.router.model_name, "prompt": [3] * 200, "max_tokens": 100}
        r = httpx.post(f"{server.url}/v1/completions", json=too_long, timeout=30)
        assert r.status_code == 400 and "256" in r.text
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        # one prompt twice: the second is served from the prefill worker's prefix cache (on by default), and the
        # router's page counts the hit, in tokens, from the worker's stats (sent every 250 ms)
        hits0 = _prefix_cache_hits(metrics)
        twice = {"model": workers.router.model_name, "prompt": list(range(100, 200)), "max_tokens": 1}
        for _ in range(2):
            assert httpx.post(f"{server.url}/v1/completions", json=twice, timeout=30).status_code == 200
        deadline = time.monotonic() + 10
        while (hits := _prefix_cache_hits(httpx.get(f"{server.url}/metrics", timeout=10).text)) == hits0:
            assert time.monotonic() < deadline, "the router never reported the prefill worker's prefix-cache hit"
            time.sleep(0.1)
        assert hits - hits0 == 96, (hits0, hits)  # the 6 full pages of 16 before the last token
    want = reference(tiny_llama_dir, [p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    for body, ref in zip(got, want, strict=True):
        choice = body["choices"][0]
        assert choice["text"] == ref.text and body["usage"]["completion_tokens"] == len(ref.token_ids)
        assert choice["kvfence"]["integrity"]["status"] == "verified"
    assert 'kvfence_kv_capacity_tokens{role="decode"} 2048.0' in metrics
    assert "kvfence_handoff_verified_total" in metrics  # the router's integrity counters, on the same page


def test_prefill_borrows_the_idle_decode_workers_core_and_decode_keeps_its_own(workers: WorkerProcesses) -> None:
    """Both worker processes on one core board: a prompt that finds decode idle is computed on two threads
    (prefill's report counts the steps), decode stays on its one; with no work both claims are back to 0."""

    def reports() -> dict[str, dict[str, Any]]:
        return {w["role"]: w for w in workers.router.stats()["workers"].values()}

    before = reports()["prefill"].get("steps_borrowing_cores", 0)
    _run(workers.router, [("borrow-1", [7] * 100, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and reports()["prefill"].get("steps_borrowing_cores", 0) <= before:
        time.sleep(0.1)  # reports come every 250 ms
    got = reports()
    assert got["prefill"]["steps_borrowing_cores"] > before and got["prefill"]["torch_threads"] == 2
    assert got["decode"]["steps_borrowing_cores"] == 0 and got["decode"]["torch_threads"] == 1
    deadline = time.monotonic() + 10
    claims = [-1]
    while time.monotonic() < deadline and any(claims):
        with open(workers.board, "rb") as f:
            claims = list(struct.unpack("=5i", f.read()))[3:]
        time.sleep(0.05)
    assert claims == [0, 0]


def _assert_exact_and_corrupt_caught(router: Any, model_dir: Path, reqs: list, bad: tuple) -> None:
    """Run reqs plus `bad` (whose page the workers' corrupt_byte fault hits): every good request is
    token-exact against aggregated and verified; `bad` fails with digest_mismatch."""
    got = _run(router, [*reqs, bad])
    want = reference(model_dir, [p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    for (rid, _, _), ref in zip(reqs, want, strict=True):
        assert [t for c in got[rid] for t in c.token_ids] == ref.token_ids, rid
        assert got[rid][-1].integrity["status"] == "verified"
    last = got[bad[0]][-1]
    assert last.finish_reason == "error" and last.integrity["reason"] == "digest_mismatch", last


def test_worker_processes_over_tcp_match_aggregated_and_catch_a_corrupt_byte(
    workers: WorkerProcesses, tiny_llama_dir: Path
) -> None:
    bad = ("bad", [5] * 40, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    _assert_exact_and_corrupt_caught(workers.router, tiny_llama_dir, requests_mix(12, seed=1), bad)
    roles = _wait_pools_free(workers.router)
    assert roles["prefill"]["pages_total"] == 64 and roles["decode"]["pages_total"] == 128
    assert workers.router.integrity_counts["rejected"] == 1


def test_worker_processes_over_mooncake_match_aggregated_and_catch_a_corrupt_byte(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from kvfence.transfer.mooncake_engine import mooncake_available

    status = mooncake_available()
    if not status.ok:
        pytest.skip(f"Mooncake unavailable: {status.reason}")
    w = WorkerProcesses(tiny_llama_dir, tmp_path, faults="corrupt_byte@bad#0", transport="mooncake")
    try:
        bad = ("bad", [7] * 33, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        _assert_exact_and_corrupt_caught(w.router, tiny_llama_dir, requests_mix(6, seed=4), bad)
        _wait_pools_free(w.router, timeout=30)
    finally:
        w.close()


@pytest.mark.slow
def test_fifty_concurrent_requests_over_tcp_match_aggregated(workers: WorkerProcesses, tiny_llama_dir: Path) -> None:
    reqs = requests_mix(50, seed=2)
    got = _run(workers.router, reqs)
    want = reference(tiny_llama_dir, [p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    for (rid, _, _), ref in zip(reqs, want, strict=True):
        assert [t for c in got[rid] for t in c.token_ids] == ref.token_ids, rid
    _wait_pools_free(workers.router)


# -- the launcher: three processes behind HTTP -----------------------------------------------------------------


def _fake_launcher(monkeypatch: pytest.MonkeyPatch, config: LaunchConfig, scripts: dict[str, list[str]]) -> Launcher:
    """A launcher whose children are tiny scripts: `scripts[slot]` (a list run in turn, one per start) or a sleeper."""
    launcher = Launcher(config)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    starts: dict[str, int] = {}

    def command(slot: str) -> list[str]:
        n = starts[slot] = starts.get(slot, 0) + 1
        runs = scripts.get(slot, [])
        code = runs[n - 1] if n <= len(runs) else None
        return sleeper if code is None else [sys.executable, "-c", code]

    monkeypatch.setattr(launcher, "command", command)
    launcher.starts = starts  # type: ignore[attr-defined]
    return launcher


def test_launcher_stops_everything_when_a_worker_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = "import time, sys; time.sleep(0.3); sys.exit(2)"  # exit code 2: refused by the router / bad flags
    launcher = _fake_launcher(monkeypatch, LaunchConfig(num_decode=2), {"decode-1": [refused]})
    launcher.start()
    t0 = time.monotonic()
    assert launcher.watch() == 1
    assert time.monotonic() - t0 < 15
    assert launcher.starts["decode-1"] == 1  # not restarted: it would fail the same way
    assert {r: p.returncode for r, p in launcher.procs.items()} == {
        "router": -signal.SIGTERM,
        "prefill-0": -signal.SIGTERM,
        "decode-0": -signal.SIGTERM,
        "decode-1": 2,
    }


def test_a_router_refused_on_configuration_is_not_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that exits 2 (e.g. its port is taken) stops the deployment at once: restarting it, and the workers
    that register with it, three times would only fail the same way (and blame someone else at the end)."""
    refused = "import time, sys; time.sleep(0.3); sys.exit(2)"
    launcher = _fake_launcher(monkeypatch, LaunchConfig(), {"router": [refused]})
    launcher.start()
    assert launcher.watch() == 1
    assert launcher.starts["router"] == 1 and launcher.restarts == {}
    assert launcher.procs["router"].returncode == 2


def test_launcher_restarts_a_worker_that_dies_in_its_slot_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    dies = "import os, time; time.sleep(0.3); os.kill(os.getpid(), 9)"  # killed -9
    launcher = _fake_launcher(
        monkeypatch, LaunchConfig(num_prefill=2, max_worker_restarts=2), {"prefill-1": [dies, dies, dies]}
    )
    launcher.start()
    t0 = time.monotonic()
    assert launcher.watch() == 1  # the third death is past the limit: everything stops, reported
    assert time.monotonic() - t0 < 15
    assert launcher.starts == {"router": 1, "prefill-0": 1, "prefill-1": 3, "decode-0": 1}
    assert launcher.restarts == {"prefill-1": 2}
    assert launcher.procs["prefill-1"].returncode == -signal.SIGKILL
    assert launcher.procs["prefill-0"].returncode == -signal.SIGTERM


def test_a_restarted_worker_keeps_its_id_and_ports() -> None:
    launcher = Launcher(LaunchConfig(num_decode=2))
    first, again = launcher.command("decode-1"), launcher.command("decode-1")
    assert first == again
    assert first[first.index("--worker-id") + 1] == "decode-1"
    assert first[first.index("--handoff-port") + 1] == str(launcher.ports.handoff[1])


def test_kvfence_serve_disagg_gives_each_role_its_own_pool_and_decode_the_verify_flag() -> None:
    from kvfence.cli import build_parser
    from kvfence.commands.worker_main import launch_command_args

    argv = ["serve", "--disagg", "--model", "m", "--prefill-max-total-tokens", "512"]
    args = build_parser().parse_args([*argv, "--decode-max-total-tokens", "1024", "--no-verify", "--page-size", "32"])
    common, prefill, decode = launch_command_args(args)
    assert ("--model", "m") == common[common.index("--model") : common.index("--model") + 2]
    assert "32" in common and "--no-verify" not in common
    assert prefill == ("--max-total-tokens", "512", "--enable-prefix-caching")
    assert decode == ("--max-total-tokens", "1024", "--no-verify")
    off = launch_command_args(build_parser().parse_args([*argv, "--no-enable-prefix-caching"]))
    assert "--no-enable-prefix-caching" in off[1] and "--enable-prefix-caching" not in off[1]  # reaches prefill
    load_only = launch_command_args(build_parser().parse_args([*argv, "--no-prefix-affinity"]))
    assert "--no-prefix-affinity" in load_only[0] and "--no-prefix-affinity" not in common  # reaches the router
    roles = build_parser().parse_args(["serve", "--role", "decode", "--handoff-port", "5"])
    assert roles.role == "decode" and roles.handoff_port == 5
    scaled = build_parser().parse_args(["serve", "--prefill-workers", "2", "--decode-workers", "3"])
    assert (scaled.prefill_workers, scaled.decode_workers, scaled.max_worker_restarts) == (2, 3, 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode-workers", "0"])


def test_kvfence_serve_forwards_every_engine_flag_to_every_worker() -> None:
    """Each flag of the model-and-engine group, set to a value other than its default, reaches the workers'
    command lines (`--kernels native` once stopped at the launcher: the workers ran the torch kernels)."""
    from kvfence.cli import build_parser
    from kvfence.commands.worker_main import launch_command_args
    from kvfence.config import add_engine_arguments

    values = {
        "--model": "m", "--dtype": "bfloat16", "--device": "cpu", "--kernels": "native", "--page-size": "32",
        "--max-total-tokens": "4096", "--chunked-prefill-size": "64", "--max-num-seqs": "3",
        "--max-num-batched-tokens": "128", "--context-length": "1024", "--max-decode-steps": "3",
        "--decode-steps-ms": "2.5",
    }  # fmt: skip
    engine_flags = argparse.ArgumentParser()
    add_engine_arguments(engine_flags)
    # one name per flag (its first: --model-path and --max-model-len are spellings of --model and --context-length)
    flags = {a.option_strings[0] for a in engine_flags._actions if a.option_strings and a.option_strings[0] != "-h"}
    prefill_only = {"--enable-prefix-caching"}  # decode never looks prompts up: its KV arrives by handoff
    assert flags == set(values) | prefill_only, "a new engine flag: give it a value here so this test checks it"
    args = build_parser().parse_args(["serve", *[x for kv in values.items() for x in kv], *prefill_only])
    common, prefill, decode = launch_command_args(args)
    for flag, value in values.items():
        for role_args in ((*common, *prefill), (*common, *decode)):
            assert flag in role_args and role_args[role_args.index(flag) + 1] == value, flag
    for flag in prefill_only:
        assert flag in prefill and flag not in (*common, *decode), flag


def test_launcher_passes_each_role_its_ports_explicitly() -> None:
    launcher = Launcher(LaunchConfig(num_prefill=2, num_decode=2, prefill_args=("--max-total-tokens", "512")))
    p = launcher.ports
    assert launcher.slots == ("router", "prefill-0", "prefill-1", "decode-0", "decode-1")
    assert len({p.http, p.control, *p.handoff}) == 4  # every decode worker its own data-plane port
    router, prefill, decode = (launcher.command(r) for r in ("router", "prefill-1", "decode-0"))
    assert ["--port", str(p.http)] == router[router.index("--port") : router.index("--port") + 2]
    assert f"tcp://127.0.0.1:{p.control}" in prefill and f"tcp://127.0.0.1:{p.control}" in decode
    assert str(p.handoff[0]) in decode and "512" in prefill and "512" not in decode
    assert prefill[prefill.index("--worker-id") + 1] == "prefill-1"


@pytest.fixture(scope="module")
def launched(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    log = open(tmp_path_factory.mktemp("launcher") / "deployment.log", "wb")  # noqa: SIM115
    config = LaunchConfig(
        common_args=("--model", str(tiny_llama_dir), "--context-length", CTX, "--log-level", "WARNING"),
        prefill_args=("--max-total-tokens", "512"),
        decode_args=("--max-total-tokens", "1024"),
        max_worker_restarts=0,  # a dead worker takes the deployment down (the restart path has its own tests)
        core_budget=2,  # as `kvfence serve` on two cores
    )
    launcher = Launcher(config, stdout=log.fileno(), stderr=subprocess.STDOUT)
    launcher.start()
    try:
        launcher.wait_ready(180)
        yield launcher
    finally:
        launcher.stop()
        log.close()


@pytest.mark.slow
def test_launched_deployment_serves_http_and_goes_down_together(launched: Launcher, tiny_llama_dir: Path) -> None:
    body = {"model": tiny_llama_dir.name, "prompt": [5] * 30, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{launched.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = reference(tiny_llama_dir, [[5] * 30], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])[0]
    assert r.json()["choices"][0]["text"] == ref.text
    assert r.json()["choices"][0]["kvfence"]["integrity"]["status"] == "verified"
    metrics = httpx.get(f"{launched.base_url}/metrics", timeout=10).text
    assert 'kvfence_kv_capacity_tokens{role="prefill"} 512.0' in metrics
    assert 'kvfence_worker_torch_threads{role="decode",worker="decode-0"} 1.0' in metrics  # decode never borrows
    board = launched.core_board
    assert board is not None and Path(board).exists()
    os.kill(launched.procs["decode-0"].pid, signal.SIGKILL)
    assert launched.watch() == 1  # noticed the death and, with no restarts allowed, stopped the others
    assert all(p.poll() is not None for p in launched.procs.values())
    assert launched.procs["decode-0"].returncode == -signal.SIGKILL
    assert not Path(board).exists()  # stopping removed the workers' core board


@pytest.mark.slow
def test_end_to_end_bench_runs_both_modes_and_reports_a_ratio(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json

    from kvfence.bench.handoff_e2e import main as bench_main

    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_llama_dir), "--num-requests", "4", "--input-len", "32", "--output-len", "4"]
    assert bench_main([*argv, "--rounds", "2", "--context-length", "256", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical_tokens_on_vs_off"] is True
    assert len(result["paired_ratios_on_over_off"]) == 2 and result["throughput_ratio_on_over_off"] > 0
    assert {r["mode"] for r in result["rounds"]} == {"verify_on", "verify_off"}
