"""An engine asked to (KVFENCE_BOUND_HEAP=1) fixes glibc's mmap and trim thresholds; otherwise glibc's own.

The aggregated engine's peak resident memory over its start is a prefill's activations plus what glibc keeps of
them (docs/benchmarks.md, "Aggregated peak memory"); these check that an engine asked to fixes glibc's mmap
threshold, so a large block freed after a step is unmapped instead of kept, that it does not unasked, and that a
user's glibc tunables win.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.models import heap


def _engine(d: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model_dir=str(d)), cache=CacheConfig()))


def test_an_engine_asked_fixes_glibcs_thresholds(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(heap.BOUND_ENV, "1")
    engine = _engine(tiny_llama_dir)
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


def test_no_fixed_threshold_unasked(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap.BOUND_ENV, raising=False)
    assert _engine(tiny_llama_dir).heap_bounds is None
    monkeypatch.setenv(heap.BOUND_ENV, "0")
    assert heap.bound_step_heap() is None


def test_a_users_glibc_tunable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.BOUND_ENV, "1")
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
