"""The opt-in C++ kernels (models.native_kernels): decode attention equals torch attention over the same
pages, a row does not depend on its batch-mates, RMSNorm equals torch's, the small-batch projection equals
a float64 product whatever the batch, the one-call decode step equals the torch forward for every
Llama-family switch, and an engine running them gives transformers' greedy tokens.

Building the kernel takes a minute or more on two cores, so the tests that need it are slow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from tests.helpers.native import PAGE, attention_case, decode_batch, reference_attention, torch_then_native


@pytest.mark.slow
@pytest.mark.parametrize(
    ("H", "Hkv", "D"),
    [(4, 2, 32), (6, 2, 64), (8, 2, 64), (2, 1, 128), (8, 1, 64)],  # generic loops; register-held G = 3, 4, 2; G = 8
)
def test_kernel_equals_torch_attention_over_scattered_pages(H: int, Hkv: int, D: int) -> None:
    from kvfence.models.native_kernels import paged_decode_attention

    q, k, v, pages, lens = attention_case([1, 7, 8, 9, 40, 23], H=H, Hkv=Hkv, D=D)
    got = paged_decode_attention(q, k, v, pages, lens, PAGE, q.shape[-1] ** -0.5)
    assert not got.isnan().any()  # NaN slots past each context are never read
    torch.testing.assert_close(got, reference_attention(q, k, v, pages, lens), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("D", [32, 64])  # the generic loops, the register-held kernel
def test_kernel_row_does_not_depend_on_batch_mates(D: int) -> None:
    from kvfence.models.native_kernels import paged_decode_attention

    q, k, v, pages, lens = attention_case([5, 33, 17, 64], D=D)
    scale = q.shape[-1] ** -0.5
    batched = paged_decode_attention(q, k, v, pages, lens, PAGE, scale)
    for b in range(q.shape[0]):
        P = -(-int(lens[b]) // PAGE)
        alone = paged_decode_attention(q[b : b + 1], k, v, pages[b : b + 1, :P], lens[b : b + 1], PAGE, scale)
        assert torch.equal(alone[0], batched[b])  # bitwise


@pytest.mark.slow
@pytest.mark.parametrize(
    ("H", "Hkv", "D", "dtype"),
    [
        (4, 4, 64, torch.float32),  # G = 1
        (8, 4, 64, torch.float32),  # G = 2
        (12, 4, 64, torch.float32),  # G = 3 (the 100M preset's heads)
        (16, 4, 64, torch.float32),  # G = 4
        (12, 4, 64, torch.bfloat16),
        (12, 4, 128, torch.bfloat16),  # the 0.5B's heads
        (16, 4, 128, torch.bfloat16),
        (4, 2, 128, torch.float32),
        (24, 4, 32, torch.bfloat16),  # G = 6, D = 32: AVX2 takes these too
    ],
)
def test_whole_sequence_units_give_the_per_head_bits(H: int, Hkv: int, D: int, dtype: torch.dtype) -> None:
    """With at least two sequences per thread a unit is one whole sequence (every KV head, whole pool rows, the
    scores of 16 tokens summed together, 8 on AVX2); a batch of one takes one unit per KV head. Both must give
    the same bits, tails of 8 or 16 tokens and of pages included."""
    from kvfence.models.native_kernels import paged_decode_attention

    q, k, v, pages, lens = attention_case([1, 7, 16, 17, 40, 33], H=H, Hkv=Hkv, D=D, seed=5)
    k, v = k.to(dtype), v.to(dtype)
    scale = D**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batched = paged_decode_attention(q, k, v, pages, lens, PAGE, scale)  # whole-sequence units
        for b in range(q.shape[0]):
            P = -(-int(lens[b]) // PAGE)
            alone = paged_decode_attention(q[b : b + 1], k, v, pages[b : b + 1, :P], lens[b : b + 1], PAGE, scale)
            assert torch.equal(alone[0], batched[b])  # bitwise
    finally:
        torch.set_num_threads(threads)
    assert not batched.isnan().any()
    want = reference_attention(q, k.float(), v.float(), pages, lens)
    torch.testing.assert_close(batched, want, rtol=1e-5, atol=1e-5)


def _engine(loaded: Any, backend: str, dtype: str = "float32") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(loaded.model_dir), dtype=dtype, kernels=backend),
        cache=CacheConfig(page_size=PAGE),
    )
    return LLMEngine(config, loaded=loaded)


@pytest.mark.slow
def test_engine_with_native_kernels_matches_transformers(loaded: Any, tiny_llama_dir: Path) -> None:
    import transformers
    from transformers import GenerationConfig

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 64, 9)]
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist() for p in prompts]
    engine = _engine(loaded, "native")
    engine.pool.poison(range(engine.pool.num_pages))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert got == want
    assert engine.runner.model.native and engine.runner.context_cache.num_rebuilds == 0  # the native paths ran


def test_native_kernels_refuses_other_dtypes(loaded: Any) -> None:
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        _engine(loaded, "native", dtype="float16")


def test_auto_kernels_take_the_torch_path_where_native_does_not_apply_or_build(
    loaded: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvfence.models import native_kernels

    assert _engine(loaded, "auto", dtype="float16").resolved.kernels == "torch"  # no native float16 kernels

    def no_compiler() -> Any:
        raise native_kernels.NativeKernelsUnavailable("cannot build the native kernels: no g++ here")

    assert _engine(loaded, "native").resolved.kernels == "native"  # asked for by name: taken
    monkeypatch.setattr(native_kernels, "load", no_compiler)
    with caplog.at_level("WARNING"):
        engine = _engine(loaded, "auto")
    assert engine.resolved.kernels == "torch" and not engine.runner.native_decode
    assert "native kernels unavailable, running the torch kernels: cannot build" in caplog.text
    with pytest.raises(ConfigError, match="--kernels native: cannot build"):  # asked for by name: no fallback
        _engine(loaded, "native")


def test_unknown_kernels_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kernels"):
        ModelConfig("some/dir", kernels="flash")


@pytest.mark.slow
def test_rms_norm_kernel_matches_torch_rms_norm() -> None:
    from kvfence.models.native_kernels import rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 200, generator=g) * 3, torch.randn(200, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (200,), w, 1e-6))


@pytest.mark.slow
@pytest.mark.parametrize("K", [256, 20, 1])  # whole 8-lane steps, a tail, a tail only
def test_small_linear_matches_a_float64_product_and_rows_do_not_depend_on_the_batch(K: int) -> None:
    from kvfence.models.native_kernels import small_linear

    g = torch.Generator().manual_seed(K)
    w, b = torch.randn(37, K, generator=g), torch.randn(37, generator=g)
    x = torch.randn(19, K, generator=g)  # every row-group size: 8 + 8 + 2 + 1
    got = small_linear(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 3, 5, 8, 13):
        assert torch.equal(small_linear(x[:rows], w, b), got[:rows])  # bitwise, whatever shares the call
    assert torch.equal(small_linear(x[7:8], w, b)[0], got[7])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
        ("Qwen2ForCausalLM", {}),  # q/k/v bias
        ("Qwen3ForCausalLM", {}),  # per-head q/k norms
    ],
)
def test_native_decode_step_equals_the_torch_forward(
    make_model: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    import copy
    import dataclasses

    from kvfence.models.loader import load_model

    lm: Any = load_model(make_model(arch, seed=5, **overrides), progress=False)
    pool, fb = decode_batch(lm, [1, 15, 16, 40], seed=1)
    other = copy.deepcopy(pool)
    want, got = torch_then_native(lm, fb, pool, other)
    assert lm.model._native_step_applies(dataclasses.replace(fb, native_decode=True))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer in range(pool.layout.num_layers):  # this step's K/V went to the same slots with the same values
        for name, buf in pool.layer_buffers(layer).items():
            torch.testing.assert_close(other.flat(layer, name)[fb.slot_mapping], buf[fb.slot_mapping])


@pytest.mark.slow
def test_native_decode_step_gives_a_sequence_the_same_logits_whatever_its_batch_mates(loaded: Any) -> None:
    import dataclasses

    pool, fb = decode_batch(loaded, [3, 30, 17, 64, 8], seed=2)
    loaded.model.use_native_kernels(True)
    with torch.inference_mode():
        batched = loaded.model.forward(dataclasses.replace(fb, native_decode=True), pool)
        for b in range(fb.batch_size):
            P = -(-int(fb.kv_lens[b]) // PAGE)
            alone = dataclasses.replace(
                fb,
                input_ids=fb.input_ids[b : b + 1],
                positions=fb.positions[b : b + 1],
                slot_mapping=fb.slot_mapping[b : b + 1],
                kv_pages=fb.kv_pages[b : b + 1, :P],
                kv_lens=fb.kv_lens[b : b + 1],
                q_index=fb.q_index[:1],
                logits_index=torch.tensor([0]),
                native_decode=True,
            )
            assert torch.equal(loaded.model.forward(alone, pool)[0], batched[b])  # bitwise


@pytest.mark.slow
def test_llama_weights_refuse_what_the_decode_step_cannot_read() -> None:
    from kvfence.models.native_kernels import llama_weights, pack_panels

    V, E = 64, 32
    head, norm = pack_panels(torch.randn(V, E)), torch.ones(E)
    layers = [torch.empty(0)] * 12

    def make(**kw: Any) -> Any:
        args = dict(embed=None, head=head, vocab_size=V, layer_weights=layers, norm=norm, num_heads=4,
                    num_kv_heads=2, scale=0.25, eps=1e-6)  # fmt: skip
        return llama_weights(**(args | kw))

    assert make().num_layers == 1 and make().vocab_size == V
    with pytest.raises(RuntimeError, match="head must be pack_panels"):
        make(vocab_size=V + 32)
    with pytest.raises(RuntimeError, match="12 weights per layer"):
        make(layer_weights=layers[:11])
    with pytest.raises(RuntimeError, match="head counts must divide"):
        make(num_kv_heads=3)
    with pytest.raises(RuntimeError, match="embed must be"):
        make(embed=torch.randn(V, E).bfloat16())
    with pytest.raises(RuntimeError, match="float32"):
        make(norm=norm.double())


@pytest.mark.slow
def test_float32_projections_give_the_same_bits_in_every_build() -> None:
    """Each output of a float32 projection is one FMA chain over k in order in every build (AVX-512, AVX2 in
    passes of 4 rows x 16 columns over blocks of k, plain C++), so the builds agree bit for bit, at every row
    count the kernels group rows by, with a partial last panel and a K that is not a multiple of the k block."""
    from kvfence.models import native_kernels as nk

    g = torch.Generator().manual_seed(11)
    w, b, x = torch.randn(70, 203, generator=g), torch.randn(70, generator=g), torch.randn(13, 203, generator=g)
    res = torch.randn(13, 70, generator=g)
    packed = nk.pack_panels(w)
    want = nk.load().packed_linear(x, packed, 70, b, res)
    exact = res.double() + torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(want.double(), exact, rtol=1e-5, atol=1e-5)
    for flags in (("-mno-avx512f",), ("-mno-avx2",)):
        for rows in (1, 2, 3, 4, 5, 8, 13):
            got = nk.load(flags).packed_linear(x[:rows], packed, 70, b, res[:rows])
            assert torch.equal(got, want[:rows]), (flags, rows)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)], ids=["avx2", "plain"])
def test_the_portable_builds_give_the_same_results(
    loaded: Any, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    """The code paths of CPUs without AVX-512 (AVX2 and FMA: built with -mno-avx512f on a CPU that has them) and
    without AVX2 (plain C++: -mno-avx2): projections against a float64 product, rows independent of their batch,
    and a whole decode step against the torch forward."""
    import dataclasses

    from kvfence.models import native_kernels

    portable = native_kernels.load(flags)
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(37, 200, generator=g), torch.randn(37, generator=g), torch.randn(19, 200, generator=g)
    packed = portable.pack_panels(w)
    got = portable.packed_linear(x, packed, 37, b, torch.empty(0))
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 3, 8, 13):
        assert torch.equal(portable.packed_linear(x[:rows], packed, 37, b, torch.empty(0)), got[:rows])
    monkeypatch.setattr(native_kernels, "load", lambda *flags: portable)
    pool, fb = decode_batch(loaded, [3, 30, 17, 64, 8], seed=4)
    want, native = torch_then_native(loaded, fb, pool, copy.deepcopy(pool))
    assert loaded.model._native_step_applies(dataclasses.replace(fb, native_decode=True))
    torch.testing.assert_close(native, want, rtol=1e-4, atol=1e-4)


def _qkv_views(T: int, H: int, Hkv: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D] float32: strided views of one [T, (H + 2 Hkv) D] projection, as a layer
    makes them."""
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(seed))
    return (
        qkv[:, : H * D].view(T, H, D),
        qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D),
        qkv[:, (H + Hkv) * D :].view(T, Hkv, D),
    )


@pytest.mark.parametrize(("B", "Q", "H", "Hkv", "D"), [(1, 128, 4, 2, 64), (3, 37, 6, 2, 32), (2, 5, 4, 4, 16)])
def test_float32_prefill_attention_matches_float64_causal_attention(B: int, Q: int, H: int, Hkv: int, D: int) -> None:
    """Fresh float32 prompts over their own keys, read in place from the qkv projection's views, against float64
    causal SDPA over the same values; a prompt's rows are the bits it gets alone."""
    from kvfence.models.native_kernels import causal_prefill_attention

    q, k, v = _qkv_views(B * Q, H, Hkv, D, seed=Q)
    got = causal_prefill_attention(q, k, v, B, D**-0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    qq, kk, vv = (t.double().reshape(B, Q, -1, D).transpose(1, 2) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(H // Hkv, 1), vv.repeat_interleave(H // Hkv, 1)
    want = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=D**-0.5)
    torch.testing.assert_close(got.double(), want.transpose(1, 2).reshape(B * Q, H, D), rtol=1e-5, atol=1e-5)
    rows = slice((B - 1) * Q, B * Q)
    assert torch.equal(causal_prefill_attention(q[rows], k[rows], v[rows], 1, D**-0.5), got[rows])
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        causal_prefill_attention(q, k.bfloat16(), v, B, D**-0.5)


def test_float32_rope_matches_the_rotate_half_expression_and_leaves_v_alone() -> None:
    """RoPE in one native pass over strided float32 q/k heads: x * cos + roll(x, D/2) * sin within float32
    rounding (one FMA or not), the v columns of the fused rows untouched, a position past the tables refused."""
    from kvfence.models.native_kernels import rope_f32_

    g = torch.Generator().manual_seed(3)
    T, Hq, D, n = 21, 5, 64, 50
    rows = torch.randn(T, Hq + 2, D, generator=g) * 4  # [T, Hq + 2, D]: q and k heads, then v
    freqs = torch.arange(n).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)  # [n, D]
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1)
    pos = torch.randint(0, n, (T,), generator=g)
    x = rows[:, :Hq].double()
    want = x * cos.double()[pos][:, None] + x.roll(D // 2, -1) * sin.double()[pos][:, None]
    got = rows.clone()
    rope_f32_(got[:, :Hq], cos, sin, pos)
    torch.testing.assert_close(got[:, :Hq].double(), want, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got[:, :Hq], rows[:, :Hq])
    assert torch.equal(got[:, Hq:], rows[:, Hq:])
    with pytest.raises(RuntimeError, match="past the tables"):
        rope_f32_(got[:, :Hq], cos, sin, torch.full((T,), n))


def test_silu_mul_into_a_column_block_matches_torch() -> None:
    from kvfence.models.native_kernels import silu_mul_into

    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(9, 100, generator=g) * 6, torch.randn(9, 100, generator=g)
    out = torch.full((9, 300), 7.0)
    silu_mul_into(gate, up, out[:, 100:200])  # a strided column block, as the MLP writes its result
    torch.testing.assert_close(out[:, 100:200], torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
    assert bool((out[:, :100] == 7).all() and (out[:, 200:] == 7).all())
