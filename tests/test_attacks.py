"""Attacks on a real `kvfence serve` from a separate process that can only reach its ports (tests/helpers/attacker.py):
a forged handoff for a victim's request, a malformed one to fail it, a 4 GiB frame header, rogue workers with
another key or none, replayed control and data traffic, and (Mooncake backend) writes into decode's memory. Each
attack worked against kvfence before its planes were authenticated (docs/handoff.md, "Trust model"); here each must
fail while the victim gets exactly its solo tokens with a `verified`, authenticated record, and every refusal is
counted in /metrics as a security event.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfence.auth.keys import ClusterKey, write_key_file
from kvfence.bench.launch import LaunchedServer, launch_server, rss_bytes
from tests.helpers.kv import WireClient

pytestmark = pytest.mark.slow
ATTACKER = str(Path(__file__).parent / "helpers" / "attacker.py")
PROMPT = [11 + (i * 7) % 1900 for i in range(1200)]  # long: prefill takes a while, the race window is wide
MODEL = "tiny"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    write_key_file(path, ClusterKey.generate())
    return path


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    args = ["--cluster-key-file", str(key_file), "--worker-timeout-s", "4", "--log-level", "warning"]
    args += ["--served-model-name", MODEL]
    with launch_server(
        "disagg", model=str(tiny_llama_dir), server_args=args, log_dir=tmp_path_factory.mktemp("serve"),
        ready_timeout_s=240,
    ) as s:  # fmt: skip
        yield s


def info(server: LaunchedServer) -> dict[str, Any]:
    """The router's part of /server_info (its workers, roles and auth), read live."""
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["engine"]


def decode_address(server: LaunchedServer) -> str:
    return next(w["handoff_address"] for w in info(server)["workers"].values() if w["role"] == "decode" and w["up"])


def control_port(server: LaunchedServer) -> int:
    m = re.search(r"control tcp://127\.0\.0\.1:(\d+)", server.log_path.read_text())
    assert m, server.log_tail()
    return int(m.group(1))


def security_events(server: LaunchedServer) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvfence_security_events":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["source"], sample.labels["kind"])] = sample.value
    return out


def post_completion(
    server: LaunchedServer, model: str, request_id: str, max_tokens: int = 8, prompt: list[int] = PROMPT
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0},
        headers={"X-Request-Id": request_id},
        timeout=120,
    )


def complete(
    server: LaunchedServer, model: str, request_id: str, max_tokens: int = 8, prompt: list[int] = PROMPT
) -> dict[str, Any]:
    r = post_completion(server, model, request_id, max_tokens, prompt)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(response: dict[str, Any]) -> list[str]:
    return response["choices"][0]["logprobs"]["tokens"]


def run_attacker(*args: str, ready: Path | None = None) -> subprocess.Popen[str]:
    """The attacker process; with `ready`, wait until it says its attack is under way."""
    extra = ["--ready-file", str(ready)] if ready is not None else []
    proc = subprocess.Popen([sys.executable, ATTACKER, *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})  # fmt: skip
    deadline = time.monotonic() + 120
    while ready is not None and not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    return proc


def result_of(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0 and out.strip(), err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_forged_handoff_for_a_victims_request_is_refused_and_the_victim_gets_its_own_tokens(
    server: LaunchedServer, tmp_path: Path
) -> None:
    solo = tokens_of(complete(server, MODEL, "solo-2"))
    before = security_events(server)
    attacker = run_attacker(
        "hijack", "--server", server.url, "--decode", decode_address(server), "--rid", "cmpl-victim-1-0",
        "--prompt-ids", json.dumps(PROMPT), "--seconds", "20", ready=tmp_path / "ready",
    )  # fmt: skip  # the attacker is polling decode for the victim's slot before the victim even asks
    victim = complete(server, MODEL, "victim-1")
    result = result_of(attacker)
    assert not result["accepted"], result
    assert tokens_of(victim) == solo
    record = victim["choices"][0]["kvfence"]["integrity"]
    assert record["status"] == "verified" and record["authenticated"] is True
    refused_before = sum(v for (src, kind), v in before.items() if kind == "handshake_failed")
    deadline = time.monotonic() + 10  # workers report their counts to the router every 250 ms
    while sum(v for (src, kind), v in security_events(server).items() if kind == "handshake_failed") <= refused_before:
        assert time.monotonic() < deadline, "the attacker's failed handshakes never reached the router's /metrics"
        time.sleep(0.25)


def test_a_malformed_manifest_from_outside_cannot_fail_the_victim(server: LaunchedServer, tmp_path: Path) -> None:
    solo = tokens_of(complete(server, MODEL, "solo-3"))
    attacker = run_attacker(
        "dos", "--decode", decode_address(server), "--rid", "cmpl-victim-2-0", "--seconds", "20", ready=tmp_path / "r"
    )
    victim = complete(server, MODEL, "victim-2")
    assert not result_of(attacker)["accepted"]
    assert tokens_of(victim) == solo and victim["choices"][0]["kvfence"]["integrity"]["status"] == "verified"


def test_a_handshake_answered_a_byte_a_second_is_dropped_at_the_handshake_timeout(server: LaunchedServer) -> None:
    decode = next(w for w in info(server)["workers"].values() if w["role"] == "decode" and w["up"])

    def failed() -> float:
        return sum(v for (_, kind), v in security_events(server).items() if kind == "handshake_failed")

    failed_before = failed()
    attackers = [run_attacker("dribble", "--decode", decode["handoff_address"], "--seconds", "20") for _ in range(4)]
    assert complete(server, MODEL, "during-dribble", max_tokens=4)["choices"][0]["kvfence"]["integrity"]["status"] == (
        "verified"
    )
    results = [result_of(a) for a in attackers]
    # decode's handshake timeout (5 s) bounds the whole answer, not each read: every byte came within a second
    assert all(r["hello_bytes"] == 40 and r["held_s"] is not None and r["held_s"] < 9 for r in results), results
    end = time.monotonic() + 10  # decode's counts reach the router's /metrics with its next load report
    while failed() < failed_before + 4 and time.monotonic() < end:
        time.sleep(0.25)
    assert failed() >= failed_before + 4


def test_a_4gib_frame_header_costs_decode_nothing_and_it_stays_healthy(server: LaunchedServer) -> None:
    decode = next(w for w in info(server)["workers"].values() if w["role"] == "decode" and w["up"])
    rss_before = rss_bytes([decode["pid"]])
    attackers = [run_attacker("header", "--decode", decode["handoff_address"], "--seconds", "12") for _ in range(4)]
    for i in range(4):  # the deployment serves on meanwhile, and decode is never declared dead
        assert (
            complete(server, MODEL, f"during-header-{i}", max_tokens=4)["choices"][0]["kvfence"]["integrity"]["status"]
            == "verified"
        )
    results = [result_of(a) for a in attackers]
    assert all(r["closed_by_peer"] for r in results), results  # dropped at the handshake, not held open
    rss_after = rss_bytes([decode["pid"]])
    assert rss_before is not None and rss_after is not None and rss_after - rss_before < 256 << 20
    now = next(w for w in info(server)["workers"].values() if w["role"] == "decode" and w["up"])
    assert now["pid"] == decode["pid"]  # the same process, never restarted
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def _start_worker(
    server: LaunchedServer, model_dir: Path, worker_id: str, key_args: list[str], log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvfence.commands.worker_main", "--role", "prefill", "--model", str(model_dir),
           "--router-address", f"tcp://127.0.0.1:{control_port(server)}", "--worker-id", worker_id,
           "--torch-threads", "1", *key_args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_KEY")}
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _routed(server: LaunchedServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        s.labels["worker"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvfence_worker_routed_requests"
        for s in f.samples
    }


def test_rogue_workers_without_the_key_get_no_traffic_and_evict_no_one_and_one_with_the_key_joins(
    server: LaunchedServer, tiny_llama_dir: Path, key_file: Path, tmp_path: Path
) -> None:
    other_key = tmp_path / "other.key"
    write_key_file(other_key, ClusterKey.generate())
    real = {wid: w["pid"] for wid, w in info(server)["workers"].items() if w["up"]}
    before = security_events(server).get(("router", "control_handshake_failed"), 0)
    rogues = [
        _start_worker(server, tiny_llama_dir, "prefill-0", ["--cluster-key-file", str(other_key)], tmp_path / "r1"),
        _start_worker(server, tiny_llama_dir, "prefill-rogue", ["--insecure-no-auth"], tmp_path / "r2"),
    ]
    try:
        deadline = time.monotonic() + 90
        while security_events(server).get(("router", "control_handshake_failed"), 0) < before + 2:
            assert time.monotonic() < deadline, "the rogue workers never knocked"
            time.sleep(1)
        for i in range(6):
            complete(server, MODEL, f"during-rogues-{i}", max_tokens=2)
        workers = info(server)["workers"]
        assert "prefill-rogue" not in workers
        assert {wid: w["pid"] for wid, w in workers.items() if w["up"]} == real  # nobody evicted or replaced
        assert set(_routed(server)) == set(real)
    finally:
        for p in rogues:
            p.kill()
            p.wait()
    member = _start_worker(server, tiny_llama_dir, "prefill-extra", ["--cluster-key-file", str(key_file)],
                           tmp_path / "m")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not info(server)["workers"].get("prefill-extra", {}).get("up"):
            assert time.monotonic() < deadline and member.poll() is None, (tmp_path / "m").read_text()
            time.sleep(1)
        for i in range(8):  # prompts that start differently: the same one would go back to the worker that cached it
            complete(server, MODEL, f"with-member-{i}", max_tokens=2, prompt=[1000 + i, *PROMPT[1:]])
        assert _routed(server).get("prefill-extra", 0) > 0  # it joined and takes traffic
    finally:
        member.kill()
        member.wait()


class _Recorder:
    """A TCP relay from one client to `target` that records the bytes the client sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.sent = target, bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket

        client = self.listener.accept()[0]
        upstream = socket.create_connection(self.target)

        def pump(a: socket.socket, b: socket.socket, record: bool) -> None:
            try:
                while data := a.recv(65536):
                    if record:
                        self.sent += data
                    b.sendall(data)
            except OSError:
                pass
            for x in (a, b):
                try:
                    x.close()
                except OSError:
                    pass

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)


def test_replayed_control_traffic_registers_nothing(
    server: LaunchedServer, tiny_llama_dir: Path, key_file: Path, tmp_path: Path
) -> None:
    """A real worker registers through a recording relay and goes away; its recorded bytes, replayed to the
    router's control port by the attacker, register nothing (CURVE's short-term keys make a recording useless)."""
    relay = _Recorder(("127.0.0.1", control_port(server)))
    cmd = [sys.executable, "-m", "kvfence.commands.worker_main", "--role", "prefill", "--model", str(tiny_llama_dir),
           "--router-address", f"tcp://127.0.0.1:{relay.port}", "--worker-id", "prefill-recorded",
           "--torch-threads", "1", "--cluster-key-file", str(key_file)]  # fmt: skip
    with open(tmp_path / "w.log", "wb") as f:
        worker = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not info(server)["workers"].get("prefill-recorded", {}).get("up"):
            assert time.monotonic() < deadline and worker.poll() is None, (tmp_path / "w.log").read_text()
            time.sleep(1)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 60
    while info(server)["workers"].get("prefill-recorded", {}).get("up"):  # declared dead (--worker-timeout-s 4)
        assert time.monotonic() < deadline
        time.sleep(1)
    recording = tmp_path / "control.hex"
    recording.write_text(bytes(relay.sent).hex())
    before = security_events(server).get(("router", "control_handshake_failed"), 0)
    result = result_of(run_attacker("replay", "--target", f"tcp://127.0.0.1:{control_port(server)}", "--recording",
                                    str(recording), "--seconds", "5"))  # fmt: skip
    assert result["sent"] > 0
    time.sleep(2)
    assert not info(server)["workers"].get("prefill-recorded", {}).get("up")
    assert security_events(server).get(("router", "control_handshake_failed"), 0) > before


def test_replayed_data_traffic_is_refused(server: LaunchedServer, key_file: Path, tmp_path: Path) -> None:
    """A key holder's data connection to decode, recorded; the recording replayed by the attacker is refused at the
    handshake (the receiver's challenge is fresh every time)."""
    from kvfence.auth.keys import read_key_file
    from kvfence.auth.plane import PlaneAuth

    address = decode_address(server)
    host, port = address.split("://")[1].rsplit(":", 1)
    relay = _Recorder((host, int(port)))
    with WireClient(f"tcp://127.0.0.1:{relay.port}", PlaneAuth(read_key_file(key_file))) as c:
        c.send({"t": "done", "rid": "nobody", "xid": "0" * 32, "pages": 0})
        time.sleep(0.5)
    recording = tmp_path / "data.hex"
    recording.write_text(bytes(relay.sent).hex())
    decode_id = next(wid for wid, w in info(server)["workers"].items() if w["role"] == "decode" and w["up"])

    def refused() -> float:
        return security_events(server).get((decode_id, "handshake_failed"), 0)

    before = refused()
    result_of(run_attacker("replay", "--target", address, "--recording", str(recording), "--seconds", "2"))
    deadline = time.monotonic() + 10  # workers report their counts every 250 ms
    while refused() <= before:
        assert time.monotonic() < deadline
        time.sleep(0.5)


@pytest.fixture(scope="module")
def mooncake_server(
    tiny_llama_dir: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedServer]:
    from kvfence.transfer.mooncake import mooncake_unavailable_reason

    reason = mooncake_unavailable_reason()
    if reason:
        pytest.skip(f"Mooncake unavailable: {reason}")
    args = ["--transfer-backend", "mooncake", "--cluster-key-file", str(key_file), "--log-level", "warning"]
    args += ["--served-model-name", MODEL]
    with launch_server(
        "disagg", label="mooncake", model=str(tiny_llama_dir), server_args=args,
        log_dir=tmp_path_factory.mktemp("serve-mc"), ready_timeout_s=240,
    ) as s:  # fmt: skip
        yield s


def test_a_mooncake_peer_writing_into_every_buffer_it_finds_never_gets_a_request_served_over_its_bytes(
    mooncake_server: LaunchedServer, tmp_path: Path
) -> None:
    server = mooncake_server
    solo = tokens_of(complete(server, MODEL, "mc-solo", max_tokens=48))
    attacker = run_attacker(
        "mooncake", "--decode", decode_address(server), "--seconds", "15", "--min-rounds", "5", ready=tmp_path / "r"
    )
    outcomes: list[str] = []
    while attacker.poll() is None:  # handoffs in flight for as long as the attacker looks for buffers to write
        r = post_completion(server, MODEL, f"mc-victim-{len(outcomes)}", max_tokens=48)
        if r.status_code == 200:  # served: only over its own, verified KV
            body = r.json()
            assert body["choices"][0]["kvfence"]["integrity"]["status"] == "verified", body
            assert tokens_of(body) == solo, body
            outcomes.append("verified")
        else:  # or failed cleanly, as an OpenAI-style error
            assert "error" in r.json(), r.text
            outcomes.append(str(r.status_code))
    result = result_of(attacker)
    print("mooncake attacker:", result, "victims:", outcomes)
    assert not result["hello_told_session"], result  # nothing before authentication names decode's engine
    assert result["rounds"] >= 5 and outcomes, (result, outcomes)
    after = complete(server, MODEL, "mc-after", max_tokens=48)  # the deployment is whole after the attack
    assert tokens_of(after) == solo
    assert after["choices"][0]["kvfence"]["integrity"]["status"] == "verified"
