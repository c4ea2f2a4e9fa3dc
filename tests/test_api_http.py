"""The OpenAI-compatible endpoints, driven by the official `openai` client against uvicorn on a free port.

The engine behind the server is tests/helpers/api_fakes.FakeEngine, so expected texts are
computed exactly; the real engine is exercised in test_api_engine.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.api_fakes import MODEL, ByteTokenizer, FakeEngine, expected_text, serve
from tests.helpers.prom import value

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def base_url(engine: FakeEngine) -> Iterator[str]:
    server = serve(engine)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    return TOK.apply_chat_template(messages)


def test_completion_text_usage_and_integrity(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=7, seed=3)
    resp = raw.parse()
    assert resp.choices[0].text == expected_text(TOK.encode("hello"), 3, 7)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (5, 7, 12)
    assert resp.model_extra["kvfence"]["integrity"]["status"] == "verified"
    assert resp.model_extra["kvfence"]["integrity"]["tokens_covered"] == 12
    assert raw.headers["x-kvfence-integrity"] == "verified"


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="stream me", max_tokens=9).choices[0].text
    pieces, finish, integrity = [], None, None
    for chunk in client.completions.create(model=MODEL, prompt="stream me", max_tokens=9, stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        integrity = (chunk.choices[0].model_extra or {}).get("kvfence") or integrity
    assert "".join(pieces) == whole == expected_text(TOK.encode("stream me"), None, 9)
    assert finish == "length"
    assert integrity["integrity"]["status"] == "verified"


def test_stream_ends_with_done_and_usage_when_asked(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}' in events[-2]


def test_chat_uses_template_and_streams(client: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    ids = chat_ids(messages)
    assert engine.calls[-1][1] == ids
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected_text(ids, None, 5)
    assert resp.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_max_tokens_defaults_to_rest_of_context(client: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "fill"}]
    client.chat.completions.create(model=MODEL, messages=messages)
    assert engine.calls[-1][2].max_tokens == engine.capacity().context_length - len(chat_ids(messages))


def test_n_choices_differ_and_are_indexed(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, seed=10)
    ids = TOK.encode("abc")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [expected_text(ids, 10 + j, 4) for j in range(3)]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 12
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, seed=10, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in resp.choices}


def test_batched_prompts_and_token_id_prompts(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2)
    assert [c.text for c in resp.choices] == [expected_text(TOK.encode(s), None, 2) for s in ("ab", "cd")]
    assert resp.usage.prompt_tokens == 4
    resp = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert resp.choices[0].text == expected_text([1, 2, 3], None, 2)


def test_stop_string_cuts_text(client: openai.OpenAI) -> None:
    full = expected_text(TOK.encode("q"), None, 20)
    stop = full[5]
    resp = client.completions.create(model=MODEL, prompt="q", max_tokens=20, stop=[stop])
    assert resp.choices[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_models_health_server_info(base_url: str, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    info = httpx.get(base_url + "/server_info").json()
    assert info["served_model_name"] == MODEL
    assert info["capacity"] == {
        "context_length": 256,
        "max_total_tokens": {"aggregated": 1024},
        "page_size": 4,
        "max_request_tokens": 256,
    }
    assert info["api"]["max_n"] == 16 and info["api"]["max_body_bytes"] == 4 * 1024 * 1024
    assert info["engine"] == {"mode": "fake", "context_length": 256}
    assert info["stats"]["roles"]["aggregated"]["pages_total"] == 64


def test_metrics_count_requests_tokens_and_integrity(base_url: str, client: openai.OpenAI) -> None:
    before = httpx.get(base_url + "/metrics").text
    client.completions.create(model=MODEL, prompt="count", max_tokens=6)
    text = httpx.get(base_url + "/metrics").text
    completions_200 = {"endpoint": "/v1/completions", "status": "200"}
    done = value(text, "kvfence_requests_total", **completions_200)
    assert done == (
        value(before, "kvfence_requests_total", **completions_200) + 1 if "/v1/completions" in before else 1
    )
    model = {"model_name": MODEL}
    generated = value(text, "kvfence_generation_tokens_total", **model)
    assert generated - value(before, "kvfence_generation_tokens_total", **model) == 6
    assert (
        value(text, "kvfence_prompt_tokens_total", **model) - value(before, "kvfence_prompt_tokens_total", **model) == 5
    )
    assert value(text, "kvfence_integrity_results_total", status="verified") >= 1
    assert value(text, "kvfence_time_to_first_token_seconds_count", **model) >= 1
    assert value(text, "kvfence_time_per_output_token_seconds_count", **model) >= 1
    assert value(text, "kvfence_kv_pages_total", role="aggregated") == 64
    assert value(text, "kvfence_kv_transfers_total", result="failed") == 1


def test_engine_registry_is_appended_to_metrics() -> None:
    from prometheus_client import CollectorRegistry, Counter

    engine = FakeEngine()
    engine.metrics_registry = CollectorRegistry()
    Counter("kvfence_handoff_verified", "handoffs verified", registry=engine.metrics_registry).inc(3)
    server = serve(engine)
    try:
        text = httpx.get(server.url + "/metrics").text
        assert value(text, "kvfence_handoff_verified_total") == 3
        assert "kvfence_requests_total" in text
    finally:
        server.stop()
