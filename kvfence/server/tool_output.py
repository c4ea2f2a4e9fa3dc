"""A choice's output read under its `ToolPlan`: plain text and tool calls, as the text streams in.

What it knows: what each tool_choice mode makes of the model's text, as a sequence of `OutputEvent`s an
endpoint renders in its own shapes (chat deltas, Responses items):

* `none`: all of it is text;
* `auto`: the server's tool-call format is parsed out of it (tool_parsers.py): text, and whole calls;
* `required`: the text is the grammar's JSON array of `{"name", "parameters"}`, read at the end into calls
  (a text the length limit cut short is given back as text, not as calls);
* a named function: the text is that function's arguments, streamed as argument deltas of one call.

And the finish reason a client sees: "tool_calls" when `auto` or `required` produced calls and the model
stopped by itself (OpenAI's meaning), the engine's reason otherwise. What it does not know: HTTP, rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvfence.server.tool_parsers import ParsedCall, ToolCallParser, new_call_id
from kvfence.server.tools import AUTO, NAMED, NONE, REQUIRED, ToolPlan


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's position among this choice's calls
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str  # more of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    arguments: str  # the whole arguments text


OutputEvent = Text | CallStart | CallArguments | CallEnd


def _required_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a `required` output: a JSON array of {"name", "parameters"}; None when it does not parse."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


class OutputReader:
    """One choice's output under `plan`; `feed` each text piece, `finish` at the end."""

    def __init__(self, plan: ToolPlan, fmt: str) -> None:
        self.plan = plan
        self.calls: list[ParsedCall] = []
        self.content: list[str] = []
        self._parser = ToolCallParser(fmt) if plan.mode == AUTO else None
        self._held = ""  # required: the whole output, read at the end
        self._named: ParsedCall | None = None
        self._arguments: list[str] = []

    def _text(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        self.content.append(text)
        return [Text(text)]

    def _whole_call(self, call: ParsedCall) -> list[OutputEvent]:
        index = len(self.calls)
        self.calls.append(call)
        return [
            CallStart(index, call.id, call.name),
            CallArguments(index, call.arguments),
            CallEnd(index, call.arguments),
        ]

    def _named_start(self) -> list[OutputEvent]:
        if self._named is not None:
            return []
        assert self.plan.function is not None
        self._named = ParsedCall(self.plan.function, "", new_call_id())
        return [CallStart(0, self._named.id, self._named.name)]

    def feed(self, text: str) -> list[OutputEvent]:
        mode = self.plan.mode
        if mode == NONE:
            return self._text(text)
        if mode == AUTO:
            assert self._parser is not None
            out: list[OutputEvent] = []
            for piece in self._parser.feed(text):
                out += self._text(piece.text) if piece.call is None else self._whole_call(piece.call)
            return out
        if mode == REQUIRED:
            self._held += text
            return []
        assert mode == NAMED
        out = self._named_start()
        if text:
            self._arguments.append(text)
            out.append(CallArguments(0, text))
        return out

    def finish(self) -> list[OutputEvent]:
        mode = self.plan.mode
        if mode == AUTO:
            assert self._parser is not None
            out: list[OutputEvent] = []
            for piece in self._parser.finish():
                out += self._text(piece.text) if piece.call is None else self._whole_call(piece.call)
            return out
        if mode == REQUIRED:
            text, self._held = self._held, ""
            calls = _required_calls(text)
            if calls is None:
                return self._text(text)
            out = []
            for call in calls:
                out += self._whole_call(call)
            return out
        if mode == NAMED:
            out = self._named_start()
            assert self._named is not None
            arguments = "".join(self._arguments)
            self.calls.append(ParsedCall(self._named.name, arguments, self._named.id))
            return [*out, CallEnd(0, arguments)]
        return []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.calls and self.plan.mode in (AUTO, REQUIRED) and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    @property
    def text(self) -> str:
        return "".join(self.content)


def read_whole(plan: ToolPlan, fmt: str, text: str) -> OutputReader:
    """A finished output read at once."""
    reader = OutputReader(plan, fmt)
    reader.feed(text)
    reader.finish()
    return reader
