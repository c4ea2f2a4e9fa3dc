"""The fake EngineClient of tests/helpers/api_fakes.py behaves as the HTTP API tests assume."""

from __future__ import annotations

import asyncio

import pytest

from kvfence.engine.engine_client import GenerationChunk
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import InvalidRequestError
from tests.helpers.api_fakes import FakeEngine, expected_text


def test_fake_engine_stops_at_stop_string_and_records_calls() -> None:
    engine = FakeEngine()

    async def run() -> list[GenerationChunk]:
        params = SamplingParams(max_tokens=20, stop=("c",))
        return [c async for c in engine.generate("r", [97, 97], params)]  # letters start at (194 % 26) = 12 -> "m"

    chunks = asyncio.run(run())
    text = "".join(c.text for c in chunks)
    assert text == expected_text([97, 97], None, 20).split("c")[0] == "mnopqrstuvwxyzab"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].integrity["status"] == "verified"
    assert engine.calls[0][0] == "r" and engine.active == set()


def test_fake_engine_raises_configured_error() -> None:
    engine = FakeEngine(fail_with=InvalidRequestError("nope", param="prompt"))

    async def run() -> None:
        async for _ in engine.generate("r", [1], SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(run())


def test_fake_engine_plays_its_script_and_stops_at_its_end() -> None:
    engine = FakeEngine(script="héllo")

    async def run(max_tokens: int) -> list[GenerationChunk]:
        return [c async for c in engine.generate("r", [1], SamplingParams(max_tokens=max_tokens))]

    whole = asyncio.run(run(50))
    assert "".join(c.text for c in whole) == "héllo" and whole[-1].finish_reason == "stop"
    cut = asyncio.run(run(3))
    assert "".join(c.text for c in cut) == "hél" and cut[-1].finish_reason == "length"
