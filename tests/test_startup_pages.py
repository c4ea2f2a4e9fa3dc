"""A built engine holds none of the libraries' start-up pages (models.startup_pages), drops only what it can lose
nothing by dropping, and computes the same tokens after the drop.

`import torch` leaves ~45 MiB of libtorch_cpu.so's text resident that runs once (its operator registrations);
docs/benchmarks.md, "The libraries' start-up pages", measures what the drop saves and what faults back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.models import startup_pages
from kvfence.models.startup_pages import Mapping, droppable, read_smaps, release_startup_pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise")


def _libtorch_text_kib() -> int:
    return sum(m.rss_kib for m in read_smaps() if "libtorch_cpu" in m.path and droppable(m))


@linux_only
def test_a_built_engine_holds_no_startup_page_of_libtorch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(startup_pages.ENV, raising=False)
    import torch

    torch.ones(4).sum()  # whatever ran before, libtorch's pages are resident now
    assert _libtorch_text_kib() > 1024
    engine = LLMEngine(EngineConfig(model=ModelConfig(model_dir=str(tiny_llama_dir)), cache=CacheConfig()))
    # the old engine kept every page libtorch's import and the load touched (45+ MiB in a fresh process)
    assert _libtorch_text_kib() < 1024
    assert engine.startup_pages_released_kib > 0


@linux_only
def test_the_same_tokens_after_the_drop(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(startup_pages.ENV, "1")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model_dir=str(tiny_llama_dir)), cache=CacheConfig()))
    assert engine.startup_pages_released_kib == 0  # kept when asked
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    prompts = [[5, 6, 7, 8], [9, 10]]
    before = [o.token_ids for o in engine.generate(prompts, params)]
    monkeypatch.delenv(startup_pages.ENV)
    assert release_startup_pages() > 0
    after = [o.token_ids for o in engine.generate(prompts, params)]
    assert after == before


SMAPS = """\
7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /usr/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                 512 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
7f0000100000-7f0000200000 r--p 00100000 08:01 11 /usr/lib/libtorch_cpu.so
Rss:                 100 kB
Anonymous:             4 kB
7f0000200000-7f0000300000 rw-p 00200000 08:01 11 /usr/lib/libtorch_cpu.so
Rss:                 100 kB
Anonymous:             0 kB
7f0000300000-7f0000400000 r--s 00000000 08:01 12 /models/panels.kvfence-panels
Rss:                 100 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r--p 00000000 08:01 13 /models/model.safetensors
Rss:                 100 kB
Anonymous:             0 kB
7f0000500000-7f0000600000 rw-p 00000000 00:00 0 [heap]
Rss:                 100 kB
Anonymous:           100 kB
7f0000600000-7f0000700000 r--p 00000000 00:00 0
Rss:                 100 kB
Anonymous:             0 kB
7f0000700000-7f0000800000 r--p 00000000 08:01 14 /usr/lib/libc.so.6
Rss:                  40 kB
Anonymous:             0 kB
7f0000800000-7f0000900000 ---p 00000000 08:01 14 /usr/lib/libc.so.6
Rss:                   0 kB
Anonymous:             0 kB
"""


def test_only_clean_private_library_mappings_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "smaps"
    path.write_text(SMAPS)
    maps = read_smaps(str(path))
    assert len(maps) == 9
    assert maps[0] == Mapping(0x7F0000000000, 0x7F0000100000, "r-xp", "/usr/lib/libtorch_cpu.so", 512, 0)
    # text and clean read-only data of a library; never: a copy-on-write page (relocations), a writable mapping,
    # a shared mapping (a worker's weight panels), a file that is not a library, the heap, anonymous memory,
    # a guard region with nothing resident
    assert [droppable(m) for m in maps] == [True, False, False, False, False, False, False, True, False]


def test_the_launcher_drops_its_startup_pages_before_it_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfence.disagg import launcher as launcher_mod

    events: list[str] = []

    class FakeLauncher:
        def __init__(self, config: object, key: object = None) -> None:
            self.ports = launcher_mod.LaunchedPorts(http=1, control=2, handoff=(3,))
            self.base_url = "http://127.0.0.1:1"
            self.key = type("K", (), {"key_id": "k", "secure": False})()

        def start(self) -> None:
            events.append("start")

        def watch(self) -> int:
            events.append("watch")
            return 0

    monkeypatch.setattr(launcher_mod, "Launcher", FakeLauncher)
    monkeypatch.setattr(startup_pages, "release_startup_pages", lambda: events.append("release") or 0)
    assert launcher_mod.launch(launcher_mod.LaunchConfig()) == 0
    assert events == ["start", "release", "watch"]
