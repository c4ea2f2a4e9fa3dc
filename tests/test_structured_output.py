"""response_format grammars (xgrammar) in the engine: on the tiny random Llama, whose unconstrained
output is gibberish, every constrained output parses and validates (jsonschema), greedy and sampled,
and across a prefill -> decode handoff (the grammar continues from prefill's first token)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams, StructuredOutputs
from kvfence.errors import InvalidRequestError
from tests.helpers.schemas import SCHEMA


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    config = EngineConfig(ModelConfig(str(tiny_llama_dir)), CacheConfig(page_size=16, max_total_tokens=4096))
    return LLMEngine(config)


def prompt(engine: LLMEngine, i: int) -> list[int]:
    return engine.tokenizer.encode(f"request {i}: describe the cache page as JSON")


def test_schema_outputs_parse_and_validate_greedy_and_sampled(engine: LLMEngine) -> None:
    so = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(max_tokens=150, temperature=0, structured_outputs=so)] + [
        SamplingParams(max_tokens=150, temperature=1.0, seed=s, structured_outputs=so) for s in range(3)
    ]
    outs = engine.generate([prompt(engine, i) for i in range(4)], params)  # one batch: masks are per row
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    free = engine.generate([prompt(engine, 0)], SamplingParams(max_tokens=60, temperature=0))[0]
    with pytest.raises(ValueError):
        json.loads(free.text)  # without the grammar the random model writes no JSON


def test_json_object_output_is_one_object(engine: LLMEngine) -> None:
    quote, close = (engine.tokenizer.encode(t, add_special_tokens=False) for t in ('"', "}"))
    assert len(quote) == len(close) == 1
    # a random model rarely ends a string or a number on its own: a bias towards '"' and '}' keeps it short
    so = StructuredOutputs(json_object=True)
    objects = []
    for s in range(4):
        bias = {quote[0]: 8.0, close[0]: 5.0}
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=so, logit_bias=bias)
        c = engine.generate([prompt(engine, s)], params)[0]
        assert c.finish_reason == "stop", c.text
        objects.append(json.loads(c.text))
    assert all(isinstance(o, dict) for o in objects) and any(objects)  # objects, and not all of them empty


def test_a_schema_xgrammar_cannot_compile_is_a_request_error(engine: LLMEngine) -> None:
    bad = StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", sampling_params=SamplingParams(structured_outputs=bad), prompt_token_ids=[5, 6])
    assert e.value.param == "response_format" and "nowhere" in str(e.value)
    assert not engine.has_unfinished_requests()


def test_prefill_then_decode_continues_the_grammar(engine: LLMEngine) -> None:
    """Prefill samples the first token under the grammar; decode's grammar accepts it and goes on (real
    in-process disaggregation), giving the aggregated engine's tokens for the same seed."""
    from kvfence.disagg.router import RouterConfig
    from tests.helpers.inprocess import InProcessDeployment

    sp = SamplingParams(max_tokens=150, temperature=1.0, seed=9, structured_outputs=StructuredOutputs(json=SCHEMA))
    ids = prompt(engine, 7)
    want = engine.generate([ids], sp)[0]

    async def collect(dep: InProcessDeployment) -> list[Any]:
        return [c async for c in dep.router.generate("g", ids, sp)]

    with InProcessDeployment(
        engine.config, engine.config, RouterConfig(handoff_deadline_s=30), loaded=engine.loaded, model_fingerprint="t"
    ) as dep:
        chunks = asyncio.run(collect(dep))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert chunks[-1].finish_reason == "stop" and chunks[-1].integrity["status"] == "verified"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), SCHEMA)


def test_decode_refuses_a_first_token_the_grammar_forbids(engine: LLMEngine) -> None:
    sp = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA))
    ids = prompt(engine, 8)
    assert engine.reserve("e", len(ids) + 8) is not None
    x = engine.tokenizer.encode("x", add_special_tokens=False)[0]  # a JSON object cannot start with x
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.add_prefilled_request("e", ids, x, sp)
    engine.release("e")
    assert engine.scheduler.num_free_pages == engine.allocator.num_pages
