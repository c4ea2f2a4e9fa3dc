"""Bad input gets a 4xx with an OpenAI-shaped error body, and the engine never sees the request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvfence.errors import InvalidRequestError
from tests.helpers.api_fakes import MODEL, FakeEngine, serve

MAX_BODY = 64 * 1024  # small cap so the oversized cases stay cheap


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(context_length=256, pools={"aggregated": 1024})


@pytest.fixture(scope="module")
def base_url(engine: FakeEngine) -> Iterator[str]:
    server = serve(engine, max_body_bytes=MAX_BODY)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_calls(engine: FakeEngine) -> None:
    engine.calls.clear()


def post(base_url: str, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(base_url + path, content=content, headers=h, timeout=30)


def assert_error(r: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) - {"kvfence"} == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def good(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **overrides}


def test_malformed_json(base_url: str, engine: FakeEngine) -> None:
    assert_error(post(base_url, "/v1/completions", b'{"model": "x", "prompt": '), 400, "invalid_json")
    assert_error(post(base_url, "/v1/completions", b""), 400, "invalid_json")
    assert_error(post(base_url, "/v1/completions", b"[1, 2]"), 400, "invalid_json")
    assert engine.calls == []


def test_invalid_utf8_nan_deep_nesting_and_lone_surrogate(base_url: str, engine: FakeEngine) -> None:
    err = assert_error(
        post(base_url, "/v1/completions", b'{"model": "fake-model", "prompt": "\xff\xfe"}'), 400, "invalid_json"
    )
    assert "UTF-8" in err["message"]
    body = b'{"model": "fake-model", "prompt": "x", "temperature": NaN}'
    assert_error(post(base_url, "/v1/completions", body), 400, "invalid_json")
    assert_error(post(base_url, "/v1/completions", b"[" * 20_000 + b"]" * 20_000), 400, "invalid_json")
    body = b'{"model": "fake-model", "prompt": "\\ud800"}'
    assert_error(post(base_url, "/v1/completions", body), 400, "invalid_json")
    assert engine.calls == []


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("max_tokens", "5", "invalid_type"),
        ("max_tokens", 5.0, "invalid_type"),
        ("max_tokens", True, "invalid_type"),
        ("max_tokens", -1, "invalid_value"),
        ("max_tokens", -1, "invalid_value"),
        ("max_tokens", 10**30, "invalid_value"),
        ("temperature", "hot", "invalid_type"),
        ("temperature", 2.5, "invalid_value"),
        ("top_p", 0, "invalid_value"),
        ("n", 17, "invalid_value"),
        ("n", 0, "invalid_value"),
        ("stream", "yes", "invalid_type"),
    ],
)
def test_wrong_types_and_ranges(base_url: str, engine: FakeEngine, field: str, value: Any, code: str) -> None:
    r = httpx.post(base_url + "/v1/completions", json=good(**{field: value}), timeout=30)
    err = assert_error(r, 400, code, param=field)
    assert err["message"].startswith(field)
    assert engine.calls == []


def test_bad_prompt_shapes(base_url: str, engine: FakeEngine) -> None:
    for prompt in ["", [], [-1], [1, "a"], [[1], "a"], 5, None, [[]]]:
        err = assert_error(httpx.post(base_url + "/v1/completions", json=good(prompt=prompt)), 400, None, "prompt")
        assert err["message"].startswith("prompt")
        assert err["code"] in ("invalid_type", "invalid_value")
    assert_error(httpx.post(base_url + "/v1/completions", json=good(prompt=[300])), 400, "invalid_value", "prompt")
    assert engine.calls == []


def test_missing_field_and_bad_messages(base_url: str, engine: FakeEngine) -> None:
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL})
    assert_error(r, 400, "missing_required_parameter", "prompt")
    for messages in [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}], "hi"]:
        r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    assert engine.calls == []


def test_unknown_model_is_404(base_url: str, engine: FakeEngine) -> None:
    err = assert_error(
        httpx.post(base_url + "/v1/completions", json=good(model="gpt-9")), 404, "model_not_found", "model"
    )
    assert "gpt-9" in err["message"] and MODEL in err["message"]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert engine.calls == []


def test_huge_max_tokens_is_context_length_exceeded(base_url: str, engine: FakeEngine) -> None:
    err = assert_error(
        httpx.post(base_url + "/v1/completions", json=good(max_tokens=1_000_000)), 400, "context_length_exceeded"
    )
    assert "1000002" in err["message"] and "256" in err["message"]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a" * 300, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    assert engine.calls == []


def test_unsupported_values_are_refused_not_ignored(base_url: str, engine: FakeEngine) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ("/v1/completions", good(best_of=3), "best_of"),
        ("/v1/completions", good(suffix="end"), "suffix"),
        ("/v1/completions", good(min_p=0.1), "min_p"),
        ("/v1/completions", good(prompt_logprobs=1), "prompt_logprobs"),
        ("/v1/completions", good(guided_json={"type": "object"}), "guided_json"),
        ("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "resp-1"}, "previous_response_id"),
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/chat/completions", {**chat, "use_beam_search": True}, "use_beam_search"),
    ]
    for path, body, param in cases:
        assert_error(httpx.post(base_url + path, json=body), 400, "unsupported_value", param)
    assert engine.calls == []


def test_out_of_range_new_parameters_are_400_naming_them(base_url: str, engine: FakeEngine) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ("/v1/completions", good(logit_bias={"x": 1.0}), "logit_bias"),
        ("/v1/completions", good(logit_bias={"5": 101.0}), "logit_bias.5"),
        ("/v1/completions", good(logit_bias={"300": 1.0}), "logit_bias"),  # the fake vocabulary has 256 ids
        ("/v1/completions", good(logprobs=21), "logprobs"),
        ("/v1/completions", good(repetition_penalty=0), "repetition_penalty"),
        ("/v1/completions", good(min_tokens=5, max_tokens=2), "min_tokens"),
        ("/v1/completions", good(stop_token_ids=[256]), "stop_token_ids"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, None),
    ]
    for path, body, param in cases:
        r = httpx.post(base_url + path, json=body)
        assert r.status_code == 400, (body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, (body, r.text)
    assert engine.calls == []
    assert httpx.post(base_url + "/v1/completions", json=good(logprobs=0)).status_code == 200


def test_oversized_body_is_413_before_parsing(base_url: str, engine: FakeEngine) -> None:
    big = b'{"model": "fake-model", "prompt": "' + b"a" * (MAX_BODY + 10) + b'"}'
    assert_error(post(base_url, "/v1/completions", big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: chunked transfer encoding
        for _ in range(8):
            yield b" " * (MAX_BODY // 4)

    r = httpx.post(base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "request_too_large")
    assert engine.calls == []


def test_unknown_path_and_method(base_url: str) -> None:
    assert_error(httpx.get(base_url + "/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(base_url + "/v1/completions"), 405, "method_not_allowed")


def test_no_content_type_is_still_json(base_url: str) -> None:
    r = httpx.post(base_url + "/v1/completions", content=b'{"model": "fake-model", "prompt": "a", "max_tokens": 2}')
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2


def test_engine_validation_error_maps_to_400() -> None:
    engine = FakeEngine(fail_with=InvalidRequestError("prompt token id 9 is outside the vocabulary", param="prompt"))
    server = serve(engine)
    try:
        err = assert_error(httpx.post(server.url + "/v1/completions", json=good()), 400, "invalid_request", "prompt")
        assert "vocabulary" in err["message"]
        r = httpx.post(server.url + "/v1/completions", json=good(stream=True))
        assert_error(r, 400, "invalid_request", "prompt")
    finally:
        server.stop()


def test_generation_failure_is_500_with_integrity_record() -> None:
    engine = FakeEngine(error_finish="KV digest mismatch on page 3")
    server = serve(engine)
    try:
        r = httpx.post(server.url + "/v1/completions", json=good())
        err = assert_error(r, 500, "kv_integrity_failed")
        assert "digest mismatch" in err["message"]
        assert r.json()["kvfence"]["integrity"][0]["status"] == "rejected"
        assert r.headers["x-kvfence-integrity"] == "rejected"
        with httpx.stream("POST", server.url + "/v1/completions", json=good(stream=True)) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        events = [json.loads(x[6:]) for x in lines[:-1]]
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))  # none made up
        assert events[-1]["error"]["code"] == "kv_integrity_failed" and lines[-1] == "data: [DONE]"
        assert events[-1]["kvfence"]["integrity"][0]["status"] == "rejected"
    finally:
        server.stop()
