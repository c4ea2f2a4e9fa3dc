"""A float32 native prefill keeps few large activations alive at once, with the same values as before.

The aggregated engine's resident peak is its start plus a prefill's live activations and what glibc keeps of
them (docs/benchmarks.md, "Aggregated peak memory"). These check, on a native float32 model, that the MLP never
makes the [T, 2I] gate/up output (gate and up come in column blocks of their panels, into one [T, I] buffer that
every layer of the forward reuses), that SDPA gets contiguous K/V in a prefill (given transposed views, CPU SDPA
keeps a buffer after its first call), and that the logits equal the one-call formula's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvfence.config import CacheConfig, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.models import attention, llama, native_kernels
from kvfence.models.default import make_tiny_model
from kvfence.models.forward_batch import SeqChunk, build_forward_batch


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    try:
        native_kernels.load()
    except native_kernels.NativeKernelsUnavailable as e:
        pytest.skip(str(e))
    # I = 256: several column blocks of whole 32-column panels when the block budget is small
    d: Path = make_tiny_model(tmp_path_factory.mktemp("mlp-blocks"), "LlamaForCausalLM", seed=3, intermediate_size=256)
    return LLMEngine(EngineConfig(model=ModelConfig(str(d), kernels="native"), cache=CacheConfig(page_size=8)))


def _prefill(engine: LLMEngine, lens: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    chunks, page = [], 0
    for n in lens:
        pages = -(-n // 8)
        ids = torch.randint(3, engine.vocab_size, (n,), generator=g).tolist()
        chunks.append(SeqChunk(ids, 0, list(range(page, page + pages)), "all"))
        page += pages
    with torch.inference_mode():
        out: torch.Tensor = engine.runner.model.forward(build_forward_batch(chunks, 8), engine.pool)
    return out


def test_mlp_never_makes_the_whole_gate_up_output(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    model: Any = engine.runner.model
    two_i = 2 * model.layers[0].I
    widths: list[int] = []
    made: list[int] = []
    real_linear, real_empty = native_kernels.packed_linear, torch.Tensor.new_empty

    def linear(x: torch.Tensor, packed: torch.Tensor, n: int, *a: Any) -> torch.Tensor:
        widths.append(n)
        return real_linear(x, packed, n, *a)

    def new_empty(t: torch.Tensor, *size: Any, **kw: Any) -> torch.Tensor:
        made.append(1)
        return real_empty(t, *size, **kw)

    monkeypatch.setattr(native_kernels, "packed_linear", linear)
    monkeypatch.setattr(llama, "_MLP_BLOCK_BYTES", 4 * 32 * 16)  # one 32-column panel per block for 16 rows
    _prefill(engine, [16])
    assert widths and two_i not in widths  # no [T, 2I] output
    assert widths.count(32) == 2 * (two_i // 2 // 32) * len(model.layers)  # gate and up per block per layer
    widths.clear()
    monkeypatch.setattr(llama, "_MLP_BLOCK_BYTES", 0)  # the default: gate and up whole, one call each
    _prefill(engine, [16])
    assert two_i not in widths and widths.count(two_i // 2) == 2 * len(model.layers)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    _prefill(engine, [16])
    assert len(made) == 1  # one [T, I] buffer for every layer of the forward


@pytest.mark.parametrize("block_bytes", [4 * 64 * 16, 2 << 20])
def test_blocked_prefill_equals_the_one_call_formula(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, block_bytes: int
) -> None:
    lens = [16, 5, 11]
    monkeypatch.setattr(llama, "_MLP_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(llama, "_ROPE_ROWS", 7)  # row blocks that do not divide T
    blocked = _prefill(engine, lens)

    def one_call(self: Any, h: torch.Tensor, gate_up: torch.Tensor, scratch: Any) -> torch.Tensor:
        gu = native_kernels.packed_linear(h, gate_up, 2 * self.I, self.gate_up_b)  # [T, 2I]
        act = gu.new_empty(gu.shape[0], self.I)
        native_kernels.silu_mul_into(gu[:, : self.I], gu[:, self.I :], act)  # the native layer's SiLU
        return act

    monkeypatch.setattr(llama.DecoderLayer, "_gate_up_act", one_call)
    monkeypatch.setattr(llama, "_ROPE_ROWS", 1 << 30)
    assert torch.equal(blocked, _prefill(engine, lens))


def test_prefill_sdpa_gets_contiguous_kv(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(k.is_contiguous() and v.is_contiguous())
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    _prefill(engine, [16, 16])  # equal fresh prompts: the causal path
    _prefill(engine, [16, 5])  # ragged: the masked path
    assert seen and all(seen)
