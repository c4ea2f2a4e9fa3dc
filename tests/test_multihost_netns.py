"""Prefill and decode on two "hosts": separate network namespaces on this machine, each with its own address.

The test builds the topology itself (root only; skipped with the reason otherwise) and
removes it even when it fails:

    root namespace (router, HTTP on loopback)
      bridge <br> 10.231.K.1/24 ──veth── prefill ns  <p>  10.231.K.2/24  (control)
                               └─veth── decode ns   <d>  10.231.K.3/24  (control)
      prefill ns 10.231.K+1.1/24 ─────veth───── decode ns 10.231.K+1.2/24  (KV data plane)

The router binds its control port on the bridge address only; decode's data plane
listens on its data-link address only, so the KV bytes cannot take a loopback
shortcut. docs/multihost.md gives the same recipe for real separate hosts. Traffic
goes to loopback and these private addresses only.
"""

from __future__ import annotations

import os
import shutil
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
from kvfence.disagg import protocol as P
from kvfence.disagg.router import Router, RouterConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams

CTX = 256
DEADLINE_S = 3.0
DECODE_KV_PORT = 47011  # decode's data-plane port inside its own fresh namespace, where every port is free
WORKER_TIMEOUT_S = 1.5


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
    k: int  # control subnet 10.231.k.0/24, data subnet 10.231.(k+1).0/24

    @property
    def prefill_ns(self) -> str:
        return f"{self.tag}p"

    @property
    def decode_ns(self) -> str:
        return f"{self.tag}d"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def router_host(self) -> str:
        return f"10.231.{self.k}.1"

    @property
    def decode_data_host(self) -> str:
        return f"10.231.{self.k + 1}.2"

    def up(self) -> None:
        k, t = self.k, self.tag
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.router_host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, host in ((self.prefill_ns, 2), (self.decode_ns, 3)):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            outer, inner = f"{ns}o", f"{ns}c"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"10.231.{k}.{host}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
        _ip("link", "add", f"{t}pk", "type", "veth", "peer", "name", f"{t}dk")  # the KV link
        _ip("link", "set", f"{t}pk", "netns", self.prefill_ns)
        _ip("link", "set", f"{t}dk", "netns", self.decode_ns)
        _ip("addr", "add", f"10.231.{k + 1}.1/24", "dev", f"{t}pk", ns=self.prefill_ns)
        _ip("addr", "add", f"{self.decode_data_host}/24", "dev", f"{t}dk", ns=self.decode_ns)
        _ip("link", "set", f"{t}pk", "up", ns=self.prefill_ns)
        _ip("link", "set", f"{t}dk", "up", ns=self.decode_ns)

    def set_kv_link(self, up: bool) -> None:
        _ip("link", "set", f"{self.tag}dk", "up" if up else "down", ns=self.decode_ns)

    def set_decode_control_link(self, up: bool) -> None:
        _ip("link", "set", f"{self.decode_ns}c", "up" if up else "down", ns=self.decode_ns)

    def down(self) -> None:
        for ns in (self.prefill_ns, self.decode_ns):  # deleting a namespace deletes its veth ends and their peers
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 4096), context_length=CTX))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], [sp])[0].token_ids


class TwoHosts:
    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.topo = Topology(tag=f"kvf{os.getpid() % 10000}", k=100 + 2 * (os.getpid() % 60))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.topo.up()
        self.hub = P.ZmqHub(self.topo.router_host, 0)
        self.router = Router(
            self.hub,
            RouterConfig(handoff_deadline_s=DEADLINE_S, request_timeout_s=30, worker_timeout_s=WORKER_TIMEOUT_S),
        )
        common = [sys.executable, "-m", "kvfence.disagg.worker_main", "--model", str(model_dir)]
        common += ["--context-length", str(CTX), "--router-address", self.hub.address, "--log-level", "WARNING"]
        common += ["--exit-with-parent", "--handoff-deadline-s", str(DEADLINE_S), "--router-timeout-s", "2"]
        prefill = [*common, "--role", "prefill", "--max-total-tokens", "1024", "--throttle-kv-send", "0.5@slow"]
        decode = [*common, "--role", "decode", "--max-total-tokens", "2048"]
        decode += ["--handoff-host", self.topo.decode_data_host, "--handoff-port", str(DECODE_KV_PORT)]
        for ns, cmd in ((self.topo.prefill_ns, prefill), (self.topo.decode_ns, decode)):
            log = open(log_dir / f"{ns}.log", "wb")  # noqa: SIM115
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=log, stderr=subprocess.STDOUT))
            log.close()
        self.router.wait_for_workers(timeout=120)
        self.router.start()

    def close(self) -> None:
        try:
            self.router.close()
            for p in self.procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            self.topo.down()


@pytest.fixture(scope="module")
def two_hosts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    hosts: TwoHosts | None = None
    try:
        hosts = TwoHosts(tiny_llama_dir, tmp_path_factory.mktemp("netns"))
        yield hosts
    finally:
        if hosts is not None:
            hosts.close()
        else:  # failed half-way through set-up: remove whatever exists
            Topology(tag=f"kvf{os.getpid() % 10000}", k=0).down()


@pytest.fixture(scope="module")
def server(two_hosts: TwoHosts, tiny_llama_dir: Path) -> Iterator[str]:
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import ServerThread

    app = build_app(two_hosts.router, Tokenizer.from_dir(tiny_llama_dir), ApiSettings(two_hosts.router.model_name))
    with ServerThread(app) as s:
        yield s.url


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def wait_pools(router: Router, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    roles: dict[str, Any] = {}
    while time.monotonic() < deadline:
        roles = router.stats()["roles"]
        if set(roles) == {"prefill", "decode"} and all(
            r["pages_free"] == r["pages_total"] and r["pages_quarantined"] == 0 for r in roles.values()
        ):
            return roles
        time.sleep(0.1)
    raise AssertionError(f"pools not back to baseline: {roles}")


def test_prefill_and_decode_in_separate_namespaces_serve_through_the_router(
    two_hosts: TwoHosts, server: str, tiny_llama_dir: Path
) -> None:
    info = two_hosts.router.server_info()["roles"]
    assert info["decode"]["handoff_address"] == f"tcp://{two_hosts.topo.decode_data_host}:{DECODE_KV_PORT}"
    prompt = [3 + i % 17 for i in range(45)]
    r = complete(server, two_hosts.router.model_name, prompt, 6)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["kvfence"]["integrity"]["status"] == "verified"
    want = reference(tiny_llama_dir, prompt, 6)
    from kvfence.models.tokenizer import Tokenizer

    assert choice["text"] == Tokenizer.from_dir(tiny_llama_dir).decode(want)
    # the KV link really carried the bytes: decode's data-plane interface counted them
    stats = _ip("-s", "link", "show", f"{two_hosts.topo.tag}dk", ns=two_hosts.topo.decode_ns).stdout
    rx_bytes = int(stats.split("RX:")[1].splitlines()[1].split()[0])
    assert rx_bytes > 3 * 16 * 2 * 2 * 2 * 16 * 4  # 3 pages of K and V, 2 layers, 2 KV heads x 16, fp32
    wait_pools(two_hosts.router)


def test_kv_link_cut_mid_transfer_fails_the_request_and_frees_both_pools(
    two_hosts: TwoHosts, server: str, tiny_llama_dir: Path
) -> None:
    router = two_hosts.router
    result: dict[str, Any] = {}

    async def run() -> None:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        result["chunks"] = [c async for c in router.generate("slow-cut", [13] * 64, sp)]

    def main() -> None:
        import asyncio

        asyncio.run(run())

    t0 = time.monotonic()
    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not (router._flights.get("slow-cut") and router._flights["slow-cut"].phase == "decoding"):
        assert time.monotonic() < deadline, "transfer never started"
        time.sleep(0.02)
    two_hosts.topo.set_kv_link(False)
    try:
        thread.join(DEADLINE_S + 10)
        assert not thread.is_alive(), "request hung after the network cut"
        elapsed = time.monotonic() - t0
        last = result["chunks"][-1]
        assert last.finish_reason == "error" and not [t for c in result["chunks"] for t in c.token_ids]
        assert last.integrity["reason"] in ("timeout", "aborted", "transfer_error"), last.integrity
        assert elapsed < DEADLINE_S + 8
        wait_pools(router, timeout=DEADLINE_S * 2 + 10)  # both sides free their pages after the deadline
    finally:
        two_hosts.topo.set_kv_link(True)
    prompt = [4 + i % 11 for i in range(30)]
    r = complete(server, router.model_name, prompt, 5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["kvfence"]["integrity"]["status"] == "verified"
    wait_pools(router)


def test_decode_host_unreachable_gives_503_then_it_rejoins(two_hosts: TwoHosts, server: str) -> None:
    router = two_hosts.router
    two_hosts.topo.set_decode_control_link(False)
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT_S + 5
        while router.healthy()["decode"]:
            assert time.monotonic() < deadline, "router never noticed the unreachable decode host"
            time.sleep(0.05)
        r = complete(server, router.model_name, [5] * 10, 2)
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
    finally:
        two_hosts.topo.set_decode_control_link(True)
    deadline = time.monotonic() + 30
    while not router.healthy()["decode"]:  # it re-registers once the link is back
        assert time.monotonic() < deadline, "decode never registered again"
        time.sleep(0.1)
    r = complete(server, router.model_name, [6] * 20, 3)
    assert r.status_code == 200, r.text
    wait_pools(router)
