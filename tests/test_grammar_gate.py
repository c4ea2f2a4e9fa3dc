"""The front end's grammar compiler is made once, on the first grammar, however many requests ask at once; a
failure to make it fails that request and the next one tries again.

Before this, concurrent first grammars each made a compiler (~1.2 s of a core each), and the engine's own was
made without a lock, so the front end and the step loop could each make one and the step loop would then compile
the grammar a second time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest

from kvfence.config import EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.engine.structured_output import GrammarBudget, GrammarCompiler, _key
from kvfence.models.tokenizer import Tokenizer
from kvfence.server.grammar_gate import GrammarGate

SCHEMA = '{"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}'


class CountingFactory:
    """Makes real GrammarCompilers for the tiny tokenizer, counting them; the first `failures` calls raise."""

    def __init__(self, tokenizer: Tokenizer, failures: int = 0) -> None:
        self.tokenizer, self.failures = tokenizer, failures
        self.made: list[GrammarCompiler] = []
        self._lock = threading.Lock()

    def __call__(self) -> GrammarCompiler:
        with self._lock:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("no compiler this time")
        compiler = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)
        with self._lock:
            self.made.append(compiler)
        return compiler


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def _check_all(gate: GrammarGate, n: int) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(gate.check, StructuredOutputs(json=SCHEMA))

    anyio.run(main)


def test_concurrent_first_grammars_make_one_compiler_and_use_it(tokenizer: Tokenizer) -> None:
    factory = CountingFactory(tokenizer)
    _check_all(GrammarGate(tokenizer, tokenizer.vocab_size, GrammarBudget(), factory), 4)
    assert len(factory.made) == 1
    assert factory.made[0]._cached(_key(StructuredOutputs(json=SCHEMA))) is not None  # compiled into that one


def test_a_failed_make_fails_its_request_and_the_next_tries_again(tokenizer: Tokenizer) -> None:
    factory = CountingFactory(tokenizer, failures=1)
    gate = GrammarGate(tokenizer, tokenizer.vocab_size, GrammarBudget(), factory)
    with pytest.raises(RuntimeError, match="no compiler this time"):
        anyio.run(gate.check, StructuredOutputs(json=SCHEMA))
    anyio.run(gate.check, StructuredOutputs(json=SCHEMA))
    assert len(factory.made) == 1


def test_a_fake_tokenizer_has_no_grammar_check() -> None:
    gate = GrammarGate(object(), 32, GrammarBudget())
    anyio.run(gate.check, StructuredOutputs(json=SCHEMA))  # not checked here: nothing made
    assert not gate.usable and gate._compiler is None


def test_the_engine_makes_one_compiler_when_asked_from_two_threads(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(ModelConfig(str(tiny_llama_dir))))
    barrier = threading.Barrier(3)

    def ask(_: int) -> GrammarCompiler:
        barrier.wait()
        return engine.grammar_compiler()

    with ThreadPoolExecutor(3) as pool:
        compilers = list(pool.map(ask, range(3)))
    assert compilers[0] is compilers[1] is compilers[2]
