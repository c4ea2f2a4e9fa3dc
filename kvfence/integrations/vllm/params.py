"""The `kv_transfer_params` kvfence's front end and its vLLM connector exchange, under the key "kvfence".

What it knows: the three messages and their validation, so that a malformed or synthetic one is refused with a
message naming the field, never half-read:

  to prefill   ProduceParams   {"kvfence": {"v": 1, "role": "produce", "request_id", "transfer_id"}}
  from prefill ProducedParams  {"kvfence": {"v": 1, "role": "produced", "request_id", "transfer_id", "pull",
                                            "num_tokens"}}  (in the response's `kv_transfer_params`)
  to decode    ConsumeParams   {"kvfence": {"v": 1, "role": "consume", "request_id", "transfer_id",
                                            "tokens_expected", "token_hash", "pull", "record_to"}}

`transfer_id` is the front end's random secret (>= 128 bits, 32 hex digits) for one handoff: prefill holds the
request's blocks under it and hands them to whoever presents it on its pull channel, once. No message names a
block: prefill maps the transfer id to its own blocks, decode maps logical pages to the blocks vLLM gave it.
`tokens_expected` and `token_hash` are the front end's (it tokenized the prompt itself); prefill's word is the
manifest, which decode checks against them. `pull` is prefill's control address, `record_to` the front end's,
both "tcp://host:port".

What it does not know: what the connector does with them (connector.py, handoff.py), or vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfence.errors import KvfenceError

KEY = "kvfence"
VERSION = 1
TRANSFER_ID_HEX = 32  # 128 bits
_HEX = re.compile(r"[0-9a-f]+")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,200}")
_TOKEN_HASH = re.compile(r"[0-9a-f]{16}")
_ADDRESS = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}")


class ParamsError(KvfenceError):
    """kv_transfer_params that are not a well-formed kvfence message."""


def _field(d: dict[str, Any], name: str, kind: type) -> Any:
    if name not in d:
        raise ParamsError(f"kv_transfer_params.{KEY}.{name} is missing")
    value = d[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ParamsError(f"kv_transfer_params.{KEY}.{name} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _match(d: dict[str, Any], name: str, pattern: re.Pattern[str], what: str) -> str:
    value = _field(d, name, str)
    if not pattern.fullmatch(value):
        raise ParamsError(f"kv_transfer_params.{KEY}.{name} must be {what}, got {value[:80]!r}")
    return value


def _transfer_id(d: dict[str, Any]) -> str:
    xid = _field(d, "transfer_id", str)
    if len(xid) != TRANSFER_ID_HEX or not _HEX.fullmatch(xid):
        raise ParamsError(f"kv_transfer_params.{KEY}.transfer_id must be {TRANSFER_ID_HEX} lower-case hex digits")
    return xid


def _body(params: object, role: str) -> dict[str, Any]:
    """The kvfence part of `params` for `role`; ParamsError when there is none or it is another role's."""
    if not isinstance(params, dict) or not isinstance(params.get(KEY), dict):
        raise ParamsError(f"kv_transfer_params carry no {KEY!r} object")
    d: dict[str, Any] = params[KEY]
    if d.get("v") != VERSION:
        raise ParamsError(f"kv_transfer_params.{KEY}.v is {d.get('v')!r}; this connector speaks version {VERSION}")
    if d.get("role") != role:
        raise ParamsError(f"kv_transfer_params.{KEY}.role is {d.get('role')!r}, expected {role!r}")
    return d


def role_of(params: object) -> str | None:
    """The kvfence role a request's params ask for ("produce", "consume", ...), None when they carry no kvfence key."""
    if not isinstance(params, dict) or KEY not in params:
        return None
    d = params[KEY]
    return str(d.get("role")) if isinstance(d, dict) else ""


@dataclass(frozen=True)
class ProduceParams:
    request_id: str
    transfer_id: str

    @classmethod
    def parse(cls, params: object) -> ProduceParams:
        d = _body(params, "produce")
        return cls(_match(d, "request_id", _REQUEST_ID, "1-200 of A-Z a-z 0-9 . _ : -"), _transfer_id(d))

    def to_params(self) -> dict[str, Any]:
        return {KEY: {"v": VERSION, "role": "produce", "request_id": self.request_id, "transfer_id": self.transfer_id}}


@dataclass(frozen=True)
class ProducedParams:
    request_id: str
    transfer_id: str
    pull: str
    num_tokens: int

    @classmethod
    def parse(cls, params: object) -> ProducedParams:
        d = _body(params, "produced")
        num_tokens = _field(d, "num_tokens", int)
        if num_tokens <= 0:
            raise ParamsError(f"kv_transfer_params.{KEY}.num_tokens must be positive, got {num_tokens}")
        return cls(
            _match(d, "request_id", _REQUEST_ID, "1-200 of A-Z a-z 0-9 . _ : -"),
            _transfer_id(d),
            _match(d, "pull", _ADDRESS, "tcp://host:port"),
            num_tokens,
        )

    def to_params(self) -> dict[str, Any]:
        return {
            KEY: {
                "v": VERSION,
                "role": "produced",
                "request_id": self.request_id,
                "transfer_id": self.transfer_id,
                "pull": self.pull,
                "num_tokens": self.num_tokens,
            }
        }


@dataclass(frozen=True)
class ConsumeParams:
    request_id: str
    transfer_id: str
    tokens_expected: int
    token_hash: str
    pull: str
    record_to: str

    @classmethod
    def parse(cls, params: object) -> ConsumeParams:
        d = _body(params, "consume")
        tokens = _field(d, "tokens_expected", int)
        if tokens <= 0:
            raise ParamsError(f"kv_transfer_params.{KEY}.tokens_expected must be positive, got {tokens}")
        return cls(
            _match(d, "request_id", _REQUEST_ID, "1-200 of A-Z a-z 0-9 . _ : -"),
            _transfer_id(d),
            tokens,
            _match(d, "token_hash", _TOKEN_HASH, "16 lower-case hex digits"),
            _match(d, "pull", _ADDRESS, "tcp://host:port"),
            _match(d, "record_to", _ADDRESS, "tcp://host:port"),
        )

    def to_params(self) -> dict[str, Any]:
        return {
            KEY: {
                "v": VERSION,
                "role": "consume",
                "request_id": self.request_id,
                "transfer_id": self.transfer_id,
                "tokens_expected": self.tokens_expected,
                "token_hash": self.token_hash,
                "pull": self.pull,
                "record_to": self.record_to,
            }
        }


def record_address(params: object) -> str | None:
    """The front end's record address in a consume message that failed to parse, when that field alone is sound
    (so even a request refused for a malformed message gets its record to the front end)."""
    if not isinstance(params, dict) or not isinstance(params.get(KEY), dict):
        return None
    value = params[KEY].get("record_to")
    return value if isinstance(value, str) and _ADDRESS.fullmatch(value) else None
