"""The model holds one copy of its weights: with the native kernels, only their panels (the [out, in]
originals, the oneDNN copies and a tied embedding's second reference freed, checked on tensor storage), made at
load; the torch forward (prefill) runs from the panels too; switching back gives the exact weights again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.models.llama import PROJECTIONS


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file mapped at t's first byte (from /proc/self/maps), or None for anonymous memory."""
    address = t.data_ptr()
    for line in open("/proc/self/maps", encoding="utf-8"):
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def _held_bytes(model: Any) -> int:
    """Bytes of every distinct storage the model's parameters, oneDNN copies and native panels hold."""
    seen: dict[int, int] = {}
    tensors = list(model.parameters()) + ([model._native_head] if model._native_head is not None else [])
    tensors += [p for layer in model.layers for p in layer.panels.values()]
    tensors += [p for layer in model.layers for p in layer.packed.values() if p is not None]
    tensors += [model.lm_head_packed] if model.lm_head_packed is not None else []
    for t in tensors:
        if t.is_mkldnn:  # oneDNN's blocked copies have no storage to ask: count their elements
            seen[id(t)] = t.numel() * t.element_size()
        else:
            seen[t.untyped_storage().data_ptr()] = _storage_bytes(t)
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_a_native_engine_holds_only_the_panels_from_load(make_model: Callable[..., Path], tied: bool) -> None:
    model_dir = make_model("LlamaForCausalLM", seed=1, tie_word_embeddings=tied)
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(str(model_dir), kernels="native"), cache=CacheConfig(page_size=8))
    )
    model: Any = engine.runner.model
    assert model.panels and model._native is not None  # built at load, before any step
    for layer in model.layers:
        assert layer.packed == {}  # no oneDNN copies
        for name in PROJECTIONS:
            assert _storage_bytes(getattr(layer, name)) == 0  # the original [out, in] weight is gone
            assert layer.panels[name].numel() >= layer.shapes[name][0] * layer.shapes[name][1]
    assert model.lm_head_packed is None and _storage_bytes(model.lm_head) == 0
    assert (_storage_bytes(model.embed) == 0) == tied  # a tied embedding is read from the head's panels
    # the native step's list holds the very panels, not copies
    fields = len(model._native.layers) // len(model.layers)
    assert model._native.layers[1].data_ptr() == model.layers[0].panels["qkv_w"].data_ptr() and fields == 12
    plain = LLMEngine(EngineConfig(model=ModelConfig(str(model_dir), kernels="torch"), cache=CacheConfig(page_size=8)))
    weights = sum(p.numel() * p.element_size() for p in plain.runner.model.parameters())
    assert _held_bytes(plain.runner.model) > 1.5 * weights  # torch kernels: originals + oneDNN copies (not embed)
    assert _held_bytes(model) < 1.1 * weights  # native: one copy (panels pad the columns to 32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    from kvfence.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, params)]  # prefill from the panels, decode natively
    assert got == [c.token_ids for c in plain.generate(prompts, params)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switching_to_panels_and_back_gives_the_same_weights(
    make_model: Callable[..., Path], dtype: torch.dtype
) -> None:
    from kvfence.models.linear import onednn_available
    from kvfence.models.loader import load_model

    lm = load_model(make_model("Qwen2ForCausalLM", seed=2, tie_word_embeddings=True), dtype=dtype, progress=False)
    model: Any = lm.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.use_native_kernels(True)
    assert model.panels and all(_storage_bytes(getattr(model.layers[0], n)) == 0 for n in PROJECTIONS)
    ids = torch.tensor([0, 31, 32, 100, 2047])  # panel edges
    assert torch.equal(model._embed_rows(ids), before["embed"][ids])  # the tied embedding from the panels
    model.use_native_kernels(False)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    # oneDNN copies again, where oneDNN takes this dtype (bf16 needs a CPU with native bf16 for it; not on AVX2)
    assert (model.lm_head_packed is not None) == onednn_available(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processes_loading_one_model_map_one_file_of_panels(
    make_model: Callable[..., Path], tmp_path: Path, dtype: torch.dtype
) -> None:
    """With a shared panel directory (a disaggregated deployment's workers), the panels live in one file that
    each load maps: the second load writes nothing and reads the same bytes; the forward is unchanged."""
    from kvfence.models.loader import load_model

    model_dir = make_model("LlamaForCausalLM", seed=4, tie_word_embeddings=True)
    tmp_path = tmp_path / "panels"
    alone: Any = load_model(model_dir, dtype=dtype, progress=False, panels=True).model
    first: Any = load_model(model_dir, dtype=dtype, progress=False, panels=True, shared_panels_dir=tmp_path).model
    (path,) = tmp_path.iterdir()
    assert _mapped_file(alone._native_head) is None  # without a shared directory: anonymous memory
    written = path.stat().st_mtime_ns
    second: Any = load_model(model_dir, dtype=dtype, progress=False, panels=True, shared_panels_dir=tmp_path).model
    assert path.stat().st_mtime_ns == written and list(tmp_path.iterdir()) == [path]  # mapped, not rewritten
    for model in (first, second):
        head = model._native_head
        assert _mapped_file(head) == str(path)  # file-backed, not anonymous memory
        assert _mapped_file(model._native.layers[1]) == str(path)  # the step reads the mapping
        assert torch.equal(head, alone._native_head)
        for a, b in zip(model.blocks, alone.blocks, strict=True):
            assert all(torch.equal(a.panels[n], b.panels[n]) for n in PROJECTIONS)
    path.write_bytes(b"\0" * path.stat().st_size)  # other bytes under this name: refused, not used
    with pytest.raises(ValueError, match="does not hold this model's panels"):
        load_model(model_dir, dtype=dtype, progress=False, panels=True, shared_panels_dir=tmp_path)


def test_a_new_panel_file_replaces_the_older_ones_of_its_model_and_dtype(tmp_path: Path) -> None:
    from kvfence.models.loader import _drop_older_panel_files

    names = ["Qwen2.5-0.5B-aaaa.bfloat16.panels", "Qwen2.5-0.5B-bbbb.float32.panels", "Qwen2.5-7B-cccc.bfloat16.panels"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    _drop_older_panel_files(tmp_path / "Qwen2.5-0.5B-dddd.bfloat16.panels")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])  # same model and dtype only


@pytest.mark.slow
@pytest.mark.parametrize(("role", "shares"), [("prefill", True), ("decode", True), ("aggregated", False)])
def test_worker_roles_map_the_shared_panel_file_and_an_aggregated_engine_does_not(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str, shares: bool
) -> None:
    from kvfence.cli import build_parser
    from kvfence.server.role_engine import build_role_engine

    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))
    args = build_parser().parse_args(
        ["serve", "--role", "aggregated", "--model", str(tiny_llama_dir), "--kernels", "native"]
        + ["--page-size", "4", "--max-total-tokens", "512", "--context-length", "256"]
    )
    model: Any = build_role_engine(args, str(tiny_llama_dir), role).engine.runner.model
    files = list((tmp_path / "panels").glob("*.panels")) if (tmp_path / "panels").exists() else []
    assert model.panels and len(files) == int(shares)
    assert _mapped_file(model._native_head) == (str(files[0]) if shares else None)
