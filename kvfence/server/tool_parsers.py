"""Tool calls in a model's output text: the Hermes and Llama-3 JSON formats, parsed as the text streams in.

What it knows: the two formats open models are trained to call tools in, and how to find them in text that
arrives a piece at a time without sending the client a byte that turns out to belong to a call:

* `hermes` (Hermes 2 Pro, Qwen 2.5/3, many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, with ordinary text around them. Text is passed on as it comes except a tail that could
  still become `<tool_call>`; a call goes out whole once its closing tag arrives (or at the end, if the model
  stopped inside one and what it wrote parses).
* `llama3_json` (Llama 3.1/3.2/3.3 with their tool prompt): the whole output is one or more
  `{"name": ..., "parameters": {...}}` objects (`arguments` accepted too), separated by `;`, possibly after
  `<|python_tag|>`. An output whose first non-blank character is `{` is held until the end and then parsed;
  anything else is plain text.

Text that looks like a call but does not parse (not JSON, no `name`, arguments not an object) is returned as
text: the client sees what the model wrote, never a call the model did not make. Calls to functions the
request did not offer are returned as the model made them (as vLLM does); the client decides.

What it does not know: HTTP, the request's tools or tool_choice (tools.py), or how calls are rendered.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
PARSERS = (HERMES, LLAMA3_JSON)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class Piece:
    """What the parser releases: plain text, or one whole tool call."""

    text: str = ""
    call: ParsedCall | None = None


def _call_of(obj: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (may still become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One choice's output, fed piece by piece; `feed` and `finish` release what is certain."""

    def __init__(self, fmt: str) -> None:
        assert fmt in PARSERS, fmt
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self._buffer = ""  # text not released yet
        self._in_call = False  # hermes: inside <tool_call>
        self._mode: str | None = None  # llama3_json: "json" (holding everything) or "text", once decided
        self._blank = ""  # whitespace held back after a call (dropped if nothing but calls follow)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._hermes(final=False) if self.fmt == HERMES else self._llama(final=False)

    def finish(self) -> list[Piece]:
        """Everything still held, at the end of the output."""
        pieces = self._hermes(final=True) if self.fmt == HERMES else self._llama(final=True)
        if self._blank and not self.calls:
            pieces.append(Piece(text=self._blank))
        self._blank = ""
        return pieces

    def _text(self, text: str) -> list[Piece]:
        """Plain text out; blanks right after a call wait for what follows them."""
        if not text:
            return []
        if self.calls and not text.strip():
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return [Piece(text=text)]

    def _called(self, call: ParsedCall) -> list[Piece]:
        self.calls.append(call)
        self._blank = ""
        return [Piece(call=call)]

    def _hermes(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _held_tail(self._buffer, _OPEN)
                    out += self._text(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out += self._text(self._buffer[:at])
                self._buffer = self._buffer[at + len(_OPEN) :]
                self._in_call = True
            end = self._buffer.find(_CLOSE)
            if end < 0 and not final:
                return out
            body = self._buffer if end < 0 else self._buffer[:end]
            raw = _OPEN + body + ("" if end < 0 else _CLOSE)
            self._buffer = "" if end < 0 else self._buffer[end + len(_CLOSE) :]
            self._in_call = False
            try:
                call = _call_of(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            out += self._called(call) if call is not None else self._text(raw)
            if end < 0:
                return out

    def _llama(self, final: bool) -> list[Piece]:
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG) :].lstrip()
            undecided = not head or _PYTHON_TAG.startswith(head)  # blanks, or maybe the start of the tag
            if undecided and not final:
                return []
            self._mode = "json" if head.startswith("{") else "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return self._text(text)
        if not final:
            return []
        text, self._buffer = self._buffer, ""
        calls = _llama_calls(text)
        if calls is None:
            return self._text(text)
        out: list[Piece] = []
        for call in calls:
            out += self._called(call)
        return out


def _llama_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a whole Llama-3 JSON output (objects separated by `;`), None unless all of it parses."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :]
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or (calls and body[pos] == ";")):
            pos += 1
        if pos >= len(body):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


def parse_all(fmt: str, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole output at once: (its plain text, its calls)."""
    parser = ToolCallParser(fmt)
    pieces = parser.feed(text) + parser.finish()
    return "".join(p.text for p in pieces), parser.calls


def resolve_parser(flag: str, chat_template: str | None) -> str:
    """--tool-call-parser: a format by name, or "auto": the one the chat template teaches."""
    return parser_for_template(chat_template) if flag == "auto" else flag


def parser_for_template(chat_template: str | None) -> str:
    """The format a chat template teaches its model: Llama-3 JSON when it speaks of `<|python_tag|>` or an
    `ipython` role, else Hermes (also the fallback for templates without tools)."""
    if chat_template and (_PYTHON_TAG in chat_template or "ipython" in chat_template) and _OPEN not in chat_template:
        return LLAMA3_JSON
    return HERMES
