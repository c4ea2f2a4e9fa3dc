"""Tool calls: the Hermes and Llama-3 JSON parsers, tool_choice planning, and the chat endpoint through the
official `openai` client (its `tool_calls`, and its stream helper accumulating our tool-call deltas).

`auto` is driven by the fake engine playing a scripted model output (a random model does not call tools);
`required` and a named function run on the tiny random Llama, where only the grammar can make the output a
valid call: the arguments are checked against the tool's JSON schema with jsonschema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvfence.server import openai_schema as p
from kvfence.server.http import ApiError
from kvfence.server.tool_parsers import HERMES, LLAMA3_JSON, ToolCallParser, parse_all, parser_for_template
from kvfence.server.tools import plan_tools
from tests.helpers.api_fakes import MODEL, FakeEngine, serve

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
HERMES_OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
)


# ---- parsers ------------------------------------------------------------------------------------------------------


def _feed_by_char(fmt: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser(fmt)
    pieces = [piece for ch in text for piece in parser.feed(ch)] + parser.finish()
    for piece in pieces:  # nothing that belongs to a call is ever released as text
        assert "<tool_call" not in piece.text and '"arguments"' not in piece.text
    return "".join(x.text for x in pieces), [(c.name, c.arguments) for c in parser.calls]


def test_hermes_calls_are_found_whole_or_fed_one_character_at_a_time() -> None:
    calls = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "cet"}')]
    text, found = parse_all(HERMES, HERMES_OUTPUT)
    assert (text, [(c.name, c.arguments) for c in found]) == ("Let me check.\n", calls)
    assert _feed_by_char(HERMES, HERMES_OUTPUT) == ("Let me check.\n", calls)


def test_hermes_text_that_is_not_a_call_is_given_back_as_written() -> None:
    for text in ("a <tool_call>not json</tool_call> b", 'ends inside <tool_call>{"nam', "a <tool_ca", "x < y"):
        assert parse_all(HERMES, text) == (text, [])
    # a call the length limit cut after its JSON was complete still counts
    assert [c.name for c in parse_all(HERMES, '<tool_call>{"name": "f", "arguments": {}}')[1]] == ["f"]


def test_llama3_json_calls_with_python_tag_and_semicolons() -> None:
    out = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "f", "arguments": {}}'
    assert _feed_by_char(LLAMA3_JSON, out) == ("", [("get_time", '{"zone": "utc"}'), ("f", "{}")])
    assert parse_all(LLAMA3_JSON, '{"name": "x", "parameters": [1]}') == ('{"name": "x", "parameters": [1]}', [])
    assert parse_all(LLAMA3_JSON, '{"a": 1} trailing') == ('{"a": 1} trailing', [])


def test_llama3_json_plain_text_streams_at_once() -> None:
    parser = ToolCallParser(LLAMA3_JSON)
    assert [x.text for x in parser.feed("  Hel")] == ["  Hel"]  # not held: it cannot become a call
    assert [x.text for x in parser.feed("lo")] == ["lo"] and parser.finish() == []


def test_parser_follows_the_chat_template() -> None:
    assert parser_for_template(TEMPLATE.read_text()) == HERMES
    assert parser_for_template("{% if m.role == 'ipython' %}<|python_tag|>{% endif %}") == LLAMA3_JSON
    assert parser_for_template(None) == HERMES


# ---- tool_choice --------------------------------------------------------------------------------------------------


def _tools() -> list[p.ToolDefinition]:
    return [p.ToolDefinition.model_validate(t) for t in TOOLS]


def test_tool_choice_needs_known_tools_and_excludes_response_format() -> None:
    with pytest.raises(ApiError, match="tool_choice: needs tools"):
        plan_tools(None, "required", True, False)
    with pytest.raises(ApiError, match="not among the tools"):
        plan_tools(
            _tools(), p.NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}), True, False
        )
    with pytest.raises(ApiError, match="response_format"):
        plan_tools(_tools(), "auto", True, True)
    assert plan_tools(_tools(), "none", True, True).grammar is None  # none: nothing constrains the output


def test_required_grammar_schema_accepts_exactly_calls_to_the_tools() -> None:
    plan = plan_tools(_tools(), "required", False, False)
    assert plan.grammar is not None and plan.grammar.json is not None
    schema = json.loads(plan.grammar.json)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "utc"}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_time", "parameters": {"zone": "x"}}] * 1):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call at most
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "utc"}}] * 2, schema)


# ---- auto, over the fake engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(context_length=1024, script=HERMES_OUTPUT)
    server = serve(engine)
    try:
        yield server.url, engine
    finally:
        server.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_auto_returns_the_calls_the_model_made(scripted: tuple[str, FakeEngine]) -> None:
    url, engine = scripted
    resp = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=500
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "cet"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    prompt = bytes(engine.calls[-1][1]).decode()
    assert prompt.startswith("<tools>['get_weather', 'get_time']")  # the tools reached the chat template


def test_auto_stream_deltas_accumulate_to_the_same_calls(scripted: tuple[str, FakeEngine]) -> None:
    url, _ = scripted
    messages = [{"role": "user", "content": "weather?"}]
    with _client(url).chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, max_tokens=500) as s:
        final = s.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": "cet"}),
    ]
    # the raw deltas: id, type and name first (arguments empty), then the arguments; never a tag as content
    deltas = [
        chunk.choices[0].delta
        for chunk in _client(url).chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=500, stream=True
        )
        if chunk.choices
    ]
    tool_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [(t.index, t.id is not None, t.function.name, t.function.arguments) for t in tool_deltas][:2] == [
        (0, True, "get_weather", ""),
        (0, False, None, '{"city": "Paris", "unit": "c"}'),
    ]
    assert "".join(d.content or "" for d in deltas) == "Let me check.\n"


def test_tool_choice_none_leaves_the_text_alone(scripted: tuple[str, FakeEngine]) -> None:
    url, _ = scripted
    resp = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none", max_tokens=500
    )
    assert resp.choices[0].message.content == HERMES_OUTPUT and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


def test_bad_tool_requests_are_400_naming_the_field(scripted: tuple[str, FakeEngine]) -> None:
    url, engine = scripted
    before = len(engine.calls)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({**chat, "tool_choice": "required"}, "tool_choice"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({**chat, "tools": TOOLS + TOOLS[:1]}, "tools"),
        ({**chat, "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for body, param in cases:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert len(engine.calls) == before


# ---- required / named, on the tiny model under the grammar ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_served(tiny_llama_dir: Path) -> Iterator[str]:
    from kvfence.cli import build_parser
    from kvfence.commands.serve import build_aggregated
    from kvfence.server.launch import ServerThread

    argv = ["serve", "--role", "aggregated", "--model", str(tiny_llama_dir), "--served-model-name", "tiny"]
    argv += ["--page-size", "4", "--max-total-tokens", "2048", "--chat-template", str(TEMPLATE)]
    app, engine = build_aggregated(build_parser().parse_args(argv))
    engine.start()
    server = ServerThread(app).start()
    try:
        yield server.url
    finally:
        server.stop()
        engine.shutdown()


def _schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)  # type: ignore[index]


def test_required_makes_the_random_model_call_a_tool(tiny_served: str) -> None:
    client = _client(tiny_served)
    kwargs: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    kwargs |= {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
    with client.chat.completions.stream(**kwargs) as s:  # greedy: the stream gives the same call
        streamed = s.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
        (call.function.name, json.loads(call.function.arguments))
    ]


def test_named_function_makes_the_output_its_arguments(tiny_served: str) -> None:
    client = _client(tiny_served)
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "weather"}]
    for temperature in (0.0, 1.0):
        resp = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=temperature
        )
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=0, stream=True
        )
    )
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert len(pieces) > 2  # the arguments stream as they are generated, not in one piece at the end
    jsonschema.validate(json.loads("".join(x.function.arguments or "" for x in pieces)), WEATHER)


def test_earlier_calls_and_tool_results_reach_the_template(tiny_served: str) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(tiny_served + "/tokenize", json={"model": "tiny", "messages": messages, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(tiny_served + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>' in text  # arguments: an object
    assert "<|tool|>sunny<|end|>" in text
    resp = _client(tiny_served).chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=3)
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_grammar_the_compiler_refuses_names_tools(tiny_served: str) -> None:
    bad = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
        }
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": bad, "tool_choice": "required"}
    r = httpx.post(tiny_served + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
