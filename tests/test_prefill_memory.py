"""An engine asked to (KVFENCE_BOUND_HEAP=1) fixes glibc's mmap and trim thresholds; otherwise glibc's own.

The aggregated engine's peak resident memory over its start is a prefill's activations plus what glibc keeps of
them (docs/benchmarks.md, "Aggregated peak memory"); these check that an engine asked to fixes glibc's mmap
threshold, so a large block freed after a step is unmapped instead of kept, that it does not unasked, and that a
user's glibc tunables win.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# Run in a fresh interpreter: in a long-lived one (a pytest worker after other tests) the heap may hold a large
# free chunk from earlier work, and glibc serves a block from its free lists before it asks the mmap threshold.
_PROBE = """
import ctypes, json, sys
from kvfence.models import heap

def mapping_of(address):
    for line in open("/proc/self/maps", encoding="ascii", errors="replace"):
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise LookupError(hex(address))

bounds = heap.bound_step_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))  # glibc's dynamic threshold rises to 16 MiB after this free; fixed, it stays
big = libc.malloc(2 * heap.ENGINE_MMAP_THRESHOLD)
small = libc.malloc(4096)
print(json.dumps({"bounds": bounds, "big": mapping_of(big), "small": mapping_of(small)}))
"""


def _probe_heap(bound: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    env[heap.BOUND_ENV] = bound
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_bounded_heap_maps_a_large_block_on_its_own() -> None:
    if heap._libc() is None or not hasattr(heap._libc(), "mallopt"):
        pytest.skip("not glibc")
    bounded = _probe_heap("1")
    assert bounded["bounds"] == [heap.ENGINE_MMAP_THRESHOLD, heap.ENGINE_TRIM_THRESHOLD]
    assert bounded["big"] != "[heap]"  # a mapping of its own: unmapped when freed
    assert bounded["small"] == "[heap]"  # small blocks still come from the heap
    unbounded = _probe_heap("0")  # glibc's own: the same block stays in the heap after the large free
    assert unbounded["bounds"] is None
    assert unbounded["big"] == "[heap]"


def test_no_fixed_threshold_unasked(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap.BOUND_ENV, raising=False)
    assert _engine(tiny_llama_dir).heap_bounds is None
    monkeypatch.setenv(heap.BOUND_ENV, "0")
    assert heap.bound_step_heap() is None


def test_a_users_glibc_tunable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.BOUND_ENV, "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.bound_step_heap() is None
