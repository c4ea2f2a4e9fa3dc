"""`kvfence serve` (router + prefill + decode processes) as a client sees it: what may not enter, faults aimed
at some requests from outside, and the one meaning of --allow-context-above-pool in every mode.

The innocent-bystander property: requests running next to ones whose handoff is broken on purpose get
exactly the tokens they get alone, and the broken ones fail cleanly with their integrity record.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.bench.launch import LaunchedServer, launch_server
from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.auth import worker_env

CTX = 256
FAULTS = "placeholder_handoff@*victim*,corrupt_byte@*corrupt*#1"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    args = ["--context-length", str(CTX), "--prefill-max-total-tokens", "1024", "--decode-max-total-tokens", "2048"]
    with launch_server(
        "disagg",
        model=str(tiny_llama_dir),
        server_args=[*args, "--inject-fault", FAULTS, "--log-level", "warning"],
        log_dir=tmp_path_factory.mktemp("serve"),
        ready_timeout_s=180,
    ) as s:
        yield s


def body(model_dir: Path, prompt: list[int], max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"model": model_dir.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def solo_text(model_dir: Path, prompt: list[int], max_tokens: int = 6) -> str:
    """The text a greedy request gets alone, in one engine (the oracle of disaggregated serving)."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir)), CacheConfig(16, 4096), context_length=CTX))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0].text


def integrity_counts(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/server_info", timeout=10).json()["stats"]["integrity"]


def test_out_of_vocabulary_ids_get_400_before_any_worker_sees_them(
    server: LaunchedServer, tiny_llama_dir: Path
) -> None:
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["api"]["vocab_size"] == 2048 and info["engine"]["vocab_size"] == 2048
    before = integrity_counts(server.url)
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/completions", json=body(tiny_llama_dir, [5, 999999], stream=stream))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "prompt" and "vocabulary" in err["message"]
    assert integrity_counts(server.url) == before  # no request reached a worker: no record was made
    r = httpx.post(f"{server.url}/v1/completions", json=body(tiny_llama_dir, [5, 2047]), timeout=60)
    assert r.status_code == 200, r.text


def test_faults_aimed_at_some_requests_leave_their_neighbours_token_identical(
    server: LaunchedServer, tiny_llama_dir: Path
) -> None:
    innocents = [[11 + (i * 7 + j) % 1900 for j in range(n)] for i, n in enumerate((1, 17, 33, 60, 90, 120))]
    victims = {"victim-1": [3] * 40, "corrupt-1": [4] * 40}  # both ids are matched by the flag's patterns

    async def main() -> tuple[list[httpx.Response], dict[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            good = [client.post("/v1/completions", json=body(tiny_llama_dir, p, ignore_eos=True)) for p in innocents]
            bad = [
                client.post("/v1/completions", json=body(tiny_llama_dir, p), headers={"X-Request-Id": rid})
                for rid, p in victims.items()
            ]
            answers = await asyncio.gather(*good, *bad)
        return answers[: len(good)], dict(zip(victims, answers[len(good) :], strict=True))

    good, bad = asyncio.run(main())
    for prompt, r in zip(innocents, good, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["kvfence"]["integrity"]["status"] == "verified"
        assert choice["text"] == solo_text(tiny_llama_dir, prompt)
    reasons = {"victim-1": "token_count_mismatch", "corrupt-1": "digest_mismatch"}
    for rid, r in bad.items():
        assert r.status_code == 500, r.text
        record = r.json()["kvfence"]["integrity"][0]
        assert record["status"] == "rejected" and record["reason"] == reasons[rid], record
        assert r.json()["error"]["type"] == "server_error"


def test_a_stream_that_fails_after_the_200_ends_with_an_openai_error_event(
    server: LaunchedServer, tiny_llama_dir: Path
) -> None:
    headers = {"X-Request-Id": "victim-stream"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body(tiny_llama_dir, [9] * 40, stream=True), headers=headers
    ) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines[:-1]]
    finish = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    assert all(f is None for f in finish), finish  # no made-up finish_reason such as "error"
    last = events[-1]
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["type"] == "server_error"
    assert last["kvfence"]["integrity"][0]["reason"] == "token_count_mismatch"
    # before the error: prefill's first token (its own KV, streamed before the verdict), and nothing of decode's
    assert last["kvfence"]["integrity"][0]["tokens_before_verdict"] == 1
    text = "".join(c.get("text", "") for e in events[:-1] for c in e.get("choices", []))
    assert text == solo_text(tiny_llama_dir, [9] * 40, max_tokens=1)
    assert all(e.get("id", "cmpl-victim-stream").startswith("cmpl-victim-stream") for e in events)


@pytest.mark.slow
def test_every_nth_request_is_hit_when_the_fault_says_so(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with launch_server(
        "disagg",
        model=str(tiny_llama_dir),
        server_args=["--context-length", str(CTX), "--inject-fault", "placeholder_handoff%3", "--log-level", "warning"],
        log_dir=tmp_path,
        ready_timeout_s=180,
    ) as s:
        codes = [
            httpx.post(f"{s.url}/v1/completions", json=body(tiny_llama_dir, [5] * 20), timeout=60).status_code
            for _ in range(6)
        ]
    assert codes == [500, 200, 200, 500, 200, 200]  # the 1st and the 4th request: every 3rd, from the first


def test_allow_context_above_pool_starts_a_disaggregated_deployment_and_limits_requests_to_each_pool(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = ["--context-length", "256", "--prefill-max-total-tokens", "128", "--decode-max-total-tokens", "192"]
    with launch_server(
        "disagg",
        model=str(tiny_llama_dir),
        server_args=[*args, "--allow-context-above-pool", "--log-level", "warning"],
        log_dir=tmp_path,
        ready_timeout_s=180,
    ) as s:

        def post(prompt: list[int], n: int) -> httpx.Response:
            return httpx.post(f"{s.url}/v1/completions", json=body(tiny_llama_dir, prompt, n), timeout=60)

        r = post([5] * 150, 4)  # within the context, above prefill's pool
        assert r.status_code == 400 and "prefill KV pool holds (128 tokens)" in r.json()["error"]["message"], r.text
        r = post([5] * 100, 100)  # the prompt fits prefill; prompt + output exceed decode's pool
        assert r.status_code == 400 and "decode KV pool (192 tokens)" in r.json()["error"]["message"], r.text
        r = post([5] * 100, 20)
        assert r.status_code == 200 and r.json()["choices"][0]["kvfence"]["integrity"]["status"] == "verified"
        info = httpx.get(f"{s.url}/server_info", timeout=10).json()
        assert info["capacity"]["context_length"] == 256
        assert info["capacity"]["max_total_tokens"] == {"prefill": 128, "decode": 192}
        log = s.log_path.read_text()
    assert log.count("--allow-context-above-pool: context length 256 tokens exceeds the KV pool") >= 2  # both roles


def test_without_the_flag_a_worker_whose_context_exceeds_its_pool_refuses_to_start(tiny_llama_dir: Path) -> None:
    argv = ["--model", str(tiny_llama_dir), "--context-length", "256", "--max-total-tokens", "128"]
    argv += ["--role", "prefill", "--router-address", "tcp://127.0.0.1:9"]  # refused before it looks for one
    p = subprocess.run(
        [sys.executable, "-m", "kvfence", "serve", *argv], capture_output=True, text=True, timeout=120, env=worker_env()
    )
    assert p.returncode == 2
    assert "context length 256 tokens does not fit in the KV pool of 128 tokens" in p.stderr, p.stderr[-2000:]
    assert "--allow-context-above-pool" in p.stderr


@pytest.mark.parametrize("role", [["--role", "aggregated"], []], ids=["aggregated", "disaggregated"])
def test_a_port_in_use_is_one_line_and_exit_2_before_anything_loads_or_starts(
    tiny_llama_dir: Path, role: list[str]
) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = ["--model", str(tiny_llama_dir), "--port", str(port), *role]
        p = subprocess.run(
            [sys.executable, "-m", "kvfence", "serve", *argv], capture_output=True, text=True, timeout=120,
            env=worker_env(),
        )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("kvfence: error: --port") and "cannot listen" in lines[-1], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "loading" not in p.stderr and "router http" not in p.stderr  # no model loaded, no process started
