"""Admission control: per-request limits (context, each role's KV pool) and start-up capacity checks."""

from __future__ import annotations

import logging

import httpx
import pytest

from kvfence.engine.admission import admit, build_capacity, role_capacity
from kvfence.engine.engine_client import Capacity
from kvfence.errors import CapacityConfigError, ContextLengthExceededError, InvalidRequestError
from tests.helpers.api_fakes import MODEL, FakeEngine, serve

PD = Capacity(context_length=1000, max_total_tokens={"prefill": 600, "decode": 800}, page_size=16)


def test_fits_returns_max_tokens() -> None:
    assert admit(100, 50, PD) == 50
    assert admit(500, 300, PD) == 300  # exactly the decode pool


def test_context_length_refusal_names_numbers() -> None:
    cap = Capacity(context_length=100, max_total_tokens={"aggregated": 1000}, page_size=4)
    with pytest.raises(ContextLengthExceededError) as e:
        admit(90, 20, cap)
    msg = str(e.value)
    assert "110" in msg and "90" in msg and "20" in msg and "context length (100 tokens)" in msg
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_prefill_pool_refuses_prompt_over_it() -> None:
    with pytest.raises(ContextLengthExceededError, match=r"601 tokens.*prefill KV pool holds \(600 tokens\)"):
        admit(601, 1, PD)


def test_decode_pool_refuses_prompt_plus_output() -> None:
    with pytest.raises(ContextLengthExceededError, match=r"needs 801 tokens.*decode KV pool \(800 tokens\)"):
        admit(500, 301, PD)


def test_default_max_tokens_is_what_fits() -> None:
    assert admit(300, None, PD) == 500  # decode pool 800 - 300
    agg = Capacity(context_length=1000, max_total_tokens={"aggregated": 500}, page_size=4)
    assert admit(499, None, agg) == 1
    with pytest.raises(ContextLengthExceededError, match=r"500 tokens, which leaves no room.*aggregated KV pool"):
        admit(500, None, agg)


def test_empty_prompt_and_nonpositive_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        admit(0, 5, PD)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        admit(5, 0, PD)


def test_role_capacity_refuses_to_start_with_both_numbers_and_flags() -> None:
    with pytest.raises(CapacityConfigError) as e:
        role_capacity("decode", context_length=4096, num_pages=100, page_size=16)
    msg = str(e.value)
    assert "4096" in msg and "1600" in msg and "--max-total-tokens" in msg and "--allow-context-above-pool" in msg
    assert role_capacity("decode", 1600, 100, 16) == 1600


def test_allow_context_above_pool_warns_and_caps(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvfence.engine.admission"):
        cap = build_capacity(4096, {"prefill": (100, 16), "decode": (200, 16)}, allow_context_above_pool=True)
    assert cap.max_total_tokens == {"prefill": 1600, "decode": 3200} and cap.context_length == 4096
    assert cap.max_request_tokens == 1600
    assert "4096" in caplog.text and "1600" in caplog.text and "3200" in caplog.text
    with pytest.raises(ContextLengthExceededError):
        admit(1601, 1, cap)


def test_build_capacity_refuses_mixed_page_sizes() -> None:
    with pytest.raises(CapacityConfigError, match="page-size"):
        build_capacity(100, {"prefill": (100, 16), "decode": (100, 32)})


def test_http_refusal_before_any_worker_sees_it() -> None:
    engine = FakeEngine(context_length=1000, pools={"prefill": 60, "decode": 80})
    server = serve(engine)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a" * 61, "max_tokens": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
        assert "61" in err["message"] and "60" in err["message"] and err["param"] == "prompt"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 70}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat)  # 21 prompt tokens + 70 > decode 80
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "91" in r.json()["error"]["message"] and "80" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a" * 10, "max_tokens": 71})
        assert r.status_code == 400
        assert engine.calls == []
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a" * 10, "max_tokens": 70})
        assert r.status_code == 200 and len(engine.calls) == 1
        metrics = httpx.get(server.url + "/metrics").text
        assert 'kvfence_requests_rejected_total{code="context_length_exceeded"} 3.0' in metrics
    finally:
        server.stop()
