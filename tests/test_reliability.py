"""Faults a disaggregated deployment must survive: workers killed, transfers too slow, the router restarted.

One router lives in this process (a `ZmqHub` on a fixed loopback port, so a "restarted"
router can bind the same address); prefill and decode are child processes. The
prefill worker throttles the KV of requests whose id starts with "slow" (one page per
frame, a pause before each), which opens a window in which a transfer is in flight.
After every fault: the faulted request ends (with an error) within a bound, a
concurrent healthy request gets exactly its reference tokens, the surviving workers'
pools are back to baseline with their allocator conserved, and the deployment
serves again (a replacement worker registers, or the workers re-register with the
new router).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg.launcher import free_port
from kvfence.disagg.router import FlightState, Router, RouterConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import ServiceUnavailableError
from kvfence.server.http import to_api_error
from tests.helpers.auth import secure_hub, worker_env

CTX = 256
DEADLINE_S = 3.0  # handoff deadline of router and workers
WORKER_TIMEOUT_S = 1.5  # the router declares a silent worker dead after this
THROTTLE = "0.9@slow"  # 4 pages of a 64-token prompt take ~3.6 s > DEADLINE_S
SLOW_PROMPT = [11 + i % 50 for i in range(64)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def router_config() -> RouterConfig:
    return RouterConfig(
        handoff_deadline_s=DEADLINE_S, request_timeout_s=30, worker_timeout_s=WORKER_TIMEOUT_S, heartbeat_interval_s=0.2
    )


class Deployment:
    """A router in this process and worker child processes registered with it."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.port = free_port()
        self.router = Router(secure_hub(port=self.port), router_config())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.all_procs: list[subprocess.Popen[bytes]] = []
        self.spawn("prefill")
        self.spawn("decode")
        self.router.wait_for_workers(timeout=180)
        self.router.start()

    def spawn(self, role: str) -> None:
        cmd = [sys.executable, "-m", "kvfence.commands.worker_main", "--role", role, "--model", str(self.model_dir)]
        cmd += ["--context-length", str(CTX), "--router-address", f"tcp://127.0.0.1:{self.port}"]
        cmd += ["--log-level", "WARNING", "--exit-with-parent", "--handoff-deadline-s", str(DEADLINE_S)]
        cmd += ["--router-timeout-s", "2", "--reconnect-timeout-s", "60"]
        if role == "prefill":
            cmd += ["--max-total-tokens", "1024", "--throttle-kv-send", THROTTLE]
        else:
            cmd += ["--max-total-tokens", "2048", "--handoff-port", str(free_port())]
        log = open(self.log_dir / f"{role}-{len(self.all_procs)}.log", "wb")  # noqa: SIM115
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env())
        self.all_procs.append(self.procs[role])
        log.close()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.router.healthy().values()) and set(self.router.stats()["roles"]) == {"prefill", "decode"}:
                return
            time.sleep(0.1)
        raise AssertionError(f"deployment not healthy: {self.router.healthy()}")

    def close(self) -> None:
        self.router.close()
        for p in self.all_procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Client:
    """One request through `router.generate` on its own thread and event loop."""

    def __init__(self, router: Router, rid: str, prompt: list[int], sp: SamplingParams = GREEDY) -> None:
        self.rid = rid
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ended: float | None = None

        async def run() -> None:
            async for c in router.generate(rid, prompt, sp):
                self.chunks.append(c)

        def main() -> None:
            try:
                asyncio.run(run())
            except BaseException as e:
                self.error = e
            self.ended = time.monotonic()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def result(self, bound_s: float) -> Client:
        """Wait at most `bound_s` for the request to end (no request may hang)."""
        self.thread.join(bound_s)
        assert not self.thread.is_alive(), f"{self.rid} still running after {bound_s}s"
        return self

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def last(self) -> Any:
        return self.chunks[-1]


def reference(model_dir: Path, prompt: list[int]) -> list[int]:
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 4096), context_length=CTX))
    return engine.generate([prompt], [GREEDY])[0].token_ids


def flight_state(router: Router, rid: str) -> FlightState | None:
    f = router._flights.get(rid)
    return None if f is None else f.state


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def assert_pools_at_baseline(
    router: Router, roles: tuple[str, ...] = ("prefill", "decode"), timeout: float = 15
) -> None:
    """Every page of every live worker is free again, and free + used + quarantined == total."""
    deadline = time.monotonic() + timeout
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        got = router.stats()["roles"]
        if all(r in got for r in roles):
            ok = all(
                got[r]["pages_free"] == got[r]["pages_total"]
                and got[r]["pages_used"] == 0
                and got[r]["pages_quarantined"] == 0
                for r in roles
            )
            if ok:
                for r in roles:
                    s = got[r]
                    assert s["pages_free"] + s["pages_used"] + s["pages_quarantined"] == s["pages_total"]
                return
        time.sleep(0.1)
    raise AssertionError(f"pools not back to baseline: {got}")


@pytest.fixture(scope="module")
def dep(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tiny_llama_dir, tmp_path_factory.mktemp("reliability"))
    try:
        d.wait_healthy()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def healthy_ref(tiny_llama_dir: Path) -> tuple[list[int], list[int]]:
    prompt = [7 + i % 13 for i in range(33)]
    return prompt, reference(tiny_llama_dir, prompt)


@pytest.fixture(scope="module")
def slow_first(tiny_llama_dir: Path) -> int:
    """The first token of SLOW_PROMPT: prefill samples it from the request's own KV."""
    return reference(tiny_llama_dir, SLOW_PROMPT)[0]


def assert_fault_failed_cleanly(c: Client, own_first: int | None = None) -> None:
    """Ended with an error and a failed record; of tokens, at most the first one prefill computed from this
    request's own prompt and streamed before decode's verdict (the record counts it): nothing decoded over
    pages nobody verified, nothing of anybody else's KV."""
    assert c.error is None, c.error
    assert c.chunks and c.last.finished and c.last.finish_reason == "error", c.chunks
    streamed = c.last.integrity.get("tokens_before_verdict", 0)
    assert c.tokens == ([own_first] if streamed else []), (c.tokens, c.last.integrity)
    assert c.last.integrity["status"] in ("failed", "rejected"), c.last.integrity


@pytest.mark.slow  # worker processes killed and timed; in-process: test_disagg_scaleout, test_stalled_writers
def test_slow_transfer_past_the_deadline_fails_only_that_request(
    dep: Deployment, healthy_ref: tuple[list[int], list[int]], slow_first: int
) -> None:
    slow = Client(dep.router, "slow-deadline", SLOW_PROMPT)
    prompt, want = healthy_ref
    ok = Client(dep.router, "ok-deadline", prompt)
    assert ok.result(30).tokens == want  # its transfer passes the stalled one on the same connection
    slow.result(DEADLINE_S + 10)
    assert_fault_failed_cleanly(slow, slow_first)
    assert slow.last.integrity["reason"] in ("timeout", "aborted", "transfer_error"), slow.last.integrity
    assert slow.ended is not None and slow.ended - slow.started < DEADLINE_S + 6
    assert_pools_at_baseline(dep.router)


@pytest.mark.slow  # worker processes killed and timed; in-process: test_disagg_scaleout, test_stalled_writers
def test_decode_killed_mid_transfer(dep: Deployment, healthy_ref: tuple[list[int], list[int]], slow_first: int) -> None:
    c = Client(dep.router, "slow-decode-kill", SLOW_PROMPT)
    wait_for(lambda: flight_state(dep.router, c.rid) is FlightState.DECODING, 15, "the transfer to start")
    dep.procs["decode"].send_signal(signal.SIGKILL)
    dep.procs["decode"].wait(10)
    c.result(WORKER_TIMEOUT_S + 10)
    assert_fault_failed_cleanly(c, slow_first)
    # the router notices, and answers new requests 503 until a decode worker registers
    wait_for(lambda: not dep.router.healthy()["decode"], WORKER_TIMEOUT_S + 5, "decode to be declared dead")
    refused = Client(dep.router, "after-decode-kill", [5] * 20).result(5)
    assert isinstance(refused.error, ServiceUnavailableError), refused.error  # the HTTP layer's 503
    assert to_api_error(refused.error).status == 503 and "no healthy decode worker" in str(refused.error)
    assert_pools_at_baseline(dep.router, ("prefill",))  # prefill freed the source pages it was sending from
    dep.spawn("decode")
    dep.wait_healthy()
    prompt, want = healthy_ref
    assert Client(dep.router, "ok-new-decode", prompt).result(30).tokens == want
    assert dep.router.stats()["worker_deaths"]["decode"] >= 1
    assert_pools_at_baseline(dep.router)


@pytest.mark.slow  # worker processes killed and timed; in-process: test_disagg_scaleout, test_stalled_writers
def test_prefill_killed_mid_prefill(dep: Deployment, healthy_ref: tuple[list[int], list[int]]) -> None:
    prefill = dep.procs["prefill"]
    prefill.send_signal(signal.SIGSTOP)  # hold it inside the request: the order arrives, nothing comes back
    try:
        c = Client(dep.router, "stuck-in-prefill", [9] * 50)
        wait_for(lambda: flight_state(dep.router, c.rid) is FlightState.PREFILLING, 10, "the prefill order to go out")
    finally:
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(10)
    c.result(WORKER_TIMEOUT_S + 10)
    assert_fault_failed_cleanly(c)
    assert "prefill" in c.last.error and "lost" in c.last.error, c.last.error
    refused = Client(dep.router, "after-prefill-kill", [5] * 20).result(5)
    assert isinstance(refused.error, ServiceUnavailableError) and to_api_error(refused.error).status == 503
    assert_pools_at_baseline(dep.router, ("decode",))  # decode gave back the pages it reserved
    dep.spawn("prefill")
    dep.wait_healthy()
    prompt, want = healthy_ref
    assert Client(dep.router, "ok-new-prefill", prompt).result(30).tokens == want
    assert_pools_at_baseline(dep.router)


@pytest.mark.slow  # worker processes killed and timed; in-process: test_disagg_scaleout, test_stalled_writers
def test_http_answers_503_with_an_openai_error_body_while_a_role_is_down(dep: Deployment, tiny_llama_dir: Path) -> None:
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import ServerThread

    app = build_app(dep.router, Tokenizer.from_dir(tiny_llama_dir), ApiSettings(dep.router.model_name))
    body = {"model": dep.router.model_name, "prompt": [5] * 10, "max_tokens": 2}
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        dep.procs["decode"].send_signal(signal.SIGSTOP)  # hung, not dead: only the silence tells
        try:
            wait_for(lambda: not dep.router.healthy()["decode"], WORKER_TIMEOUT_S + 5, "decode declared dead")
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
            health = httpx.get(f"{server.url}/health", timeout=10)
        finally:
            dep.procs["decode"].send_signal(signal.SIGCONT)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_healthy_worker", err
        assert "decode" in err["message"] and err["type"] == "server_error"
        assert health.status_code == 503
        # the hung worker wakes up, is told it is unknown, drops its state and registers again
        dep.wait_healthy(30)
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
    assert_pools_at_baseline(dep.router)


@pytest.mark.slow  # worker processes killed and timed; in-process: test_disagg_scaleout, test_stalled_writers
def test_router_restart_workers_register_with_the_new_router(
    dep: Deployment, healthy_ref: tuple[list[int], list[int]], slow_first: int
) -> None:
    c = Client(dep.router, "slow-router-restart", SLOW_PROMPT)
    wait_for(lambda: flight_state(dep.router, c.rid) is FlightState.DECODING, 15, "the transfer to start")
    dep.router.close(notify_workers=False)  # as if it crashed: no Shutdown reaches the workers
    c.result(5)
    assert_fault_failed_cleanly(c, slow_first)
    assert "router" in c.last.error
    dep.router = Router(secure_hub(port=dep.port), router_config())
    t0 = time.monotonic()
    dep.router.wait_for_workers(timeout=60)  # the workers notice the silence and register again
    dep.router.start()
    assert time.monotonic() - t0 < 30
    dep.wait_healthy()
    assert_pools_at_baseline(dep.router)  # they dropped the old router's requests
    prompt, want = healthy_ref
    assert Client(dep.router, "ok-new-router", prompt).result(30).tokens == want
    assert all(p.poll() is None for p in dep.procs.values())  # no worker had to restart
    assert_pools_at_baseline(dep.router)


@pytest.mark.slow
def test_worker_gives_up_and_exits_when_no_router_comes_back(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """With nobody answering, a worker that lost its router exits non-zero with a clear message."""
    hub = secure_hub()
    router = Router(hub, router_config())
    cmd = [sys.executable, "-m", "kvfence.commands.worker_main", "--model", str(tiny_llama_dir)]
    cmd += ["--context-length", str(CTX), "--router-address", hub.address, "--log-level", "WARNING"]
    cmd += ["--router-timeout-s", "1", "--reconnect-timeout-s", "1"]
    procs = {
        "prefill": subprocess.Popen([*cmd, "--role", "prefill"], stderr=subprocess.PIPE, env=worker_env()),
        "decode": subprocess.Popen(
            [*cmd, "--role", "decode", "--handoff-port", str(free_port())], stderr=subprocess.PIPE, env=worker_env()
        ),
    }
    try:
        router.wait_for_workers(timeout=120)
        router.start()
        router.close(notify_workers=False)
        for role, p in procs.items():
            _, err = p.communicate(timeout=30)
            assert p.returncode == 2, (role, err)
            assert b"router lost" in err, err
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)


def test_launcher_restarts_a_router_that_exits_and_gives_up_after_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfence.disagg.launcher import LaunchConfig, Launcher

    launcher = Launcher(LaunchConfig(max_router_restarts=2))
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    dies = [sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(5)"]
    starts: list[str] = []

    def command(slot: str) -> list[str]:
        starts.append(slot)
        return dies if slot == "router" else sleeper

    monkeypatch.setattr(launcher, "command", command)
    launcher.start()
    t0 = time.monotonic()
    assert launcher.watch() == 1  # the third exit is past the limit: everything stops, reported
    assert time.monotonic() - t0 < 15
    assert starts.count("router") == 3 and starts.count("prefill-0") == 1 and starts.count("decode-0") == 1
    assert launcher.router_restarts == 2
    assert {r: p.returncode for r, p in launcher.procs.items()} == {
        "router": 5,
        "prefill-0": -signal.SIGTERM,
        "decode-0": -signal.SIGTERM,
    }
