"""One request's flight through the router: its state, the pair of workers serving it, and its first token.

What it knows: a `Flight` record per request (the prompt as the router admitted it, its token count and
hash, the transfer capability it issued, the pair of workers, the attempt: a request whose worker died
before any token reached the client is retried once on another pair, under a new wire id so nothing of
the first attempt can be mistaken for the second), its `FlightState` moving only along
`FLIGHT_TRANSITIONS` (docs/handoff.md, "One request"), and the `FirstToken` merger: the first output token
arrives twice, from prefill the moment the prompt is computed (the router may stream it while the KV
travels: it comes from prefill's own KV) and as decode's first chunk (from the manifest decode verified);
the two must agree, and the client sees it once.

What it does not know: messages' transport, workers' health, or HTTP (`disagg.router` drives flights).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from kvfence.disagg import messages as P
from kvfence.disagg.lifecycle import Lifecycle
from kvfence.engine.sampling_params import SamplingParams
from kvfence.integrity.record import IntegrityRecord


class FlightState(str, Enum):
    """Where one request stands in the router."""

    PREFILLING = "prefilling"  # ordered to both workers: prefill computes while decode reserves
    DECODING = "decoding"  # prefill's first token came: the KV travels, decode verifies, then streams
    FAILING = "failing"  # failed by the router (deadline, worker lost, shutdown): the error is on its way to the
    # client; no more worker news matters
    FINISHED = "finished"  # its one integrity record is written (the final chunk, an error, or an abort)


_F = FlightState
FLIGHT_TRANSITIONS: dict[FlightState, frozenset[FlightState]] = {
    # Tokens may finish a flight still PREFILLING: decode can finish (max_tokens=1) before the router saw prefill's
    # first token. A retry (a worker lost before any token reached the client) starts PREFILLING again.
    _F.PREFILLING: frozenset({_F.PREFILLING, _F.DECODING, _F.FAILING, _F.FINISHED}),
    _F.DECODING: frozenset({_F.PREFILLING, _F.FAILING, _F.FINISHED}),
    _F.FAILING: frozenset({_F.FINISHED}),
    _F.FINISHED: frozenset(),
}


class Failure(NamedTuple):
    """Router-internal: a request failed because of `role` (put on the flight's queue, never sent)."""

    wire_id: str
    role: str
    reason: str
    code: str = "generation_failed"


class FromWorker(NamedTuple):
    """A worker's message for a flight, with the sender's role (put on the flight's queue)."""

    role: str
    msg: P.Message


@dataclass
class FirstToken:
    """The first output token's two arrivals: prefill's `Tokens` (streamable before the verdict) and decode's first
    chunk, which repeats it."""

    streamed: P.Tokens | None = None  # prefill's first token, if it went to the client before decode's first chunk
    repeat_dropped: bool = False  # decode's first chunk came, minus the token streamed already

    def drop_repeat(self, msg: P.Tokens) -> tuple[P.Tokens | None, str | None]:
        """Decode's chunk as the client should see it: the first one less the token streamed already, or an error
        when decode's first token is not that token (its text not that text). (chunk, None) or (None, why)."""
        first = self.streamed
        if first is None or self.repeat_dropped or not msg.token_ids:
            return msg, None
        self.repeat_dropped = True
        text, first_text = msg.text or "", first.text or ""
        if msg.token_ids[0] != first.token_ids[0] or not text.startswith(first_text):
            why = (
                f"decode's first token {msg.token_ids[0]} ({text!r}) is not the {first.token_ids[0]} "
                f"({first_text!r}) streamed from prefill"
            )
            return None, why
        logprobs = msg.logprobs[1:] if msg.logprobs is not None else None
        return P.replace(msg, token_ids=msg.token_ids[1:], text=text[len(first_text) :], logprobs=logprobs), None


@dataclass
class Flight:
    """One request on its way through the router: its state, the pair serving it and, at the end, its record."""

    request_id: str  # the engine request id the front end gave (the client's, for logs and records)
    prompt_token_ids: list[int]
    params: SamplingParams
    tokens_expected: int
    token_hash: str
    transfer_id: str  # the capability this attempt's handoff must carry; sent to its two workers only
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[FromWorker | Failure]
    started: float = field(default_factory=time.monotonic)
    wire_id: str = ""  # the id the workers know this attempt by (the request id, then `<id>#retry1`)
    attempt: int = 0
    retried_after: str = ""  # why the first attempt was given up, when it was
    decode_id: str = ""  # the pair serving this attempt
    prefill_id: str = ""
    expected_cached_tokens: int = 0  # of the prompt, what the router expects prefill's prefix cache to serve
    delivered: int = 0  # output tokens that reached the client (changed under the router's lock)
    num_output_tokens: int = 0
    first: P.Tokens | None = None  # prefill's first token, once it came (set by the receiver thread)
    first_token: FirstToken = field(default_factory=FirstToken)
    prompt_logprobs: list[Any] | None = None  # prefill's scores of the prompt (wire form), for the first chunk
    prefill_first_handled: bool = False  # this attempt's first token from prefill went through the router's handler
    record: IntegrityRecord | None = None  # the integrity record, once FINISHED
    decode_record: IntegrityRecord | None = None  # decode's record of the handoff, once it sent one
    lifecycle: Lifecycle[FlightState] = field(init=False)

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.request_id
        self.lifecycle = Lifecycle(f"flight {self.request_id}", _F.PREFILLING, FLIGHT_TRANSITIONS)

    @property
    def state(self) -> FlightState:
        return self.lifecycle.state

    def advance(self, new: FlightState) -> None:
        self.lifecycle.advance(new)

    @property
    def live(self) -> bool:
        """Still waiting on its workers (neither failed by the router nor finished)."""
        return self.state in (_F.PREFILLING, _F.DECODING)

    @property
    def finished(self) -> bool:
        return self.state is _F.FINISHED

    @property
    def pair(self) -> str:
        return f"prefill {self.prefill_id or '-'} -> decode {self.decode_id}"

    def restart(self, wire_id: str, transfer_id: str, prefill_id: str, decode_id: str, why: str, now: float) -> None:
        """A new attempt on another pair (the router checked nothing was delivered)."""
        self.attempt += 1
        self.wire_id, self.transfer_id = wire_id, transfer_id
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.retried_after = why
        self.first, self.first_token, self.decode_record, self.prompt_logprobs = None, FirstToken(), None, None
        self.prefill_first_handled = False
        self.num_output_tokens = 0
        self.started = now
        self.advance(_F.PREFILLING)
