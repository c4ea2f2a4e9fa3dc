"""A prefill worker's load report counts each queued prompt less the tokens the router expected its prefix cache
to serve (`Order.expected_cached_tokens`): the same measure as the router's in-transit cost for that order, so
the router compares like with like whether or not a report has covered the order yet."""

from __future__ import annotations

from typing import Any

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.disagg import messages as P
from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
from kvfence.disagg.worker import WorkerIdentity, drop_requests
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.transfer.base import new_transfer_id
from kvfence.transfer.local import LocalFabric, LocalSender
from tests.helpers.auth import plane_auth

PARAMS = P.params_to_wire(SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))


def test_queued_prompt_tokens_leave_out_what_the_router_expects_the_cache_to_serve(loaded: Any) -> None:
    auth = plane_auth()
    engine = LLMEngine(
        EngineConfig(ModelConfig(str(loaded.model_dir)), CacheConfig(16, 1024), context_length=256), loaded=loaded
    )
    worker = PrefillWorker(
        engine, WorkerIdentity("prefill-0", "m", "fp", {}), PrefillConfig(transport="local"),
        sender=LocalSender(LocalFabric(), engine.pool, auth=auth), auth=auth,
    )  # fmt: skip
    worker.attach(lambda m: None)
    try:
        assert worker.stats()["queued_prompt_tokens"] == 0
        worker.handle(P.Order("a", list(range(5, 45)), new_transfer_id(), PARAMS, decode_address="tcp://d:1",
                              expected_cached_tokens=32))  # fmt: skip
        assert worker.stats()["queued_prompt_tokens"] == 40 - 32
        worker.handle(P.Order("b", list(range(5, 25)), new_transfer_id(), PARAMS, decode_address="tcp://d:1"))
        assert worker.stats()["queued_prompt_tokens"] == 8 + 20  # no expectation: the whole prompt
        assert drop_requests(worker, "test over") == 2
        assert worker.stats()["queued_prompt_tokens"] == 0
        engine.scheduler.check()
        assert engine.scheduler.num_free_pages == engine.allocator.num_pages
    finally:
        worker.close()
