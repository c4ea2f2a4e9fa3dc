"""A whole disaggregated deployment (router, prefill and decode workers in one process, real tiny model) whose KV
pools all take the device paths: torch digests (mlh62), device canaries, pages through host staging. Every pool
is a CPU pool standing in for a device, as every KVPool the engines build is made non-host-visible here.

Oracle: greedy tokens equal the aggregated engine's; every record is verified with mlh62; a fault aimed at one
request fails it with the expected reason while the others verify; both pools return to baseline."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.engine_client import GenerationChunk
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.faults import FaultInjector
from kvfence.kv.pool import KVPool
from tests.helpers.faults import EXPECTED
from tests.helpers.inprocess import InProcessDeployment


@pytest.fixture
def device_like_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every KVPool built from now on is a device pool for integrity and transfer code."""
    real = KVPool.__init__

    def init(self: KVPool, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **{**kwargs, "host_visible": False})

    monkeypatch.setattr(KVPool, "__init__", init)


def cfg(model_dir: Path, pool_tokens: int) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir)), CacheConfig(page_size=16, max_total_tokens=pool_tokens), context_length=256
    )


def run(
    dep: InProcessDeployment, reqs: list[tuple[str, list[int], SamplingParams]]
) -> dict[str, list[GenerationChunk]]:
    import asyncio

    async def one(rid: str, prompt: list[int], sp: SamplingParams) -> list[GenerationChunk]:
        return [c async for c in dep.router.generate(rid, prompt, sp)]

    async def main() -> list[list[GenerationChunk]]:
        return await asyncio.gather(*[one(*r) for r in reqs])

    return {r[0]: chunks for r, chunks in zip(reqs, asyncio.run(main()), strict=True)}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)


@pytest.mark.parametrize("fault", [None, "corrupt_byte", "stale_page", "short_write"])
def test_disaggregated_through_device_paths_equals_aggregated(
    loaded: Any, device_like_pools: None, fault: str | None
) -> None:
    rng = random.Random(5)
    reqs = [(f"r{i}", [rng.randrange(10, 2000) for _ in range(n)], greedy(6)) for i, n in enumerate([3, 17, 40, 90])]
    faults = FaultInjector().enable(fault, request_id="r2", page=1) if fault else None
    dep = InProcessDeployment(
        cfg(loaded.model_dir, 1024), cfg(loaded.model_dir, 1024), loaded=loaded, model_fingerprint="t", faults=faults
    )
    try:
        assert not dep.prefill_engine.pool.host_visible and not dep.decode_engine.pool.host_visible
        info = dep.router.server_info()  # what the manifests will name, per worker and for the deployment
        assert info["digest_algorithm"] == "mlh62" and {w["digest_algorithm"] for w in info["workers"].values()} == {
            "mlh62"
        }
        got = run(dep, reqs)
        assert dep.wait_idle(15)
        for engine in (dep.prefill_engine, dep.decode_engine):
            engine.scheduler.check()
            assert engine.scheduler.num_free_pages == engine.allocator.num_pages
        assert not dep.errors
    finally:
        dep.close()
    want = LLMEngine(cfg(loaded.model_dir, 4096), loaded=loaded).generate([p for _, p, _ in reqs], greedy(6))
    for (rid, _, _), ref in zip(reqs, want, strict=True):
        record = got[rid][-1].integrity
        assert record is not None
        if fault is not None and rid == "r2":
            assert record["status"] == "rejected" and record["reason"] == EXPECTED[fault], record
            continue
        assert record["status"] == "verified" and record["digest_algorithm"] == "mlh62", record
        assert [t for c in got[rid] for t in c.token_ids] == ref.token_ids, rid
