"""The endpoints issue 28 adds, through the official `openai` client where it has them: GET /v1/models/{id}
(`models.retrieve`), POST /v1/responses (`responses.create`, `responses.stream`), and vLLM's /tokenize and
/detokenize (shapes as vLLM 0.32 serves them: count, max_model_len, tokens, token_strs; prompt).

The fake engine makes outputs exact; /tokenize is also checked against the tiny model's real tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.api_fakes import MODEL, ByteTokenizer, FakeEngine, expected_text, serve

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(context_length=1024)


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


# ---- models -----------------------------------------------------------------------------------------------------


def test_models_retrieve_and_unknown_model(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "kvfence")
    assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("meta-llama/other")
    assert e.value.body["code"] == "model_not_found"


# ---- responses ----------------------------------------------------------------------------------------------------


def chat_prompt(messages: list[dict[str, str]]) -> list[int]:
    return TOK.apply_chat_template(messages)


def test_responses_create_is_the_chat_completion_underneath(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.responses.create(model=MODEL, input="hello", instructions="be brief", max_output_tokens=6)
    ids = chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert engine.calls[-1][1] == ids and engine.calls[-1][0].startswith("resp-")
    assert resp.output_text == expected_text(ids, None, 6)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.model_extra["kvfence"]["integrity"]["status"] == "verified"


def test_responses_stream_events_build_the_same_response(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "input": [{"role": "user", "content": "stream this"}], "max_output_tokens": 9}
    whole = client.responses.create(**args).output_text
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole
    with client.responses.stream(**args) as stream:  # the SDK's own accumulator over our events
        final = stream.get_final_response()
    assert final.output_text == whole and final.status == "incomplete"


def test_responses_function_call_items_round_trip(base_url: str) -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    engine = FakeEngine(context_length=1024, script=call)
    server = serve(engine)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
        resp = client.responses.create(model=MODEL, input="time?", tools=tools, max_output_tokens=200)
        (item,) = resp.output
        assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_time", {"zone": "utc"})
        assert resp.status == "completed"
        with client.responses.stream(model=MODEL, input="time?", tools=tools, max_output_tokens=200) as stream:
            streamed = stream.get_final_response().output
        assert [(i.type, i.name, i.arguments) for i in streamed] == [(item.type, item.name, item.arguments)]
        # the call and its output go back as input: they reach the template as a tool call and a tool turn
        follow = [
            {"role": "user", "content": "time?"},
            {"type": "function_call", "call_id": item.call_id, "name": "get_time", "arguments": item.arguments},
            {"type": "function_call_output", "call_id": item.call_id, "output": "12:00"},
        ]
        client.responses.create(model=MODEL, input=follow, tools=tools, max_output_tokens=200)
        prompt = bytes(engine.calls[-1][1]).decode()
        assert "<assistant>\n<tool>12:00\n" in prompt and prompt.startswith("<tools>['get_time']")
    finally:
        server.stop()


def test_responses_refuses_what_needs_state(base_url: str, engine: FakeEngine) -> None:
    before = len(engine.calls)
    for field, value in (("previous_response_id", "resp-1"), ("background", True), ("truncation", "auto")):
        r = httpx.post(base_url + "/v1/responses", json={"model": MODEL, "input": "x", field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(base_url + "/v1/responses", json={"model": MODEL, "input": [{"type": "input_image"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("input"), r.text
    assert len(engine.calls) == before


# ---- tokenize / detokenize -------------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllms_shapes(base_url: str) -> None:
    r = httpx.post(base_url + "/tokenize", json={"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    assert r.json() == {
        "count": 6,
        "max_model_len": 1024,
        "tokens": list("héllo".encode()),
        "token_strs": [TOK.decode([b]) for b in "héllo".encode()],
    }
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["tokens"] == TOK.apply_chat_template(messages, add_generation_prompt=False)
    assert r.json()["token_strs"] is None
    r = httpx.post(base_url + "/detokenize", json={"model": MODEL, "tokens": list(b"hi there")})
    assert r.json() == {"prompt": "hi there"}
    for path, body, code in (
        ("/detokenize", {"tokens": [300]}, "invalid_value"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model_not_found"),
        ("/tokenize", {"prompt": 5}, "invalid_type"),
    ):
        r = httpx.post(base_url + path, json=body)
        assert r.json()["error"]["code"] == code, (path, body, r.text)


def test_tokenize_matches_the_models_tokenizer(tiny_llama_dir: Path) -> None:
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import ServerThread

    tok = Tokenizer.from_dir(tiny_llama_dir)
    app = build_app(FakeEngine(), tok, ApiSettings(served_model_name=MODEL, vocab_size=tok.vocab_size))
    with ServerThread(app) as server:
        text = "the KV cache page"
        for special in (True, False):
            body = {"prompt": text, "add_special_tokens": special, "return_token_strs": True}
            r = httpx.post(server.url + "/tokenize", json=body).json()
            ids = tok.encode(text, add_special_tokens=special)
            assert r["tokens"] == ids and r["count"] == len(ids)
            assert r["token_strs"] == [tok.id_to_token(i) for i in ids]
        messages = [{"role": "user", "content": "hi"}]
        r = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
        assert r["tokens"] == tok.apply_chat_template(messages)
        assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(
            r["tokens"], skip_special_tokens=False
        )
