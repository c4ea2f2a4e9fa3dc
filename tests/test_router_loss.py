"""A worker that loses its router drops every request it holds, in every state, and holds no page afterwards.

The worker loop calls `drop_requests` when its router goes silent (or no longer knows it); each case below puts
one request into one state of the prefill or decode lifecycle by feeding the workers the control messages the
router would, then drops it as the loop would, and runs the workers until nothing is held: every page back in the
free list, the allocator's conservation check passing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg import messages as P
from kvfence.disagg.decode import DecodeConfig, DecodeRequestState, DecodeWorker
from kvfence.disagg.prefill import PrefillConfig, PrefillRequestState, PrefillWorker
from kvfence.disagg.worker import WorkerIdentity, drop_requests
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.integrity.digest import token_hash
from kvfence.transfer.base import new_transfer_id
from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender
from tests.helpers.auth import plane_auth

PROMPT = list(range(5, 45))  # 40 tokens: 3 pages of 16
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)


class Pair:
    """A prefill and a decode worker joined by the local transport; `relay` plays the router's part."""

    def __init__(self, loaded: Any, decode_pool_tokens: int = 1024) -> None:
        auth, fabric = plane_auth(), LocalFabric()

        def engine(pool: int) -> LLMEngine:
            config = EngineConfig(
                ModelConfig(str(loaded.model_dir)), CacheConfig(16, pool), context_length=min(256, pool)
            )
            return LLMEngine(config, loaded=loaded)

        pe, de = engine(1024), engine(decode_pool_tokens)
        self.prefill = PrefillWorker(
            pe, WorkerIdentity("prefill-0", "m", "fp", {}), PrefillConfig(transport="local", deadline_s=30),
            sender=LocalSender(fabric, pe.pool, auth=auth), auth=auth,
        )  # fmt: skip
        self.decode = DecodeWorker(
            de, WorkerIdentity("decode-0", "m", "fp", {}), DecodeConfig(transport="local", deadline_s=30),
            receiver=LocalReceiver(fabric, "decode-0", de.pool, auth=auth), auth=auth,
        )  # fmt: skip
        self.to_router: list[tuple[str, P.Message]] = []
        self.prefill.attach(lambda m: self.to_router.append(("prefill", m)))
        self.decode.attach(lambda m: self.to_router.append(("decode", m)))

    def order(self, rid: str, to_decode: bool = True, to_prefill: bool = True) -> None:
        xid, wire = new_transfer_id(), P.params_to_wire(PARAMS)
        if to_decode:
            self.decode.handle(P.DecodePrepare(rid, PROMPT, len(PROMPT), token_hash(PROMPT), xid, wire, 30.0))
        if to_prefill:
            self.prefill.handle(P.PrefillOrder(rid, PROMPT, xid, wire, "", {}, 30.0))

    def relay(self) -> None:
        """What the router passes on: decode's reservation to prefill, prefill's PrefillSent to decode."""
        for _role, msg in self.to_router[:]:
            if isinstance(msg, P.Batch):
                continue
            if isinstance(msg, P.DecodeReserved):
                self.prefill.handle(msg)
            elif isinstance(msg, P.PrefillSent):
                self.decode.handle(msg)
        self.to_router.clear()

    def run_until(self, done: Callable[[], bool], relay: bool = True, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < end, (self.prefill.requests, self.decode.requests)
            self.prefill.step()
            self.decode.step()
            if relay:
                self.relay()
            time.sleep(0.001)

    def state(self, worker: Any, rid: str) -> Any:
        req = worker.requests.get(rid)
        return req.state if req is not None else None

    def assert_nothing_held(self) -> None:
        for w in (self.prefill, self.decode):
            assert w.held_request_ids() == []
            a = w.engine.allocator
            a.check()
            assert a.num_free == a.num_pages, f"{w.role}: {a.num_pages - a.num_free} page(s) still held"

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pair(loaded: Any) -> Any:
    p = Pair(loaded)
    yield p
    p.close()


def drop_and_drain(pair: Pair) -> int:
    dropped = sum(drop_requests(w, "router lost: test") for w in (pair.prefill, pair.decode))
    pair.run_until(lambda: not pair.prefill.requests and not pair.decode.requests, relay=False)
    pair.assert_nothing_held()
    return dropped


def test_prefill_computing(pair: Pair) -> None:
    pair.order("r", to_decode=False)
    assert pair.state(pair.prefill, "r") is PrefillRequestState.COMPUTING
    assert drop_and_drain(pair) == 1


def test_prefill_computed_waiting_for_decodes_reservation(pair: Pair) -> None:
    pair.order("r", to_decode=False)  # decode never reserves: the prompt waits, computed, holding its pages
    pair.run_until(lambda: pair.state(pair.prefill, "r") is PrefillRequestState.COMPUTED, relay=False)
    assert pair.prefill.engine.allocator.num_free < pair.prefill.engine.allocator.num_pages
    assert drop_and_drain(pair) == 1


def test_prefill_handing_off_and_decode_waiting_for_the_pages(pair: Pair) -> None:
    pair.order("r")
    pair.relay()  # decode's reservation reaches prefill, which sends as soon as the prompt is computed
    pair.prefill.step()
    assert pair.state(pair.prefill, "r") is PrefillRequestState.HANDOFF
    assert pair.state(pair.decode, "r") is DecodeRequestState.HANDOFF
    assert drop_and_drain(pair) == 2


def test_decode_queued_for_pages(loaded: Any) -> None:
    pair = Pair(loaded, decode_pool_tokens=128)  # 8 pages: prompt + max_tokens (104 tokens, 7 pages) fit one
    try:
        pair.order("a", to_prefill=False)
        pair.order("b", to_prefill=False)
        assert pair.state(pair.decode, "a") is DecodeRequestState.HANDOFF
        assert pair.state(pair.decode, "b") is DecodeRequestState.QUEUED
        assert drop_and_drain(pair) == 2
    finally:
        pair.close()


def test_decode_running(pair: Pair) -> None:
    pair.order("r")
    pair.run_until(lambda: pair.state(pair.decode, "r") is DecodeRequestState.RUNNING)
    pair.run_until(lambda: "r" not in pair.prefill.requests)  # prefill released on decode's verdict
    assert drop_and_drain(pair) == 1


def test_a_computed_prompt_whose_reservation_never_comes_is_dropped_at_the_deadline(loaded: Any) -> None:
    pair = Pair(loaded)
    pair.prefill.config = PrefillConfig(transport="local", deadline_s=0.3)
    try:
        pair.order("r", to_decode=False)
        pair.run_until(lambda: pair.state(pair.prefill, "r") is PrefillRequestState.COMPUTED, relay=False)
        pair.run_until(lambda: "r" not in pair.prefill.requests, relay=False, timeout=10)
        failed = [m for _, m in pair.to_router if isinstance(m, P.RequestFailed)]
        assert len(failed) == 1 and failed[0].reason.startswith("timeout: decode's reservation never reached")
        pair.assert_nothing_held()
    finally:
        pair.close()
