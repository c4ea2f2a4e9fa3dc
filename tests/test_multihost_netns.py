"""Two prefill and two decode "hosts": network namespaces on this machine, each with its own addresses.

The test builds the topology itself (root only; skipped with the reason otherwise) and
removes it even when it fails:

    root namespace: router (control bridge address, HTTP on loopback)
      control bridge <br> 10.231.K.1/24 ──veth── p0 .2, p1 .3, d0 .4, d1 .5   (registration, orders, tokens)
      KV bridge      <kv> (no address)  ──veth── p0 10.231.K+1.2, p1 .3, d0 .4, d1 .5   (KV data plane)

The router binds its control port on the bridge address only; each decode's data plane
listens on its KV address only, so the KV bytes cannot take a loopback shortcut, and
every prefill reaches every decode across the KV bridge. docs/multihost.md gives the same
recipe for real separate hosts. Traffic goes to loopback and these private addresses only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg.router import FlightState, Router, RouterConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.auth import secure_hub, worker_env

CTX = 256
DEADLINE_S = 3.0
DECODE_KV_PORT = 47011  # each decode's data-plane port inside its own fresh namespace, where every port is free
WORKER_TIMEOUT_S = 1.5
# Four worker processes, link cuts and worker deaths with deadlines: long and timing-bound.
pytestmark = pytest.mark.slow
HOSTS = {"p0": 2, "p1": 3, "d0": 4, "d1": 5}  # namespace suffix -> host number on both subnets
WORKER_IDS = {"p0": "prefill-0", "p1": "prefill-1", "d0": "decode-0", "d1": "decode-1"}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=20)


def netns_unavailable() -> str | None:
    """Why this machine cannot host the test (None when it can)."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"kvfprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Topology:
    tag: str
    k: int  # control subnet 10.231.k.0/24, KV subnet 10.231.(k+1).0/24

    def ns(self, host: str) -> str:
        return f"{self.tag}{host}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def kv_bridge(self) -> str:
        return f"{self.tag}kv"

    @property
    def router_host(self) -> str:
        return f"10.231.{self.k}.1"

    def kv_host(self, host: str) -> str:
        return f"10.231.{self.k + 1}.{HOSTS[host]}"

    def kv_link(self, host: str) -> str:
        return f"{self.ns(host)}k"

    def up(self) -> None:
        for br, addr in ((self.bridge, f"{self.router_host}/24"), (self.kv_bridge, None)):
            _ip("link", "add", br, "type", "bridge")
            if addr:
                _ip("addr", "add", addr, "dev", br)
            _ip("link", "set", br, "up")
        for host, n in HOSTS.items():
            ns = self.ns(host)
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            for br, inner, outer, subnet in (
                (self.bridge, f"{ns}c", f"{ns}o", self.k),
                (self.kv_bridge, f"{ns}k", f"{ns}x", self.k + 1),
            ):
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", br)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"10.231.{subnet}.{n}/24", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)

    def set_kv_link(self, host: str, up: bool) -> None:
        _ip("link", "set", self.kv_link(host), "up" if up else "down", ns=self.ns(host))

    def set_control_link(self, host: str, up: bool) -> None:
        _ip("link", "set", f"{self.ns(host)}c", "up" if up else "down", ns=self.ns(host))

    def rx_bytes(self, host: str) -> int:
        out = _ip("-s", "link", "show", self.kv_link(host), ns=self.ns(host)).stdout
        return int(out.split("RX:")[1].splitlines()[1].split()[0])

    def down(self) -> None:
        for host in HOSTS:  # deleting a namespace deletes its veth ends and their peers
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)
        for br in (self.bridge, self.kv_bridge):
            subprocess.run(["ip", "link", "del", br], capture_output=True)


def reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 4096), context_length=CTX))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], [sp])[0].token_ids


class Hosts:
    """The router in the root namespace; a worker process in each of the four host namespaces."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.topo = Topology(tag=f"kvf{os.getpid() % 10000}", k=100 + 2 * (os.getpid() % 60))
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.all_procs: list[subprocess.Popen[bytes]] = []
        self.topo.up()
        self.hub = secure_hub(self.topo.router_host, 0)
        self.router = Router(
            self.hub,
            RouterConfig(
                handoff_deadline_s=DEADLINE_S,
                request_timeout_s=30,
                worker_timeout_s=WORKER_TIMEOUT_S,
                wait_prefill_workers=2,
                wait_decode_workers=2,
            ),
        )
        common = [sys.executable, "-m", "kvfence.commands.worker_main", "--model", str(model_dir)]
        common += ["--context-length", str(CTX), "--router-address", self.hub.address, "--log-level", "WARNING"]
        common += ["--exit-with-parent", "--handoff-deadline-s", str(DEADLINE_S), "--router-timeout-s", "2"]
        common += ["--torch-threads", "1"]
        self.common = common
        for host in HOSTS:
            self.start(host)
        self.router.wait_for_workers(timeout=180)
        self.router.start()

    def start(self, host: str) -> None:
        """Start (or start again) the worker of `host` in its namespace."""
        wid = WORKER_IDS[host]
        cmd = [*self.common, "--worker-id", wid]
        if host.startswith("p"):
            cmd += ["--role", "prefill", "--max-total-tokens", "1024", "--throttle-kv-send", "0.5@slow"]
        else:
            cmd += ["--role", "decode", "--max-total-tokens", "2048"]
            cmd += ["--handoff-host", self.topo.kv_host(host), "--handoff-port", str(DECODE_KV_PORT)]
        log = open(self.log_dir / f"{wid}-{len(self.all_procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.topo.ns(host), *cmd], stdout=log, stderr=subprocess.STDOUT, env=worker_env()
        )
        log.close()
        self.procs[host] = proc
        self.all_procs.append(proc)

    def close(self) -> None:
        try:
            self.router.close()
            for p in self.all_procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            self.topo.down()


@pytest.fixture(scope="module")
def hosts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    made: Hosts | None = None
    try:
        made = Hosts(tiny_llama_dir, tmp_path_factory.mktemp("netns"))
        yield made
    finally:
        if made is not None:
            made.close()
        else:  # failed half-way through set-up: remove whatever exists
            Topology(tag=f"kvf{os.getpid() % 10000}", k=0).down()


@pytest.fixture(scope="module")
def server(hosts: Hosts, tiny_llama_dir: Path) -> Iterator[str]:
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import ServerThread

    app = build_app(hosts.router, Tokenizer.from_dir(tiny_llama_dir), ApiSettings(hosts.router.model_name))
    with ServerThread(app) as s:
        yield s.url


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def wait_pools(router: Router, timeout: float = 15) -> dict[str, Any]:
    """Every up worker's pool fully free, nothing quarantined (all four up)."""
    deadline = time.monotonic() + timeout
    ws: dict[str, Any] = {}
    while time.monotonic() < deadline:
        ws = router.stats()["workers"]
        up = [w for w in ws.values() if w["up"] and "pages_total" in w]
        if len(up) == 4 and all(w["pages_free"] == w["pages_total"] and w["pages_quarantined"] == 0 for w in up):
            return ws
        time.sleep(0.1)
    raise AssertionError(f"pools not back to baseline: {ws}")


def routed(router: Router) -> dict[str, int]:
    return {wid: w["routed"] for wid, w in router.stats()["workers"].items() if w["up"]}


def complete_many(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*[client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts])

    return asyncio.run(main())


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_hosts_per_role_serve_through_the_router_over_the_kv_bridge(
    hosts: Hosts, server: str, tiny_llama_dir: Path
) -> None:
    from kvfence.models.tokenizer import Tokenizer

    info = hosts.router.server_info()["workers"]
    for host in ("d0", "d1"):
        assert info[WORKER_IDS[host]]["handoff_address"] == f"tcp://{hosts.topo.kv_host(host)}:{DECODE_KV_PORT}"
    rx = {h: hosts.topo.rx_bytes(h) for h in ("d0", "d1")}
    prompts = [[3 + (i * 5 + j) % 17 for j in range(45 + i)] for i in range(8)]
    answers = complete_many(server, hosts.router.model_name, prompts, 6)
    tok = Tokenizer.from_dir(tiny_llama_dir)
    for prompt, r in zip(prompts, answers, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["kvfence"]["integrity"]["status"] == "verified"
        assert choice["text"] == tok.decode(reference(tiny_llama_dir, prompt, 6))
    assert all(n > 0 for n in routed(hosts.router).values()), routed(hosts.router)  # all four hosts served
    # each decode's KV interface carried KV bytes: at least 3 pages of K and V, 2 layers, 2 KV heads x 16, fp32
    for host in ("d0", "d1"):
        assert hosts.topo.rx_bytes(host) - rx[host] > 3 * 16 * 2 * 2 * 2 * 16 * 4, host
    wait_pools(hosts.router)


def test_kv_link_cut_mid_transfer_fails_the_request_and_frees_every_pool(
    hosts: Hosts, server: str, tiny_llama_dir: Path
) -> None:
    router = hosts.router
    result: dict[str, Any] = {}

    async def run() -> None:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        result["chunks"] = [c async for c in router.generate("slow-cut", [13] * 64, sp)]

    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    wait_until(
        lambda: (
            router._flights.get("slow-cut") is not None and router._flights["slow-cut"].state is FlightState.DECODING
        ),
        15,
        "the transfer to start",
    )
    host = next(h for h, w in WORKER_IDS.items() if w == router._flights["slow-cut"].decode_id)
    hosts.topo.set_kv_link(host, False)
    try:
        thread.join(DEADLINE_S + 10)
        assert not thread.is_alive(), "request hung after the network cut"
        elapsed = time.monotonic() - t0
        last = result["chunks"][-1]
        assert last.finish_reason == "error"
        # at most the first token, which prefill sampled from this prompt's own KV before decode's verdict
        own_first = reference(tiny_llama_dir, [13] * 64, 1) if last.integrity.get("tokens_before_verdict") else []
        assert [t for c in result["chunks"] for t in c.token_ids] == own_first, last.integrity
        assert last.integrity["reason"] in ("timeout", "aborted", "transfer_error"), last.integrity
        assert elapsed < DEADLINE_S + 8
        wait_pools(router, timeout=DEADLINE_S * 2 + 10)  # both sides free their pages after the deadline
    finally:
        hosts.topo.set_kv_link(host, True)
    answers = complete_many(server, router.model_name, [[4 + i % 11 for i in range(30 + n)] for n in range(4)], 5)
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["kvfence"]["integrity"]["status"] == "verified"
    wait_pools(router)


def test_an_unreachable_decode_host_leaves_its_traffic_to_the_other_then_rejoins(hosts: Hosts, server: str) -> None:
    router = hosts.router
    hosts.topo.set_control_link("d0", False)
    try:
        wait_until(lambda: not router.stats()["workers"]["decode-0"]["up"], WORKER_TIMEOUT_S + 5, "decode-0 down")
        before = routed(router)
        answers = complete_many(server, router.model_name, [[5 + n] * 10 for n in range(4)], 2)
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]  # the other decode serves
        assert routed(router)["decode-1"] - before["decode-1"] == 4
    finally:
        hosts.topo.set_control_link("d0", True)
    wait_until(lambda: router.stats()["workers"]["decode-0"]["up"], 30, "decode-0 to register again")
    assert routed(router)["decode-0"] == 0  # a fresh registration
    answers = complete_many(server, router.model_name, [[6 + n] * 20 for n in range(6)], 3)
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert routed(router)["decode-0"] > 0  # it takes traffic again
    wait_pools(router)


def test_a_prefill_host_killed_and_started_again_registers_and_takes_traffic(hosts: Hosts, server: str) -> None:
    router = hosts.router
    old = hosts.procs["p1"]
    old.send_signal(signal.SIGKILL)  # `ip netns exec` execs the worker: this is the worker process
    old.wait(10)
    wait_until(lambda: not router.stats()["workers"]["prefill-1"]["up"], WORKER_TIMEOUT_S + 5, "prefill-1 down")
    answers = complete_many(server, router.model_name, [[7 + n] * 25 for n in range(4)], 2)
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    hosts.start("p1")
    wait_until(lambda: router.stats()["workers"]["prefill-1"]["up"], 120, "the new prefill-1 to register")
    answers = complete_many(server, router.model_name, [[8 + n] * 25 for n in range(6)], 2)
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert routed(router)["prefill-1"] > 0  # the new process takes traffic
    assert router.stats()["worker_deaths"]["prefill"] >= 1
    wait_pools(router)
