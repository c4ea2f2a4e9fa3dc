"""Fuzzing the HTTP API: hypothesis over JSON bodies, raw bytes and near-valid requests, and schemathesis
over the server's own OpenAPI schema. No 5xx, every 4xx is OpenAI-shaped, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.api_fakes import MODEL, FakeEngine, serve

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
_ANSWER = {"/v1/responses": "output", "/tokenize": "tokens", "/detokenize": "prompt"}  # what a 200 carries


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(context_length=48, pools={"prefill": 40, "decode": 48})


@pytest.fixture(scope="module")
def base_url(engine: FakeEngine) -> Iterator[str]:
    server = serve(engine, max_body_bytes=256 * 1024)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error"
    elif r.headers["content-type"].startswith("application/json"):
        assert _ANSWER.get(r.url.path, "choices") in r.json()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=60)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]), "content": st.text(max_size=30)}
    )
    | json_values,
    max_size=3,
)


def near_valid() -> st.SearchStrategy[dict[str, Any]]:
    """Mostly well-typed bodies with a few fields wrong, so validation and admission both get exercised."""
    fields = {
        "prompt": st.text(max_size=60) | st.lists(small_ints, max_size=50) | st.lists(st.text(max_size=5), max_size=3),
        "messages": messages,
        "max_tokens": small_ints | json_values,
        "temperature": st.floats(min_value=-1, max_value=3) | json_values,
        "top_p": st.floats(min_value=-0.5, max_value=1.5),
        "n": st.integers(min_value=-1, max_value=20),
        "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=20),
        "seed": st.none() | st.integers(min_value=-(2**64), max_value=2**64),
        "stream": st.booleans(),
        "logprobs": st.none() | st.integers(min_value=-1, max_value=6) | st.booleans(),
        "stream_options": st.none()
        | st.fixed_dictionaries({"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        "model": st.sampled_from([MODEL, MODEL, "other"]),
        "tools": st.none() | st.just([TOOL]) | st.lists(json_values, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
        | json_values,
        "input": st.text(max_size=30) | messages | json_values,
        "instructions": st.none() | st.text(max_size=10),
        "max_output_tokens": small_ints,
        "tokens": st.lists(st.integers(min_value=-1, max_value=300), max_size=10) | json_values,
    }
    return st.fixed_dictionaries({"model": fields.pop("model")}, optional=fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=json_values)
def test_fuzz_arbitrary_json(http: httpx.Client, path: str, body: Any) -> None:
    check(http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}))


@settings(max_examples=100, deadline=None)
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200))
def test_fuzz_raw_bytes(http: httpx.Client, path: str, raw: bytes) -> None:
    check(http.post(path, content=raw, headers={"content-type": "application/json"}))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=near_valid())
def test_fuzz_near_valid(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    check(http.post(path, json=body))


@pytest.mark.slow  # ~25 s; schemathesis is an optional test dependency (pip install schemathesis)
def test_schemathesis_no_server_errors(base_url: str, engine: FakeEngine) -> None:
    """Every operation of /openapi.json, positive and negative cases (schemathesis drives hypothesis)."""
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /server_info"}
    seen: dict[int, int] = {}
    for op in operations:
        post = op.method.upper() == "POST"
        modes = [schemathesis.GenerationMode.POSITIVE] + ([schemathesis.GenerationMode.NEGATIVE] if post else [])
        examples = 50 if post else 3
        for mode in modes:

            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                response = case.call()
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500, response.text
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}

            run()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0  # both accepted and refused requests were exercised
    assert not engine.active


def test_zz_still_serving_after_fuzz(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 3
    assert not engine.active
    assert http.get("/health").status_code == 200
