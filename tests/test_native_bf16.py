"""bfloat16 on the native path: projections from bfloat16 panels (float32 sums of exact products, the inputs
rounded to bfloat16) against a float64 product of the same rounded values, the same bits on every build (AVX512_BF16,
AVX-512F without it, no AVX-512), decode attention over bfloat16 pools against torch, and a whole bfloat16
decode step against the bfloat16 torch forward and the float32 one.

Building the kernels takes a minute or more on two cores, so these tests are slow.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.native import PAGE, attention_case, decode_batch, reference_attention


@pytest.mark.slow
@pytest.mark.parametrize("K", [256, 21, 1])  # whole pairs, an odd K (zero-padded), one element
def test_bf16_projection_matches_a_float64_product_of_the_rounded_values(K: int) -> None:
    from kvfence.models import native_kernels as nk

    g = torch.Generator().manual_seed(K)
    w, b, x = torch.randn(37, K, generator=g).bfloat16(), torch.randn(37, generator=g), torch.randn(19, K, generator=g)
    packed = nk.pack_panels(w)
    assert packed.dtype == torch.bfloat16 and torch.equal(nk.unpack_panels(packed, 37, K), w)
    got = nk.packed_linear(x, packed, 37, b)  # float32 x: rounded to bfloat16 inside, float32 out
    want = torch.nn.functional.linear(x.bfloat16().double(), w.double(), b.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K**0.5)
    for rows in (1, 2, 3, 5, 8, 13):
        assert torch.equal(nk.packed_linear(x[:rows], packed, 37, b), got[:rows])  # bitwise, whatever shares it
    res = torch.randn(19, 37, generator=g).bfloat16()
    with_res = nk.packed_linear(x.bfloat16(), packed, 37, b, res)  # bfloat16 in: bfloat16 out
    assert with_res.dtype == torch.bfloat16
    torch.testing.assert_close(with_res, (got + res.float()).bfloat16(), rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_projection_gives_the_same_bits_with_and_without_avx512_bf16() -> None:
    """VDPBF16PS adds the odd element's product, then the even one's, into float32; the builds without it
    (AVX-512F FMAs, AVX2 FMAs, plain C++) do the same sums, and products of bfloat16s are exact: the same bits,
    at every row count the kernels group rows by."""
    from kvfence.models import native_kernels as nk

    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(70, 300, generator=g).bfloat16(), torch.randn(11, 300, generator=g)
    packed = nk.pack_panels(w)
    fast = nk.packed_linear(x, packed, 70)
    for flags in (("-mno-avx512bf16",), ("-mno-avx512f",), ("-mno-avx2",)):
        for rows in (1, 2, 3, 8, 11):
            other = nk.load(flags).packed_linear(x[:rows], packed, 70, torch.empty(0), torch.empty(0))
            assert torch.equal(other, fast[:rows]), (flags, rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("H", "Hkv", "D"),
    [(4, 2, 32), (8, 2, 64), (2, 1, 128), (12, 4, 128), (8, 2, 128)],  # generic; register-held G = 4, 2, 3, 4
)
def test_bf16_attention_over_bf16_pools_matches_torch(H: int, Hkv: int, D: int) -> None:
    from kvfence.models.native_kernels import paged_decode_attention

    q, k, v, pages, lens = attention_case([1, 7, 8, 9, 40, 23], H=H, Hkv=Hkv, D=D)
    kb, vb = k.bfloat16(), v.bfloat16()
    got = paged_decode_attention(q, kb, vb, pages, lens, PAGE, D**-0.5)
    assert got.dtype == torch.float32 and not got.isnan().any()
    want = reference_attention(
        q.double(), kb.double(), vb.double(), pages, lens
    )  # float32 math over the bfloat16 values
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _causal_case(B: int, Q: int, H: int, Hkv: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [B*Q, H, D], k and v [B*Q, Hkv, D] bfloat16: strided views of one [B*Q, (H + 2 Hkv) * D] projection, as a
    layer makes them."""
    qkv = torch.randn(B * Q, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q = qkv[:, : H * D].view(-1, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(-1, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(-1, Hkv, D)
    return q, k, v


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, B: int, scale: float) -> torch.Tensor:
    T, H, D = q.shape
    Hkv, Q = k.shape[1], T // B
    qq = q.reshape(B, Q, H, D).transpose(1, 2)
    kk = k.reshape(B, Q, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    vv = v.reshape(B, Q, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(T, H, D)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("B", "Q", "H", "Hkv", "D"),
    [(8, 128, 12, 4, 64), (1, 37, 8, 2, 128), (3, 50, 4, 4, 32), (2, 5, 6, 1, 64), (2, 33, 16, 4, 80)],
)
def test_bf16_prefill_attention_matches_float64_causal_attention(B: int, Q: int, H: int, Hkv: int, D: int) -> None:
    """Fresh prompts over their own keys: float32 sums of the bfloat16 values, rounded once, against float64 over
    the same values; at least as close as torch's bfloat16 SDPA, which it replaces."""
    from kvfence.models.native_kernels import causal_prefill_attention

    q, k, v = _causal_case(B, Q, H, Hkv, D, seed=Q)
    got = causal_prefill_attention(q, k, v, B, D**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape and got.is_contiguous()
    want = _sdpa_causal(q.double(), k.double(), v.double(), B, D**-0.5)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4)  # one bfloat16 rounding
    sdpa = _sdpa_causal(q, k, v, B, D**-0.5)
    err, err_sdpa = (got.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    assert err <= 1.1 * err_sdpa, (err, err_sdpa)


@pytest.mark.slow
def test_bf16_prefill_attention_rows_do_not_depend_on_their_batch() -> None:
    from kvfence.models.native_kernels import causal_prefill_attention

    q, k, v = _causal_case(5, 40, 12, 4, 64, seed=9)
    batched = causal_prefill_attention(q, k, v, 5, 0.125)
    for b in (0, 3):
        rows = slice(40 * b, 40 * (b + 1))
        assert torch.equal(causal_prefill_attention(q[rows], k[rows], v[rows], 1, 0.125), batched[rows])
    with pytest.raises(RuntimeError, match="T = B \\* Q"):
        causal_prefill_attention(q, k, v, 3, 0.125)  # 200 rows are not 3 equal prompts


def _lm(make_model: Callable[..., Path], dtype: torch.dtype, **overrides: Any) -> Any:
    from kvfence.models.loader import load_model

    return load_model(make_model("Qwen3ForCausalLM", seed=3, **overrides), dtype=dtype, progress=False)


@pytest.mark.slow
def test_bf16_native_decode_step_is_close_to_the_torch_forward_and_stores_bf16_kv(
    make_model: Callable[..., Path],
) -> None:
    """The native bfloat16 step keeps float32 activations, so it sits nearer the float32 forward of the same
    (bfloat16-valued) weights than torch's bfloat16 forward does; both are within bfloat16's reach of it."""
    lm = _lm(make_model, torch.bfloat16, tie_word_embeddings=True)
    ref = _lm(make_model, torch.float32, tie_word_embeddings=True)
    ref.model.load_state_dict({k: v.float() for k, v in lm.model.state_dict().items()})  # same values in fp32
    ref.model.pack_weights()
    pool32, fb = decode_batch(ref, [1, 15, 16, 40], seed=1)
    for i in range(pool32.layout.num_layers):
        for name in ("k", "v"):
            pool32.flat(i, name).copy_(pool32.flat(i, name).bfloat16().float())  # the context bf16 holds
    pool = type(pool32)(lm.model.kv_layout(lm.hf_config, PAGE, torch.bfloat16), pool32.num_pages)
    other = copy.deepcopy(pool)
    for i in range(pool.layout.num_layers):
        for name in ("k", "v"):
            pool.flat(i, name).copy_(pool32.flat(i, name))
            other.flat(i, name).copy_(pool32.flat(i, name))
    with torch.inference_mode():
        exact = ref.model.forward(fb, pool32)  # [B, vocab] float32
        torch_bf16 = lm.model.forward(fb, pool)
        lm.model.use_native_kernels(True)
        native = lm.model.forward(dataclasses.replace(fb, native_decode=True), other)
    assert lm.model._native_step_applies(dataclasses.replace(fb, native_decode=True))
    err_native = (native - exact).abs().max().item()
    err_torch = (torch_bf16 - exact).abs().max().item()
    print(f"max |logit error| vs float32: native bf16 {err_native:.4f}, torch bf16 {err_torch:.4f}")
    assert err_native < 0.05 * exact.abs().max().item() and err_native <= err_torch, (err_native, err_torch)
    for i in range(pool.layout.num_layers):  # this step's K/V went to the same slots, as bfloat16
        for name in ("k", "v"):
            got, want = other.flat(i, name)[fb.slot_mapping], pool.flat(i, name)[fb.slot_mapping]
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len", [20, 140])  # below and above BF16_GEMM_MIN_ROWS: panels, then F.linear
def test_bf16_prefill_from_panels_matches_the_plain_bf16_forward(
    make_model: Callable[..., Path], prompt_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfence.kv.pool import KVPool
    from kvfence.models import native_kernels
    from kvfence.models.forward_batch import SeqChunk, build_forward_batch

    lm = _lm(make_model, torch.bfloat16)
    ids = torch.randint(0, 2000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    fb = build_forward_batch([SeqChunk(ids, 0, list(range(-(-prompt_len // PAGE))), "last")], PAGE)
    layout = lm.model.kv_layout(lm.hf_config, PAGE, torch.bfloat16)
    calls = []
    real = native_kernels.causal_prefill_attention
    monkeypatch.setattr(native_kernels, "causal_prefill_attention", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        plain = lm.model.forward(fb, KVPool(layout, -(-prompt_len // PAGE)))
        assert not calls  # the torch forward keeps SDPA
        lm.model.use_native_kernels(True)
        panels = lm.model.forward(fb, KVPool(layout, -(-prompt_len // PAGE)))
    assert lm.model.panels and len(calls) == lm.hf_config.num_hidden_layers  # every layer's attention, natively
    torch.testing.assert_close(panels, plain, rtol=0.05, atol=0.05 * plain.abs().max().item())


@pytest.mark.slow
def test_bf16_native_rms_norm_rounds_as_transformers_does() -> None:
    """bfloat16 rows and weight: the row normalised in float32, rounded to bfloat16, times the weight, rounded
    (transformers' order): equal to torch's bfloat16 path but for the last bit of the rare row whose float32
    mean differs in its last place; float32 rows keep their kernel."""
    from kvfence.models import native_kernels as nk
    from kvfence.models.llama import rms_norm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(67, 768, generator=g) * 3).bfloat16()
    w = (1 + torch.randn(768, generator=g) / 4).bfloat16()
    got = nk.rms_norm(x, w, 1e-6)
    want = rms_norm(x, w, 1e-6)  # torch: F.rms_norm of x.float(), to bfloat16, times w in bfloat16
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean().item() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    unrounded = w.float() * torch.nn.functional.rms_norm(x.float(), (768,), None, 1e-6)  # one rounding fewer
    assert (got.float() != unrounded.bfloat16().float()).any()
    xf = torch.randn(5, 768, generator=g)
    torch.testing.assert_close(nk.rms_norm(xf, w.float(), 1e-6), rms_norm(xf, w.float(), 1e-6))


@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 128, 32, 6])  # the vector path (D / 2 a multiple of 16), the scalar one
def test_bf16_native_rope_has_the_bits_of_torchs_addcmul(D: int) -> None:
    """RoPE in one native pass over strided bfloat16 heads: the bits of the torch expression it replaces
    (`addcmul(x * cos, x.roll(D // 2, -1), sin)` in bfloat16), NaN payloads aside; columns past the heads
    (v, in the fused qkv rows) untouched; a position past the tables refused."""
    from kvfence.models import native_kernels as nk

    g = torch.Generator().manual_seed(7)
    T, Hq, n = 37, 5, 100
    rows = (torch.randn(T, Hq + 2, D, generator=g) * 4).bfloat16()  # [T, Hq + 2, D]: q and k heads, then v
    rows[3, 1, D // 2] = float("nan")
    rows[4, 0, 0] = float("inf")
    freqs = torch.arange(n).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).bfloat16()  # [n, D]
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1).bfloat16()
    pos = torch.randint(0, n, (T,), generator=g)
    want = rows[:, :Hq].clone()
    torch.addcmul(want * cos[pos][:, None], want.roll(D // 2, -1), sin[pos][:, None], out=want)
    got = rows.clone()
    nk.rope_bf16_(got[:, :Hq], cos, sin, pos)
    same = got[:, :Hq].view(torch.int16) == want.view(torch.int16)
    assert bool((same | (got[:, :Hq].isnan() & want.isnan())).all())
    assert bool(same[~want.isnan()].all()) and int(want.isnan().sum()) >= 2  # NaN in, NaN out
    assert torch.equal(got[:, Hq:], rows[:, Hq:])
    with pytest.raises(RuntimeError, match="past the tables"):
        nk.rope_bf16_(got[:, :Hq], cos, sin, torch.full((T,), n))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prompt_len", [20, 70])  # two prompts: 40 and 140 rows, below and above BF16_GEMM_MIN_ROWS
def test_prefill_runs_the_last_layer_past_attention_only_for_the_logits_rows(
    make_model: Callable[..., Path], dtype: torch.dtype, prompt_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the projections held as panels, a prefill's last layer takes only the rows whose logits are wanted
    through o, the MLP and the residual; their logits are the bits of running every row, and every row's K/V
    are still stored (a later step reads them)."""
    from kvfence.kv.pool import KVPool
    from kvfence.models import llama
    from kvfence.models.forward_batch import SeqChunk, build_forward_batch

    lm = _lm(make_model, dtype)
    lm.model.use_native_kernels(True)
    assert lm.model.panels
    g = torch.Generator().manual_seed(1)
    pages = -(-prompt_len // PAGE)
    chunks = [
        SeqChunk(
            torch.randint(0, 2000, (prompt_len,), generator=g).tolist(), 0, list(range(s * pages, (s + 1) * pages))
        )
        for s in range(2)
    ]
    fb = build_forward_batch(chunks, PAGE)
    layout = lm.model.kv_layout(lm.hf_config, PAGE, dtype)
    rows_in: list[int] = []
    real = llama.DecoderLayer._project
    monkeypatch.setattr(
        llama.DecoderLayer,
        "_project",
        lambda self, name, x, *a, **k: rows_in.append(x.shape[0]) or real(self, name, x, *a, **k),
    )
    pools = []
    with torch.inference_mode():
        out = []
        for skip in (True, False):
            lm.model.skip_dead_rows = skip
            pools.append(KVPool(layout, 2 * pages))
            rows_in.clear()
            out.append(lm.model.forward(fb, pools[-1]))
            if skip:  # the last layer's o, gate_up and down saw the 2 logits rows, every other projection all rows
                assert rows_in[-3:] == [2, 2, 2] and rows_in[:-3].count(2 * prompt_len) == len(rows_in) - 3, rows_in
    assert out[0].shape == (2, lm.model.vocab_size)
    assert torch.equal(out[0], out[1])
    for i in range(layout.num_layers):
        for name in ("k", "v"):
            assert torch.equal(pools[0].flat(i, name), pools[1].flat(i, name))
