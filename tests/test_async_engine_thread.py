"""The aggregated engine thread: when it dies outside a step, the requests in flight get the error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfence.engine.async_engine import AsyncLLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError
from tests.helpers.engine import make_engine


def test_a_request_in_flight_gets_the_error_when_the_engine_thread_dies_outside_a_step(loaded: Any) -> None:
    client = AsyncLLMEngine(make_engine(loaded, kernels="torch"), "tiny")
    calls = 0
    real = client._take_snapshot

    def snapshot_that_fails_once_running() -> None:
        nonlocal calls
        calls += 1
        if calls > 2:  # the constructor's and the first loop pass's succeed; then a bug outside the step
            raise RuntimeError("snapshot bug")
        real()

    client._take_snapshot = snapshot_that_fails_once_running  # type: ignore[method-assign]

    async def run() -> None:
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        with pytest.raises(KvfenceError, match="engine thread stopped: RuntimeError: snapshot bug"):
            async for _ in client.generate("r1", [1, 2, 3, 4], params):
                pass
        with pytest.raises(KvfenceError, match="not running"):
            async for _ in client.generate("r2", [1, 2, 3], params):
                pass

    client.start()
    try:
        asyncio.run(asyncio.wait_for(run(), timeout=30))
    finally:
        client.shutdown(timeout=5)
    with pytest.raises(KvfenceError, match="not running"):
        client.check_health()
