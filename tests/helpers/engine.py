"""Engine helpers the engine tests share: an engine on a loaded tiny model, running requests to completion
with pool conservation checked at every step, seeded prompts, transformers' greedy tokens, and whether the native
kernels build here."""

from __future__ import annotations

from typing import Any

import torch

from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams


def native_unavailable() -> str | None:
    from kvfence.models.native_kernels import NativeKernelsUnavailable, load

    try:
        load()
    except NativeKernelsUnavailable as e:
        return str(e)
    return None


def make_engine(
    loaded: Any,
    *,
    max_total_tokens: int | None = None,
    page_size: int = 16,
    context_length: int | None = None,
    kernels: str = ModelConfig.kernels,
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
    **sched: Any,
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(loaded.model_dir), kernels=kernels),
        cache=CacheConfig(
            page_size=page_size, max_total_tokens=max_total_tokens, enable_prefix_caching=enable_prefix_caching
        ),
        scheduler=SchedulerConfig(**sched),
        context_length=context_length,
    )
    return LLMEngine(config, loaded=loaded)


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), generation_config=gc)
    return out[0, len(prompt) :].tolist()


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Run to completion, checking conservation after every step and pages back to baseline at the end (pages the
    prefix cache holds that no request reads count as free, as they do for allocation)."""
    free0 = engine.scheduler.num_free_pages
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        engine.add_request(f"r{i}", sampling_params=sp, prompt_token_ids=p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.scheduler.check()  # the allocator's conservation, and the prefix cache's refcounts when it has one
    assert engine.scheduler.num_free_pages == free0 == engine.allocator.num_pages
    return [out[f"r{i}"] for i in range(len(prompts))]


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
