"""The messages of the vLLM connector's control channel (`control.py`), typed, and their one codec.

What it knows: each message a small frozen `msgspec.Struct` whose class is its kind (the tag `t`, as on the
data plane, `transfer.frames`):

    server    -> client      Hello {nonce}                      first, on every connection: the nonce its MAC covers
    decode    -> prefill     Pull {rid, xid, to}                push transfer `xid` of request `rid` to address `to`
    decode    -> front end   Record {xid, vllm_id, record}      the integrity record of the load of transfer `xid`
    server    -> client      Ok {pages?}                         done (a pull's reply says how many pages go)
                             Refused {reason}                    not done, and why

`to_header` turns a message into the JSON object the channel sends (and MACs); `request_from` / `reply_from` turn a
received object into one typed message or raise `MessageError` naming what is wrong (an unknown kind, a field
missing, unknown or of the wrong type), so a handler dispatches on a class, never on `header.get(...)`.

What it does not know: framing, nonces and MACs (`control.py`), or what a request does (`handoff.py`, `proxy.py`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvfence.errors import KvfenceError


class MessageError(KvfenceError, ValueError):
    """A control header that is not a message of the kind expected here."""


class ControlMessage(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True, omit_defaults=True):
    """Every message of the channel; its class's tag is its kind `t` on the wire."""

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class Hello(ControlMessage, frozen=True, tag="hello"):
    nonce: str  # 32 hex digits, fresh per connection


class Pull(ControlMessage, frozen=True, tag="pull"):
    rid: str
    xid: str
    to: str  # decode's data-plane address, "tcp://host:port"


class Record(ControlMessage, frozen=True, tag="record"):
    xid: str
    vllm_id: str
    record: dict[str, Any]  # IntegrityRecord.to_dict()


class Ok(ControlMessage, frozen=True, tag="ok"):
    pages: int | None = None  # a pull's reply: the pages prefill sends


class Refused(ControlMessage, frozen=True, tag="refused"):
    reason: str


Request = Pull | Record
Reply = Ok | Refused


def to_header(msg: ControlMessage) -> dict[str, Any]:
    """The JSON object the channel sends for `msg` (its kind in `t`)."""
    header: dict[str, Any] = msgspec.to_builtins(msg)
    return header


def request_from(header: dict[str, Any]) -> Request:
    """The request `header` holds; anything else raises `MessageError`."""
    msg: Request = _convert(header, Request, "request")
    return msg


def reply_from(header: dict[str, Any]) -> Reply:
    """The reply `header` holds; anything else raises `MessageError`."""
    msg: Reply = _convert(header, Reply, "reply")
    return msg


def hello_from(header: dict[str, Any]) -> Hello:
    """The server's greeting `header` holds; anything else raises `MessageError`."""
    msg: Hello = _convert(header, Hello, "greeting")
    return msg


def _convert(header: dict[str, Any], kind: Any, what: str) -> Any:
    try:
        return msgspec.convert(header, kind)
    except msgspec.ValidationError as e:
        text = str(e)
        if text.startswith("Invalid value") and text.endswith("at `$.t`"):
            raise MessageError(f"a {what} of an unknown kind: {str(header.get('t'))[:40]!r}") from None
        raise MessageError(f"malformed {what}: {text}") from None
