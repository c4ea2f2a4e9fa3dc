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
from kvfence.disagg.decode import DecodeConfig, DecodeWorker
from kvfence.disagg.handoff import DecodeState, PrefillState
from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
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
    """A prefill and a decode worker joined by the local transport; `order` plays the router's part."""

    def __init__(self, loaded: Any, decode_pool_tokens: int = 1024, prefill_deadline_s: float = 30.0) -> None:
        auth, fabric = plane_auth(), LocalFabric()

        def engine(pool: int) -> LLMEngine:
            config = EngineConfig(
                ModelConfig(str(loaded.model_dir)), CacheConfig(16, pool), context_length=min(256, pool)
            )
            return LLMEngine(config, loaded=loaded)

        pe, de = engine(1024), engine(decode_pool_tokens)
        self.prefill = PrefillWorker(
            pe, WorkerIdentity("prefill-0", "m", "fp", {}),
            PrefillConfig(transport="local", deadline_s=prefill_deadline_s),
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
        """The router's two orders for `rid` (one capability), or only one of them."""
        xid, wire = new_transfer_id(), P.params_to_wire(PARAMS)
        if to_decode:
            self.decode.handle(
                P.Order(rid, PROMPT, xid, wire, tokens_expected=len(PROMPT), token_hash=token_hash(PROMPT))
            )
        if to_prefill:
            self.prefill.handle(P.Order(rid, PROMPT, xid, wire, decode_address=self.decode.receiver.address))

    def run_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < end, (self.prefill.requests, self.decode.requests)
            self.prefill.step()
            self.decode.step()
            time.sleep(0.001)

    def state(self, worker: Any, rid: str) -> Any:
        req = worker.requests.get(rid)
        return req.state if req is not None else None

    def assert_nothing_held(self) -> None:
        for w in (self.prefill, self.decode):
            assert w.held_request_ids() == []
            w.engine.scheduler.check()
            free, total = w.engine.scheduler.num_free_pages, w.engine.allocator.num_pages
            assert free == total, f"{w.role}: {total - free} page(s) still held"

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
    pair.run_until(lambda: not pair.prefill.requests and not pair.decode.requests)
    pair.assert_nothing_held()
    return dropped


def test_prefill_computing(pair: Pair) -> None:
    pair.order("r", to_decode=False)
    assert pair.state(pair.prefill, "r") is PrefillState.COMPUTING
    assert drop_and_drain(pair) == 1


def test_prefill_sending_to_a_decode_that_has_not_reserved(pair: Pair) -> None:
    pair.order("r", to_decode=False)  # decode never reserves: the manifest waits there, the pages here
    pair.run_until(lambda: pair.state(pair.prefill, "r") is PrefillState.SENDING)
    assert pair.prefill.engine.allocator.num_free < pair.prefill.engine.allocator.num_pages
    assert drop_and_drain(pair) == 1


def test_prefill_sending_and_decode_reserved(pair: Pair) -> None:
    pair.order("r")
    assert pair.state(pair.decode, "r") is DecodeState.RESERVED
    pair.prefill.step()  # computes the prompt and sends at once
    assert pair.state(pair.prefill, "r") in (PrefillState.SENDING, PrefillState.AWAITING_VERDICT)
    assert drop_and_drain(pair) == 2


def test_decode_queued_for_pages(loaded: Any) -> None:
    pair = Pair(loaded, decode_pool_tokens=128)  # 8 pages: prompt + max_tokens (104 tokens, 7 pages) fit one
    try:
        pair.order("a", to_prefill=False)
        pair.order("b", to_prefill=False)
        assert pair.state(pair.decode, "a") is DecodeState.RESERVED
        assert pair.state(pair.decode, "b") is DecodeState.QUEUED
        assert drop_and_drain(pair) == 2
    finally:
        pair.close()


def test_decode_running(pair: Pair) -> None:
    pair.order("r")
    pair.run_until(lambda: pair.state(pair.decode, "r") is DecodeState.RUNNING)
    pair.run_until(lambda: "r" not in pair.prefill.requests)  # prefill released on decode's verdict
    assert drop_and_drain(pair) == 1


def test_a_prompt_whose_decode_never_reserves_is_dropped_at_the_deadline(loaded: Any) -> None:
    pair = Pair(loaded, prefill_deadline_s=0.3)
    try:
        pair.order("r", to_decode=False)
        pair.run_until(lambda: "r" not in pair.prefill.requests, timeout=10)
        failed = [m for _, m in pair.to_router if isinstance(m, P.RequestFailed)]
        assert len(failed) == 1 and "decode never accepted the manifest" in failed[0].reason, failed
        assert [m.token_ids for _, m in pair.to_router if isinstance(m, P.Tokens)] != []  # it had computed
        pair.assert_nothing_held()
    finally:
        pair.close()
