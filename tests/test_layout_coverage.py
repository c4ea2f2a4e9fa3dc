"""Every architecture's KV layout covers exactly the per-token state its model keeps.

For each architecture we serve, a tiny random model (transformers' own classes) runs a
real forward into a poisoned pool, and we check:
- every (layer, buffer) of the layout is written at exactly the forward's slots, and
  nothing else in the pool changes;
- the model keeps no per-token state elsewhere: its parameters and buffers are
  unchanged by a forward, and a fresh model instance given only copies of the pages
  (moved to other page numbers) continues exactly as the original would;
- every buffer is read back: perturbing one buffer's pages changes the next logits;
- the page digest (kvfence.integrity.digest, xxh3_64) changes when any single byte of
  any (layer, buffer) slice of any page is flipped (first, middle and last byte).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kvfence.errors import UnsupportedArchitectureError
from kvfence.integrity.digest import bytes_digest, page_digest
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.models.forward_batch import SeqChunk, build_forward_batch
from kvfence.models.registry import resolve_architecture, supported_architectures

PAGE_SIZE = 4
VOCAB = 128

_GQA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)
_MLA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.2,
)

# architecture -> (transformers config class, config kwargs)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", _GQA),
    "Qwen2ForCausalLM": ("Qwen2Config", _GQA),
    "Qwen3ForCausalLM": ("Qwen3Config", {**_GQA, "head_dim": 32}),
    "MistralForCausalLM": ("MistralConfig", {**_GQA, "sliding_window": None}),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", _MLA),
    # a "shared" middle layer (no indexer of its own) must still define its index_k bytes
    "GlmMoeDsaForCausalLM": (
        "GlmMoeDsaConfig",
        dict(_MLA, index_topk=4, index_head_dim=16, index_n_heads=4, indexer_types=["full", "shared", "full"]),
    ),
}


@dataclass
class Arch:
    name: str
    cls: type
    config: Any
    weights: dict[str, torch.Tensor]

    def fresh_model(self) -> Any:
        model = self.cls(self.config, torch.float32)
        model.load_weights(self.weights.items())
        return model

    def layout(self) -> Any:
        return self.cls.kv_layout(self.config, PAGE_SIZE, torch.float32)


@pytest.fixture(scope="module", params=list(CONFIGS))
def arch(request: pytest.FixtureRequest) -> Arch:
    name = request.param
    config_cls, kwargs = CONFIGS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    return Arch(name, resolve_architecture(name), config, {k: v.clone() for k, v in hf.state_dict().items()})


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _filled(arch: Arch, num_pages: int = 6) -> tuple[Any, KVPool, PageAllocator, list[int]]:
    """A poisoned pool, then a 12-token prefill of request "a" over 3 full pages (not the first ones)."""
    model = arch.fresh_model()
    pool = KVPool(arch.layout(), num_pages)
    pool.poison(range(num_pages))
    alloc = PageAllocator(num_pages)
    alloc.allocate("other", 2)
    pages = alloc.allocate("a", 3)
    ids = _prompt(12)
    model(build_forward_batch([SeqChunk(ids, 0, pages, "last")], PAGE_SIZE), pool)
    return model, pool, alloc, pages


def test_every_registered_architecture_is_covered_here() -> None:
    assert set(supported_architectures()) == set(CONFIGS)


def test_forward_writes_every_layout_buffer_at_its_slots_and_nothing_else(arch: Arch) -> None:
    _, pool, _, pages = _filled(arch)
    layout = pool.layout
    assert [sorted(t) for t in pool.tensors] == [sorted(b.name for b in layout.buffers)] * layout.num_layers
    others = [p for p in range(pool.num_pages) if p not in pages]
    for layer in range(layout.num_layers):
        for spec in layout.buffers:
            t = pool.tensors[layer][spec.name]  # [num_pages, page_size, *token_shape]
            assert not t[pages].isnan().any(), f"{arch.name}: layer {layer} {spec.name!r} not fully written"
            assert t[others].isnan().all(), f"{arch.name}: layer {layer} {spec.name!r} written outside its slots"


def test_model_keeps_no_per_token_state_outside_the_pool(arch: Arch) -> None:
    model = arch.fresh_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layout = arch.layout()
    pool_a = KVPool(layout, 8)
    alloc = PageAllocator(8)
    pages_a = alloc.allocate("a", 3)
    ids = _prompt(10, seed=1)
    model(build_forward_batch([SeqChunk(ids, 0, pages_a, "last")], PAGE_SIZE), pool_a)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a forward changed model state"

    # move the pages to other page numbers in a new pool; a fresh model continues from them alone
    pool_b = KVPool(layout, 8)
    pool_b.poison(range(8))
    pages_b = [7, 2, 5]
    for src, dst in zip(pages_a, pages_b, strict=True):
        pool_b.write_page(dst, pool_a.read_page(src))
    step = [42]
    want = model(build_forward_batch([SeqChunk(step, 10, pages_a, "last")], PAGE_SIZE), pool_a)
    got = arch.fresh_model()(build_forward_batch([SeqChunk(step, 10, pages_b, "last")], PAGE_SIZE), pool_b)
    assert torch.equal(want, got)


def test_every_buffer_is_read_back(arch: Arch) -> None:
    """Perturbing one buffer (all layers, the context's pages) changes the next token's logits."""
    model, pool, alloc, pages = _filled(arch)
    layout = pool.layout
    saved = [pool.read_page(p) for p in pages]
    step = build_forward_batch([SeqChunk([7], 12, pages + alloc.allocate("a", 1), "last")], PAGE_SIZE)
    base = model(step, pool)
    g = torch.Generator().manual_seed(3)
    for spec in layout.buffers:
        for i, page in enumerate(pages):
            pool.write_page(page, saved[i])
        for layer in range(layout.num_layers):
            t = pool.tensors[layer][spec.name]
            t[pages] = torch.randn(t[pages].shape, generator=g) * 3.0
        out = model(step, pool)
        assert (out - base).abs().max() > 1e-3, f"{arch.name}: buffer {spec.name!r} is never read"


def test_page_digest_changes_when_any_byte_of_any_buffer_flips(arch: Arch) -> None:
    _, pool, _, pages = _filled(arch)
    layout = pool.layout
    for page in pages:
        views = pool.page_memoryviews(page)
        assert len(views) == layout.num_layers * len(layout.buffers)
        assert sum(v.nbytes for v in views) == layout.bytes_per_page
        d0 = page_digest(pool, page)
        assert d0 == bytes_digest(b"".join(bytes(v) for v in views)), "digest is not over the page's bytes"
        for i, view in enumerate(views):
            layer, buf = divmod(i, len(layout.buffers))
            for pos in sorted({0, view.nbytes // 2, view.nbytes - 1}):
                view[pos] ^= 0xFF
                assert page_digest(pool, page) != d0, (
                    f"{arch.name}: flipping byte {pos} of layer {layer} {layout.buffers[buf].name!r} "
                    f"on page {page} left the digest unchanged"
                )
                view[pos] ^= 0xFF
        assert page_digest(pool, page) == d0


def test_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        resolve_architecture("GPT2LMHeadModel")
    from kvfence.models.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconMambaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="FalconMambaForCausalLM"):
        load_model(tmp_path, progress=False)
