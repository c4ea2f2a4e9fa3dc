"""The aggregated server end to end: `kvfence serve` flags -> LLMEngine in its thread -> HTTP -> openai client.

The tiny random Llama from tests/conftest.py; outputs are compared with LLMEngine.generate
on the same weights (the oracle), and KV pages are checked through /server_info and /metrics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvfence.cli import build_parser, main
from kvfence.commands.serve import build_aggregated
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError
from kvfence.server.launch import ServerThread

FLAGS = ["--page-size", "4", "--max-total-tokens", "512", "--context-length", "256", "--served-model-name", "tiny"]


def parse(model_dir: Path, *extra: str) -> Any:
    return build_parser().parse_args(["serve", "--role", "aggregated", "--model", str(model_dir), *FLAGS, *extra])


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[str, Any]]:
    app, client = build_aggregated(parse(tiny_llama_dir))
    client.start()
    server = ServerThread(app).start()
    try:
        yield server.url, client
    finally:
        server.stop()
        client.shutdown()


@pytest.fixture(scope="module")
def oai(served: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info").json()["stats"]


def test_greedy_matches_engine_oracle(served: tuple[str, Any], oai: openai.OpenAI) -> None:
    url, client = served
    oracle = LLMEngine(client.engine.config, loaded=client.engine.loaded)
    prompt = "the cache page"
    want = oracle.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    resp = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == want.text
    assert resp.usage.completion_tokens == len(want.token_ids) == 12
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    streamed = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_chat_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "say something"}]
    whole = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible_and_n_choices_differ(oai: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny", prompt="kv", max_tokens=16, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    a = [c.text for c in oai.completions.create(**kwargs).choices]
    b = [c.text for c in oai.completions.create(**kwargs).choices]
    assert a == b
    assert a[0] != a[1]


def test_client_disconnect_returns_pages_to_baseline(served: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    url, client = served
    assert stats(url)["roles"]["aggregated"]["pages_used"] == 0
    step = client.engine.step

    def slow_step() -> Any:  # the real step, slowed so the client can leave mid-generation
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(client.engine, "step", slow_step)
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 4:
                assert stats(url)["roles"]["aggregated"]["pages_used"] > 0  # the request holds pages now
                break  # drops the line iterator: httpx closes the connection here
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stats(url)["roles"]["aggregated"]["pages_used"] != 0:
        time.sleep(0.02)
    s = stats(url)
    assert s["roles"]["aggregated"]["pages_used"] == 0 and s["num_running"] == 0
    metrics = httpx.get(url + "/metrics").text
    assert 'kvfence_kv_pages_used{role="aggregated"} 0.0' in metrics
    assert "kvfence_requests_aborted_total 1.0" in metrics


def test_concurrent_requests_all_complete_and_free_their_pages(served: tuple[str, Any]) -> None:
    url, _ = served

    def one(i: int) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 8 + i, "ignore_eos": True, "seed": i}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r["usage"]["completion_tokens"] for r in results] == [8 + i for i in range(8)]
    assert stats(url)["roles"]["aggregated"]["pages_used"] == 0


def test_over_pool_request_refused_before_the_engine(served: tuple[str, Any], oai: openai.OpenAI) -> None:
    url, _ = served
    steps = stats(url)["num_steps"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt=[5] * 200, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and "300" in str(e.value) and "256" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny", prompt=[999_999], max_tokens=1)  # outside the vocabulary
    assert stats(url)["num_steps"] == steps


def test_server_info_is_auditable(served: tuple[str, Any]) -> None:
    info = httpx.get(served[0] + "/server_info").json()
    assert info["capacity"] == {
        "context_length": 256,
        "max_total_tokens": {"aggregated": 512},
        "page_size": 4,
        "max_request_tokens": 256,
    }
    engine = info["engine"]
    assert engine["mode"] == "aggregated" and engine["num_pages"] == 128 and engine["page_size"] == 4
    assert engine["architecture"] == "LlamaForCausalLM" and len(engine["layout_fingerprint"]) > 8
    assert engine["scheduler"]["chunked_prefill_size"] == 512
    assert info["server_args"]["max_total_tokens"] == 512 and info["server_args"]["allow_context_above_pool"] is False


def test_context_above_pool_refuses_to_start(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CapacityConfigError) as e:
        build_aggregated(parse(tiny_llama_dir, "--max-total-tokens", "64", "--context-length", "128"))
    msg = str(e.value)
    assert "128" in msg and "64" in msg and "--max-total-tokens" in msg and "--allow-context-above-pool" in msg
    argv = [
        "serve",
        "--role",
        "aggregated",
        "--model",
        str(tiny_llama_dir),
        "--max-total-tokens",
        "64",
        "--context-length",
        "128",
        "--port",
        "0",
    ]
    assert main(argv) == 2
    assert "128" in capsys.readouterr().err


def test_allow_context_above_pool_caps_requests(tiny_llama_dir: Path) -> None:
    args = parse(tiny_llama_dir, "--max-total-tokens", "64", "--context-length", "128", "--allow-context-above-pool")
    app, client = build_aggregated(args)
    assert client.capacity().max_request_tokens == 64
    with client, ServerThread(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="aggregated KV pool"):
            oai.completions.create(model="tiny", prompt=[5] * 60, max_tokens=5)
        ok = oai.completions.create(model="tiny", prompt=[5] * 60, max_tokens=4, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 4


@pytest.mark.slow  # ~10-20 s: a fresh interpreter imports torch and loads the model
def test_kvfence_serve_subprocess(tiny_llama_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvfence",
        "serve",
        "--role",
        "aggregated",
        "--model",
        str(tiny_llama_dir),
        *FLAGS,
        "--port",
        "0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "serving http://" in line:
                url = line.strip().rsplit(" ", 1)[1]
        assert url is not None, "server did not announce its URL"
        for _ in range(100):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = oai.completions.create(model="tiny", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 3
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit by signal)
        assert proc.wait(timeout=20) in (0, -15)
