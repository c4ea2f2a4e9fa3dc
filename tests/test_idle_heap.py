"""An engine that goes idle hands its heap's free pages back (malloc_trim), once per idle transition, off the step.

glibc keeps a step's freed activations in the heap once its mmap threshold has risen, so an idle server would keep
the resident memory of its largest prefill (docs/benchmarks.md, "Memory of the runtime").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvfence.engine import llm_engine
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams


def test_the_heap_is_trimmed_when_the_engine_goes_idle(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one decode step per forward, so that "b" runs several steps alone after "a" finished
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model_dir=str(tiny_llama_dir)),
            cache=CacheConfig(),
            scheduler=SchedulerConfig(max_decode_steps=1),
        )
    )
    busy_at_trim: list[bool] = []

    def trim() -> None:
        busy_at_trim.append(engine.scheduler.has_unfinished())

    monkeypatch.setattr(llm_engine, "release_freed_heap", trim)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", sampling_params=short, prompt_token_ids=[5, 6, 7])
    engine.add_request("b", sampling_params=long, prompt_token_ids=[8, 9])
    steps: list[Any] = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
        if engine._trim_thread is not None:
            engine._trim_thread.join()
        assert busy_at_trim in ([], [False]), busy_at_trim  # none while "b" still runs after "a" finished
    assert len(steps) >= 6
    assert busy_at_trim == [False]  # once, when the last request finished
    engine.add_request("c", sampling_params=short, prompt_token_ids=[5])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._trim_thread is not None
    engine._trim_thread.join()
    assert busy_at_trim == [False, False]  # and again at the next idle transition
