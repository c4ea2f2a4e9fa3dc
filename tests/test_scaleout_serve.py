"""`kvfence serve --prefill-workers 2 --decode-workers 2` as a client sees it, while workers are killed under load.

Real processes throughout: the launcher, a router, two prefill and two decode workers. Under concurrent
load, one prefill and one decode worker are killed with SIGKILL while each has a KV transfer in flight
(prefill throttles the KV of requests whose id starts with "slow", so transfers stay open). Then:
no request hangs; every failure is a 500 naming a killed worker (nothing else fails, nothing gets a 200
with wrong tokens); every 200 has the aggregated engine's output and a verified handoff; the launcher
restarts both workers in their slots, they register again and take traffic; every pool is back to
baseline. Last, the router is killed: the launcher restarts it and the same worker processes register
with it again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.bench.launch import LaunchedServer, descendants, launch_server
from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams

CTX = 256
WORKER_TIMEOUT_S = 2.0
FLAGS = [
    *("--prefill-workers", "2", "--decode-workers", "2", "--context-length", str(CTX)),
    *("--prefill-max-total-tokens", "1024", "--decode-max-total-tokens", "2048"),
    *("--worker-timeout-s", str(WORKER_TIMEOUT_S), "--router-timeout-s", "2", "--handoff-deadline-s", "10"),
    *("--throttle-kv-send", "0.12@cmpl-slow", "--log-level", "warning"),
]
Req = tuple[str, list[int], int]


def make_requests(n: int, seed: int, slow_every: int = 2) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        slow = slow_every and i % slow_every == 0
        length = 64 if slow else rng.randrange(8, 90)
        out.append(
            (
                f"{'slow' if slow else 'fast'}-{seed}-{i}",
                [rng.randrange(10, 2000) for _ in range(length)],
                rng.randrange(8, 24),
            )
        )
    return out


def reference(model_dir: Path, reqs: list[Req]) -> dict[str, str]:
    """The texts the aggregated engine gives these greedy requests."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 8192), context_length=CTX))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, _, n in reqs]
    outs = engine.generate([p for _, p, _ in reqs], params)
    return {rid: o.text for (rid, _, _), o in zip(reqs, outs, strict=True)}


def workers(url: str) -> dict[str, Any]:
    """Worker id -> the router's view (pid, up, reported load), from /server_info."""
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    out = {}
    for wid, w in info["stats"]["workers"].items():
        out[wid] = {**w, "pid": info["engine"]["workers"].get(wid, {}).get("pid")}
    return out


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def at_baseline(url: str) -> bool:
    ws = workers(url)
    return len(ws) == 4 and all(
        w["up"] and w.get("pages_total") and w["pages_free"] == w["pages_total"] and w["pages_quarantined"] == 0
        for w in ws.values()
    )


async def send_all(
    server: LaunchedServer, model: str, reqs: list[Req], kill: bool
) -> tuple[dict[str, tuple[int, dict[str, Any], float]], tuple[str, ...]]:
    """All `reqs` at concurrency 8; with `kill`, SIGKILL a prefill and a decode worker that each have a
    transfer in flight. Returns rid -> (status, body, seconds) and the killed worker ids."""
    results: dict[str, tuple[int, dict[str, Any], float]] = {}
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

        async def one(rid: str, prompt: list[int], n: int) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            async with sem:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
                results[rid] = (r.status_code, r.json(), time.monotonic() - t0)

        async def killer() -> tuple[str, ...]:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                ws = await asyncio.to_thread(workers, server.url)
                busy = {
                    role: [w for w, x in ws.items() if x["role"] == role and x["up"] and x.get("handoffs_in_flight")]
                    for role in ("prefill", "decode")
                }
                if busy["prefill"] and busy["decode"]:
                    victims = (busy["prefill"][0], busy["decode"][0])
                    for wid in victims:
                        os.kill(ws[wid]["pid"], signal.SIGKILL)
                    return victims
                await asyncio.sleep(0.02)
            raise AssertionError("never saw a transfer in flight on a prefill and a decode worker at once")

        jobs = [one(*r) for r in reqs]
        if kill:
            killed, *_ = await asyncio.gather(killer(), *jobs)
            return results, killed
        await asyncio.gather(*jobs)
    return results, ()


def assert_served_exactly(results: dict[str, tuple[int, dict[str, Any], float]], want: dict[str, str]) -> None:
    for rid, (status, body, _) in results.items():
        if status == 200:
            choice = body["choices"][0]
            assert choice["text"] == want[rid], rid
            assert choice["kvfence"]["integrity"]["status"] == "verified", (rid, choice["kvfence"])


def router_pid(server: LaunchedServer) -> int:
    for pid in descendants(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvfence.commands.worker_main" in cmd and cmd[cmd.index(b"--role") + 1] == b"router":
            return pid
    raise AssertionError("no router process under the launcher")


@pytest.mark.slow
def test_two_by_two_survives_kill_9_of_a_prefill_and_a_decode_during_transfers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = tiny_llama_dir.name
    load, after = make_requests(48, seed=1), make_requests(16, seed=2, slow_every=0)
    want = reference(tiny_llama_dir, [*load, *after])
    with launch_server(
        "disagg", model=str(tiny_llama_dir), server_args=FLAGS, log_dir=tmp_path, ready_timeout_s=300
    ) as s:
        before = workers(s.url)
        assert sorted(before) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        assert all(w["up"] for w in before.values())

        results, killed = asyncio.run(send_all(s, model, load, kill=True))

        # no hang, no 5xx but for the requests on the killed workers, no wrong tokens
        assert len(results) == len(load)
        assert max(t for _, _, t in results.values()) < 60
        failed = {rid: body for rid, (status, body, _) in results.items() if status != 200}
        assert failed, "the kills hit no request"
        for rid, body in failed.items():
            status = results[rid][0]
            message = body["error"]["message"]
            assert status == 500 and any(w in message for w in killed), (rid, status, message)
        assert_served_exactly(results, want)
        assert len(failed) < len(load) // 2, sorted(failed)

        # the launcher restarted both in their slots; they registered again; every pool is back to baseline
        wait_for(
            lambda: all(workers(s.url)[w]["up"] and workers(s.url)[w]["pid"] != before[w]["pid"] for w in killed),
            120,
            "the killed workers to be restarted and registered",
        )
        wait_for(lambda: at_baseline(s.url), 30, "every pool back to baseline")
        stats = httpx.get(f"{s.url}/server_info", timeout=10).json()["stats"]
        assert stats["worker_deaths"] == {"prefill": 1, "decode": 1}

        # new requests are served by all four, the restarted ones included
        results, _ = asyncio.run(send_all(s, model, after, kill=False))
        assert {status for status, _, _ in results.values()} == {200}, _failures(results)
        assert_served_exactly(results, want)
        ws = workers(s.url)
        assert all(ws[w]["routed"] > 0 for w in killed), {w: ws[w]["routed"] for w in ws}
        wait_for(lambda: at_baseline(s.url), 30, "every pool back to baseline")

        # a router restart keeps the workers: the same processes register with the new router
        pids = {w: x["pid"] for w, x in workers(s.url).items()}
        os.kill(router_pid(s), signal.SIGKILL)
        wait_for(lambda: _health(s.url) == 503 or _health(s.url) is None, 10, "the router to go away")
        wait_for(lambda: _health(s.url) == 200, 120, "the restarted router to serve")
        assert {w: x["pid"] for w, x in workers(s.url).items()} == pids
        results, _ = asyncio.run(send_all(s, model, after[:4], kill=False))
        assert {status for status, _, _ in results.values()} == {200}, _failures(results)
        assert_served_exactly(results, want)


def _failures(results: dict[str, Any]) -> dict[str, Any]:
    """The requests that did not get 200, with what they got: the assertion's message."""
    return {rid: (status, body) for rid, (status, body, _) in results.items() if status != 200}


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
