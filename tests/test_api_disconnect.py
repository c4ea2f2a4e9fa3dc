"""A client that goes away mid-request gets its engine requests aborted (streamed and non-streamed)."""

from __future__ import annotations

import socket
import time

import httpx

from tests.helpers.api_fakes import MODEL, FakeEngine, serve


def wait_for(cond, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_stream_disconnect_aborts_and_server_keeps_serving() -> None:
    engine = FakeEngine(delay=0.02, context_length=10_000, pools={"aggregated": 10_000})
    server = serve(engine)
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 5000, "stream": True, "n": 2}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break
        ids = {c[0] for c in engine.calls}
        assert len(ids) == 2
        assert wait_for(lambda: set(engine.aborted) == ids), engine.aborted
        assert wait_for(lambda: not engine.active)
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        assert "kvfence_requests_aborted_total 2.0" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()


def test_non_stream_disconnect_aborts() -> None:
    engine = FakeEngine(delay=0.02, context_length=10_000, pools={"aggregated": 10_000})
    server = serve(engine)
    try:
        payload = b'{"model": "fake-model", "prompt": "slow", "max_tokens": 5000}'
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + payload)
            assert wait_for(lambda: len(engine.calls) == 1 and engine.active)
        rid = engine.calls[0][0]
        assert wait_for(lambda: engine.aborted == [rid]), engine.aborted
        assert wait_for(lambda: not engine.active)
    finally:
        server.stop()
