"""The front door's API key (`--api-key`, $KVFENCE_API_KEY): OpenAI-style Bearer auth with the official client.

Fast tests run the app in-process over the fake engine; the slow ones start real `kvfence serve` processes
(aggregated, and disaggregated where the router gets the key from its environment) and look for the key in
every place it must not be: /server_info, /metrics, the server's log and the children's command lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvfence.auth.keys import API_KEY_ENV, api_key_from
from kvfence.server.api import ApiSettings, build_app, redacted_argv
from kvfence.server.launch import ServerThread
from tests.helpers.api_fakes import MODEL, ByteTokenizer, FakeEngine
from tests.helpers.serve import kvfence_serve, kvfence_serve_process

KEY = "sk-test-4f1c0a9e"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    settings = ApiSettings(served_model_name=MODEL, vocab_size=256, api_key=KEY, max_body_bytes=1024)
    with ServerThread(build_app(FakeEngine(), ByteTokenizer(), settings)) as server:
        yield server.url


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


NO_KEY = {"extra_headers": {"Authorization": openai.Omit()}}  # the client then sends no Authorization header


def test_missing_or_wrong_key_is_401_with_an_openai_error(url: str) -> None:
    with pytest.raises(openai.AuthenticationError, match="Missing API key"):
        _client(url, "unused").models.list(**NO_KEY)
    with pytest.raises(openai.AuthenticationError) as e:
        _client(url, "sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "sk-wrong" not in e.value.response.text  # the token sent is never echoed
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for path in ("/tokenize", "/detokenize", "/v1/responses", "/v1/chat/completions", "/server_info"):
        method = httpx.get if path == "/server_info" else httpx.post
        assert method(url + path, headers={"Authorization": "Bearer " + KEY[:-1]}).status_code == 401, path
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Basic " + KEY}).status_code == 401


def test_the_right_key_works_and_health_and_metrics_stay_open(url: str) -> None:
    resp = _client(url, KEY).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert resp.usage.completion_tokens == 2
    assert httpx.get(url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401  # counted
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and 'kvfence_requests_rejected_total{code="invalid_api_key"}' in metrics.text
    info = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["api"]["api_key_required"] is True
    assert KEY not in metrics.text and KEY not in str(info)


def test_an_unauthenticated_body_is_refused_before_it_is_read(url: str) -> None:
    r = httpx.post(url + "/v1/completions", content=b"x" * 100_000)  # over max_body_bytes (1 KiB)
    assert r.status_code == 401  # not 413: the body was never read


def test_key_comes_from_the_flag_else_the_environment() -> None:
    assert api_key_from("a", {API_KEY_ENV: "b"}) == "a"
    assert api_key_from(None, {API_KEY_ENV: "b"}) == "b"
    assert api_key_from(None, {API_KEY_ENV: ""}) is None and api_key_from(None, {}) is None
    assert redacted_argv(["serve", "--api-key", "s1", "--api-key=s2", "--port", "1"]) == [
        "serve",
        "--api-key",
        "<redacted>",
        "--api-key=<redacted>",
        "--port",
        "1",
    ]


# ---- real processes --------------------------------------------------------------------------------------------------


def _children_command_lines(pid: int) -> list[str]:
    """Command lines of every descendant of `pid` (from /proc)."""
    lines, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            frontier.append(int(child))
            try:
                lines.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return lines


@pytest.mark.slow  # a real `kvfence serve` process (~15 s)
def test_aggregated_serve_with_api_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with kvfence_serve(tiny_llama_dir, log, "--role", "aggregated", "--api-key", KEY, "--log-level", "info") as url:
        for key, why in ((None, "Missing API key"), ("sk-wrong", "Incorrect API key")):
            with pytest.raises(openai.AuthenticationError, match=why):
                _client(url, key or "unused").chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=2,
                    **(NO_KEY if key is None else {}),
                )
        resp = _client(url, KEY).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert resp.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(url + "/health").status_code == 200
        info = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).text
        metrics = httpx.get(url + "/metrics").text
    assert KEY not in info and '"api_key_required":true' in info and KEY not in metrics
    assert KEY not in log.read_text() and "api key required" in log.read_text()


@pytest.mark.slow  # router + prefill + decode processes (~40 s)
def test_disaggregated_serve_takes_the_key_from_the_environment(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    log = tmp_path / "serve.log"
    with kvfence_serve_process(tiny_llama_dir, log, "--log-level", "info") as (url, launcher):
        with pytest.raises(openai.AuthenticationError):
            _client(url, "sk-wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        resp = _client(url, KEY).completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert resp.model_extra["kvfence"]["integrity"]["status"] == "verified"
        info = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
        children = _children_command_lines(launcher.pid)
    assert info["api"]["api_key_required"] is True and KEY not in str(info)
    assert len(children) >= 3 and not any(KEY in line for line in children)
    assert KEY not in log.read_text()
