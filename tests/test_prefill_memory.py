"""A prefill's transient memory: glibc's thresholds fixed by an engine whose tensors come in huge pages.

The aggregated engine's peak resident memory over its start is a prefill's activations plus what glibc keeps of
them (docs/benchmarks.md, "Aggregated peak memory"); these check that an engine fixes glibc's mmap threshold, so
a large block freed after a step is unmapped instead of kept, exactly when torch's blocks come in huge pages,
that the CLI asks torch for them before torch loads, and that a user's settings win.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.models import heap


def _engine(d: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model_dir=str(d)), cache=CacheConfig()))


def test_an_engine_fixes_glibcs_thresholds(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, thp_mode: Callable[[str], None]
) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(heap.TORCH_THP_ENV, "1")
    thp_mode("always [madvise] never")
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


def test_no_fixed_threshold_without_huge_pages(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, thp_mode: Callable[[str], None]
) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv(heap.TORCH_THP_ENV, raising=False)
    assert _engine(tiny_llama_dir).heap_bounds is None  # torch not asked for huge pages
    monkeypatch.setenv(heap.TORCH_THP_ENV, "1")
    thp_mode("always madvise [never]")
    assert heap.bound_step_heap() is None  # asked, but the kernel gives none
    monkeypatch.setattr(heap, "_THP_MODE", "/nonexistent/transparent_hugepage/enabled")
    assert heap.bound_step_heap() is None


def test_a_users_glibc_tunable_wins(monkeypatch: pytest.MonkeyPatch, thp_mode: Callable[[str], None]) -> None:
    monkeypatch.setenv(heap.TORCH_THP_ENV, "1")
    thp_mode("[always] madvise never")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.bound_step_heap() is None


def test_the_cli_asks_torch_for_huge_pages_before_torch_loads() -> None:
    # records whether torch had loaded when the CLI asked (`bench --help` imports the bench modules, torch with them)
    probe = (
        "import os, sys\n"
        "from kvfence import cli\n"
        "seen = []\n"
        "ask = cli.ask_torch_for_huge_pages\n"
        "cli.ask_torch_for_huge_pages = lambda: (seen.append('torch' in sys.modules), ask())\n"
        "try:\n    cli.main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), seen, 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != heap.TORCH_THP_ENV}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "1 [False] True"
    env[heap.TORCH_THP_ENV] = "0"  # the user's value stands
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 [False] True"


@pytest.fixture
def thp_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """thp_mode(text): the kernel's transparent_hugepage/enabled reads `text` for models.heap."""

    def set_mode(text: str) -> None:
        f = tmp_path / "enabled"
        f.write_text(text + "\n")
        monkeypatch.setattr(heap, "_THP_MODE", str(f))

    return set_mode


def _mapping_of(address: int) -> str:
    """The name /proc/self/maps gives the mapping holding `address` ("" for an anonymous one)."""
    for line in open("/proc/self/maps", encoding="ascii", errors="replace"):
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise LookupError(hex(address))
