"""`kvfence probe` against small in-test OpenAI-compatible servers on 127.0.0.1.

The honest server tokenizes by whitespace, rejects over-length prompts with 400 the way SGLang
words it, and answers deterministically. The faulty servers reproduce the incident: one accepts
over-length prompts with 200 and usage.prompt_tokens=1 (a stub) and answers with a stale previous
reply; one leaks the previous request's secret into the next reply; one ("echo") appends words of the
previous request's prompt to each reply, the leak signature of a reply decoded over another request's KV;
"bigpool" is honest but reports a KV pool far larger than the probe's traffic. The echo and bigpool servers
also run as separate processes (`serve_main`), probed through their port only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfence.audit.findings import Severity
from kvfence.audit.probe import ProbeConfig, check_target, run_probe
from kvfence.cli import main
from kvfence.errors import KvfenceError

CTX, POOL = 64, 48


def make_app(mode: str) -> FastAPI:
    app = FastAPI()
    state = {"last_text": " hello", "last_code": None, "last_prompt": ""}
    max_req_input_len = min(CTX - 1, POOL - 1) - 5
    pool = 10**7 if mode == "bigpool" else POOL

    def answer(prompt: str, max_tokens: int) -> str:
        codes = re.findall(r"secret code is (KVF[0-9A-F]+)", prompt)
        if codes:
            words = [codes[0]]
        else:
            digest = hashlib.sha1(prompt.encode()).hexdigest()
            words = [digest[i : i + 4] for i in range(0, 40, 4)]
        text = " " + " ".join(words[:max_tokens])
        if mode == "leak":
            if state["last_code"] and state["last_code"] not in codes:
                text += " " + state["last_code"]
            if codes:
                state["last_code"] = codes[0]
        if mode == "echo":  # the previous prompt's last lower-case hex words, verbatim (never a canary code)
            words = re.findall(r"(?<![0-9a-zA-Z])[0-9a-f]{4}(?![0-9a-zA-Z])", state["last_prompt"])
            if words and state["last_prompt"] != prompt:
                text += " " + " ".join(words[-4:])
            state["last_prompt"] = prompt
        return text

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "t", "max_model_len": CTX}]}

    @app.get("/server_info")
    def server_info():
        return {
            "context_length": CTX,
            "max_total_num_tokens": pool,
            "max_req_input_len": max_req_input_len,
            "disaggregation_mode": "null",
            "version": "0.5.23",
        }

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        n = len(body["prompt"].split())
        return {"tokens": list(range(n)), "count": n, "max_model_len": CTX}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt, max_tokens = body["prompt"], int(body.get("max_tokens") or 16)
        n = len(prompt.split())
        too_long = n >= max_req_input_len
        if too_long and mode == "placeholder":
            # The incident: the 1-token stub is "served" and the reply is whatever the pages held.
            text = state["last_text"]
            return {
                "id": "cmpl-x",
                "object": "text_completion",
                "model": "fake",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
            }
        if n >= CTX:
            msg = f"The input ({n} tokens) is longer than the model's context length ({CTX} tokens)."
            return JSONResponse(
                {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}, 400
            )
        if too_long:
            msg = (
                f"Input length ({n} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
            return JSONResponse(
                {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}, 400
            )
        text = answer(prompt, max_tokens)
        state["last_text"] = text
        if body.get("stream"):

            async def gen():
                for word in text.split():
                    chunk = {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": " " + word}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(0.01)
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        await asyncio.sleep(0.002)
        k = len(text.split())
        return {
            "id": "cmpl-x",
            "object": "text_completion",
            "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k},
        }

    return app


@pytest.fixture
def serve():
    import uvicorn

    started = []

    def _start(mode: str) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(make_app(mode), log_level="error", lifespan="off"))
        t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        started.append((server, t))
        return f"http://127.0.0.1:{port}"

    yield _start
    for server, t in started:
        server.should_exit = True
        t.join(5)


def _cfg(url: str, **kw) -> ProbeConfig:
    base = dict(
        url=url,
        model="fake",
        max_requests=80,
        time_budget_s=30,
        concurrency=4,
        max_tokens=4,
        golden=2,
        canaries=4,
        aborts=2,
        overlength_in_burst=2,
        request_timeout_s=10,
        progress=False,
    )
    base.update(kw)
    return ProbeConfig(**base)


def _rules(report) -> dict[str, Severity]:
    out: dict[str, Severity] = {}
    for f in report.findings:
        out[f.rule] = max(out.get(f.rule, Severity.INFO), f.severity)
    return out


def test_honest_server_passes(serve, capsys):
    url = serve("honest")
    code = main(
        ["probe", url, "--model", "fake", "--max-requests", "80", "--golden", "2", "--canaries", "4", "--aborts", "2",
         "--max-tokens", "4", "--concurrency", "4", "--no-progress", "--json"]
    )  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []
    assert code == 0
    assert doc["facts"]["context_length"] == CTX and doc["facts"]["pool_tokens"] == POOL
    assert doc["facts"]["counter"] == "/tokenize"
    boundary = [r for r in doc["replies"] if r["check"] == "boundary"]
    assert sorted(r["sent_tokens"] for r in boundary) == [CTX - 1, CTX, CTX + 1]
    assert all(r["status"] == 400 for r in boundary)
    assert sum(r["check"] == "canary" and r["status"] == 200 for r in doc["replies"]) == 4
    assert doc["requests_sent"] <= 80


def test_placeholder_server_is_caught(serve):
    report = run_probe(_cfg(serve("placeholder")))
    rules = _rules(report)
    assert rules["overlength-accepted"] == Severity.CRITICAL
    assert rules["prompt-tokens-mismatch"] == Severity.CRITICAL
    assert rules["over-pool-accepted"] == Severity.CRITICAL
    mism = [f for f in report.findings if f.rule == "prompt-tokens-mismatch"]
    assert any("placeholder signature" in f.message for f in mism)


def test_leaking_server_is_caught(serve, capsys):
    url = serve("leak")
    code = main(
        ["probe", url, "--model", "fake", "--max-requests", "80", "--golden", "2", "--canaries", "4", "--aborts", "2",
         "--max-tokens", "4", "--concurrency", "4", "--no-progress"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 2
    assert "canary-leak" in out and "CRITICAL" in out


def test_request_budget_is_respected(serve):
    report = run_probe(_cfg(serve("honest"), max_requests=10))
    assert report.requests_sent == 10
    assert len(report.replies) == 10
    assert report.stopped_early and "budget" in report.stopped_early


def test_calibration_without_tokenize(serve, monkeypatch):
    from kvfence.audit import probe as pr

    async def no_tokenize(self, text):
        return None

    monkeypatch.setattr(pr.Prober, "count_tokens", no_tokenize)
    report = run_probe(_cfg(serve("placeholder")))
    assert report.facts.counter == "usage.prompt_tokens calibration"
    assert _rules(report)["overlength-accepted"] == Severity.CRITICAL


def test_refuses_non_loopback_without_authorisation():
    with pytest.raises(KvfenceError, match="not a loopback"):
        check_target("http://192.0.2.10:30000", allow_remote=False)
    assert check_target("http://192.0.2.10:30000", allow_remote=True) == "192.0.2.10"
    assert check_target("http://localhost:1", allow_remote=False) == "localhost"


def test_cli_refusal_exit_code(capsys):
    code = main(["probe", "http://192.0.2.10:30000", "--model", "m", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and "not a loopback" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------
# Servers in processes of their own: the probe sees only their port.
# ----------------------------------------------------------------------------------------------


def serve_main(mode: str) -> None:
    """Entry of a server process: bind 127.0.0.1:0, print the port, serve until killed."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(make_app(mode), log_level="error", lifespan="off")).run(sockets=[sock])


@pytest.fixture
def serve_process():
    procs: list[subprocess.Popen] = []

    def _start(mode: str) -> str:
        code = f"from tests.test_probe import serve_main; serve_main({mode!r})"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        procs.append(proc)
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    yield _start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def test_another_requests_text_in_a_reply_is_critical(serve_process, capsys):
    url = serve_process("echo")
    code = main(
        ["probe", url, "--model", "fake", "--max-requests", "80", "--golden", "2", "--canaries", "4", "--aborts", "2",
         "--max-tokens", "4", "--concurrency", "4", "--no-progress", "--json"]
    )  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    echoed = [f for f in doc["findings"] if f["rule"] == "foreign-text-echo"]
    assert code == 2 and echoed and all(f["severity"] == "critical" for f in echoed)
    assert any(f["role"] == "golden-replay" and "churn" in f["message"] for f in echoed)
    assert not any(f["rule"] == "canary-leak" for f in doc["findings"])  # only prompt words leaked, no code


def test_a_pool_larger_than_the_traffic_is_reported_as_not_established(serve_process, capsys):
    url = serve_process("bigpool")
    code = main(
        ["probe", url, "--model", "fake", "--max-requests", "60", "--golden", "2", "--canaries", "4", "--aborts", "2",
         "--max-tokens", "4", "--concurrency", "4", "--no-progress"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "not established by this probe:" in out
    assert "page reuse not established" in out and "KV pool of 10000000" in out


def test_honest_small_pool_has_page_reuse(serve):
    report = run_probe(_cfg(serve("honest")))
    assert not any("page reuse" in x.why for x in report.not_established)
    assert any(x.check == "golden" for x in report.not_established)  # drift is a warning without --expect-...


def test_server_down_is_a_tool_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the probe connects
    code = main(["probe", f"http://127.0.0.1:{port}", "--model", "m", "--no-progress", "--request-timeout", "2"])
    err = capsys.readouterr().err
    assert code == 3 and "answered neither" in err and len(err.strip().splitlines()) == 1


def test_usage_errors_exit_4_in_one_line(capsys):
    url = "http://127.0.0.1:1"
    for argv in (["probe", url], ["probe", url, "--model", "m", "--max-requests", "0"],
                 ["probe", url, "--model", "m", "--no-such-flag"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 4, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "error" in err
