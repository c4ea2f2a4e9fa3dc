"""A prefill's transient memory: the MLP in row chunks (same bits as in one piece) and glibc's fixed thresholds.

The aggregated engine's peak resident memory over its start is a prefill's activations plus what glibc keeps of
them (docs/benchmarks.md, "Aggregated peak memory"); these check that the chunked MLP computes exactly what the
unchunked one does, against transformers too, and that an engine fixes glibc's mmap threshold so a large block
freed after a step is unmapped instead of kept.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.models import heap
from kvfence.models import llama as llama_module
from kvfence.models.loader import load_model
from tests.test_models_llama import PagedRunner, assert_close, hf_logits, hf_model, prompt_of

LENGTHS = (40, 33, 27)  # 100 prefill rows in one forward


def _prefill_logits(d: Path, rows: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[int]]:
    """Every prompt's logits (all rows) from one native float32 prefill with MLP chunks of `rows`, and 3
    greedy decode tokens of the first prompt after it."""
    monkeypatch.setattr(llama_module, "PREFILL_MLP_ROWS", rows)
    lm = load_model(d, progress=False)
    model: Any = lm.model  # a LlamaForCausalLM
    model.use_native_kernels(True)
    runner = PagedRunner(lm)
    prompts = [prompt_of(n, seed=20 + i) for i, n in enumerate(LENGTHS)]
    got = runner.forward([(f"s{i}", p, "all") for i, p in enumerate(prompts)])
    tokens = [int(got[0][-1].argmax())]
    for _ in range(2):
        (lg,) = runner.forward([("s0", [tokens[-1]], "last")])
        tokens.append(int(lg[0].argmax()))
    runner.alloc.check()
    return got, tokens


def test_chunked_prefill_mlp_equals_one_piece_bit_for_bit(make_model, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_model(seed=5)
    calls: list[int] = []
    real = llama_module.DecoderLayer._mlp_rows

    def counting(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(llama_module.DecoderLayer, "_mlp_rows", counting)
    whole, whole_tokens = _prefill_logits(d, 10**9, monkeypatch)
    assert calls[:2] == [sum(LENGTHS)] * 2  # one piece per layer (2 layers)
    calls.clear()
    chunked, chunked_tokens = _prefill_logits(d, 16, monkeypatch)
    assert calls[:8] == [16] * 6 + [4, 16]  # 100 rows: 6 chunks of 16 and one of 4, then the next layer
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
    assert chunked_tokens == whole_tokens
    ref = hf_model(d)
    for i, n in enumerate(LENGTHS):  # and against transformers' forward of each prompt
        assert_close(chunked[i], hf_logits(ref, prompt_of(n, seed=20 + i)))


def test_an_engine_fixes_glibcs_thresholds(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model_dir=str(tiny_llama_dir)), cache=CacheConfig()))
    if heap._libc() is None or not hasattr(heap._libc(), "mallopt"):
        pytest.skip("not glibc")
    assert engine.heap_bounds == heap.HeapBounds(heap.ENGINE_MMAP_THRESHOLD, heap.ENGINE_TRIM_THRESHOLD)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # glibc's dynamic threshold would rise to 32 MiB after this free; fixed, it stays
    libc.free(libc.malloc(32 << 20))
    size = 2 * heap.ENGINE_MMAP_THRESHOLD
    p = libc.malloc(size)
    try:
        assert p is not None
        assert _mapping_of(p) != "[heap]"  # a mapping of its own: unmapped when freed
    finally:
        libc.free(p)
    small = libc.malloc(4096)
    try:
        assert _mapping_of(small) == "[heap]"  # small blocks still come from the heap
    finally:
        libc.free(small)


def test_a_users_glibc_tunable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.bound_step_heap() is None


def _mapping_of(address: int) -> str:
    """The name /proc/self/maps gives the mapping holding `address` ("" for an anonymous one)."""
    for line in open("/proc/self/maps", encoding="ascii", errors="replace"):
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise LookupError(hex(address))
