"""Shared fixtures: tiny random Hugging Face model directories made by transformers' own classes.

`tiny_llama_dir` is one session-wide Llama directory (read-only by convention); `loaded` is our model
and `hf_model` transformers' (the oracle) loaded from it, once per test module; `make_model` builds a
fresh directory per call in the test's tmp dir, with config overrides.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfence.models.default import make_tiny_model

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]

# pytest-timeout fails a test from a signal handler, which never runs while the main thread waits in native code,
# or for a GIL that a thread in native code holds. faulthandler's watchdog is a C thread that needs neither: this
# long after a test's own timeout it prints every thread's stack to the stderr the run started with and ends the
# process, so a hung test becomes a crashed worker (xdist reports it and goes on) instead of a run that never ends.
# xdist requeues the crashed test with the rest of its file (--dist loadfile), so a hang that repeats would crash
# worker after worker, 11 minutes each: `pytest_configure` bounds the restarts to one unless the command line sets
# --max-worker-restart (not in pyproject's addopts: .ci/vllm.sh runs pytest without xdist, which would refuse it).
# (pytest's own faulthandler_timeout takes one limit for every test; this one follows each test's timeout marker.)
WATCHDOG_GRACE_ENV = "KVFENCE_TEST_WATCHDOG_GRACE_S"  # seconds past the timeout (default 60; its own test sets 1)
_STDERR_COPY = pytest.StashKey[int]()  # fd 2 as it was before any test's capture replaced it


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STDERR_COPY] = os.dup(sys.__stderr__.fileno() if sys.__stderr__ is not None else 2)
    if getattr(config.option, "maxworkerrestart", "unset") is None:  # xdist is here and the command set no bound
        config.option.maxworkerrestart = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STDERR_COPY in config.stash:
        os.close(config.stash[_STDERR_COPY])
        del config.stash[_STDERR_COPY]


def _timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout limit: its own marker's, else --timeout's, else the ini value (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    option = item.config.getoption("timeout", None)
    return float(option if option is not None else item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    limit = _timeout_of(item)
    stderr = item.config.stash.get(_STDERR_COPY, None)
    if limit > 0 and stderr is not None:
        grace = float(os.environ.get(WATCHDOG_GRACE_ENV, "60"))
        faulthandler.dump_traceback_later(limit + grace, exit=True, file=stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def _offline_hub() -> None:
    """No test may reach the network: the Hugging Face hub is switched off for the session."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads, vocab 2048) shared by the whole session; do not modify."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM", seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Any:
    """kvfence's model loaded from `tiny_llama_dir` (fp32), shared by one test module."""
    from kvfence.models.loader import load_model

    return load_model(tiny_llama_dir, progress=False)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    """transformers' model of `tiny_llama_dir` (fp32, eval), the oracle, shared by one test module."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_model(tmp_path: Path) -> Callable[..., Path]:
    """Factory: make_model(arch="LlamaForCausalLM", seed=0, **config_overrides) -> a new model directory."""
    counter = iter(range(1_000_000))

    def _make(architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any) -> Path:
        return make_tiny_model(tmp_path / f"{architecture}-{next(counter)}", architecture, seed=seed, **overrides)

    return _make


@pytest.fixture
def kvfence_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, private KVFENCE_CACHE_DIR for tests that build the default model."""
    d = tmp_path / "kvfence-cache"
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(d))
    return d
