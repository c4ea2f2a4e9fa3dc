"""AMX tiles for bfloat16 projections (models/native_kernels.cpp, `amx_bf16`): used exactly where the CPU has
AMX-BF16 and the build targets it; a tile product's sums are close to a float64 product of the rounded values,
and a row's result does not depend on its batch-mates at any batch size (the AMX path is taken for every batch
size, because its bits differ from the AVX-512 path's). Projections whose K is not a multiple of 32 keep the
AVX-512 path (tests/test_native_bf16.py compares its bits across builds). panel_gemm (prefill products from the
panels) runs on AMX where it has it and on the decode step's panel kernel otherwise (VDPBF16PS, or the same
sums by AVX-512, AVX2 or plain float FMAs); its tests run on any of them.

Building the kernels takes a minute or more on two cores, so these tests are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _cpu_has_amx_bf16() -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_bf16" in flags and "amx_tile" in flags


@pytest.mark.slow
def test_amx_is_used_where_the_cpu_has_it_and_not_in_a_build_without_it() -> None:
    from kvfence.models import native_kernels as nk

    assert nk.load().amx_bf16() == _cpu_has_amx_bf16()
    assert not nk.load(("-mno-amx-tile",)).amx_bf16()


@pytest.mark.slow
def test_amx_projection_matches_a_float64_product_and_rows_do_not_depend_on_the_batch() -> None:
    from kvfence.models import native_kernels as nk

    if not nk.load().amx_bf16():
        pytest.skip("no AMX-BF16 here")
    g = torch.Generator().manual_seed(11)
    K = 256  # a multiple of 32: the AMX path
    w, b, x = torch.randn(70, K, generator=g).bfloat16(), torch.randn(70, generator=g), torch.randn(37, K, generator=g)
    packed = nk.pack_panels(w)
    got = nk.packed_linear(x, packed, 70, b)  # 37 rows: two whole tiles of 16 and 5 rows
    want = torch.nn.functional.linear(x.bfloat16().double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K**0.5)
    for rows in (1, 2, 5, 15, 16, 17, 33):
        assert torch.equal(nk.packed_linear(x[:rows], packed, 70, b), got[:rows])  # bitwise, whatever shares it
    assert torch.equal(nk.packed_linear(x[20:21], packed, 70, b)[0], got[20])
    avx512 = nk.load(("-mno-amx-tile",)).packed_linear(x, packed, 70, b, torch.empty(0))
    torch.testing.assert_close(got, avx512, rtol=1e-5, atol=1e-5 * K**0.5)  # close, not (always) the same bits


@pytest.mark.slow
def test_kvfence_native_amx_0_turns_amx_off() -> None:
    import os
    import subprocess
    import sys

    code = "from kvfence.models import native_kernels as nk; print(nk.load().amx_bf16())"
    env = {**os.environ, "KVFENCE_NATIVE_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (1, 70, 64),  # one row, a partial panel
        (17, 70, 256),  # a full 16-row tile and one row: the pair kernel's second tile with one row
        (33, 96, 256),  # a pair of tiles and one more row
        (1000, 600, 1024),  # several row blocks (480 rows at this K) and panel groups (8 panels at this K)
        (130, 64, 4096),  # K * 2 bytes a multiple of 4 KiB
    ],
)
def test_panel_gemm_is_torchs_bf16_linear_plus_residual_from_the_panels(M: int, N: int, K: int) -> None:
    """panel_gemm (prefill products straight from the panels): each row's sums are packed_linear's bits for that
    row, rounded to bfloat16 with the bias, then added to the residual and rounded (torch's bfloat16
    `residual + F.linear`); close to a float64 product; a row's result does not depend on the rest of the chunk."""
    from kvfence.models import native_kernels as nk

    if not nk.load().panel_gemm_bf16_applies(K):
        pytest.skip("AMX takes every bfloat16 product here and K is not a multiple of 32")
    g = torch.Generator().manual_seed(M + N + K)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    x, b, r = (
        torch.randn(M, K, generator=g).bfloat16(),
        torch.randn(N, generator=g).bfloat16(),
        torch.randn(M, N, generator=g).bfloat16(),
    )
    packed = nk.pack_panels(w)
    with torch.no_grad():
        assert nk.panel_gemm_applies(x, packed)
        got = nk.panel_gemm(x, packed, N, b, r)
        plain = nk.panel_gemm(x, packed, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    sums = nk.packed_linear(x.float(), packed, N)  # float32 [M, N]: the decode path's products
    assert torch.equal(plain, sums.bfloat16())
    assert torch.equal(got, r + (sums + b.float()).bfloat16())  # torch's bfloat16 add: float sum, rounded
    exact = r.double() + torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=2**-7 * exact.abs().max().item())
    for rows in sorted({1, 16, 17, 32, M // 2, M - 1} - {0}):
        with torch.no_grad():
            assert torch.equal(nk.panel_gemm(x[M - rows :], packed, N, b, r[M - rows :]), got[M - rows :])


@pytest.mark.slow
def test_llama_prefill_projections_take_panel_gemm_where_it_applies_and_unpack_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bfloat16 prefill chunk of BF16_GEMM_MIN_ROWS rows or more computes from the panels (AMX, or the decode
    step's panel kernel; no unpacked weight); where panel_gemm does not apply it falls back to unpacking the
    weight for F.linear, with results as close as bf16 allows."""
    import kvfence.models.native_kernels as nk
    from kvfence.models import llama

    if not nk.load().panel_gemm_bf16_applies(64):
        pytest.skip("AMX takes every bfloat16 product here and K is not a multiple of 32")
    cfg = type(
        "Cfg",
        (),
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
        ),
    )()
    layer = llama.DecoderLayer(cfg, "LlamaForCausalLM", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for name in llama.PROJECTIONS:
        getattr(layer, name).data = (torch.randn(*layer.shapes[name], generator=g) / 8).bfloat16()
    layer.hold_panels(True)
    x = torch.randn(llama.BF16_GEMM_MIN_ROWS, 64, generator=g).bfloat16()
    res = torch.randn(llama.BF16_GEMM_MIN_ROWS, 64, generator=g).bfloat16()
    unpacked: list[int] = []
    real_unpack = nk.unpack_panels
    monkeypatch.setattr(nk, "unpack_panels", lambda *a: unpacked.append(1) or real_unpack(*a))
    with torch.no_grad():
        amx = layer._project("down_w", torch.randn(llama.BF16_GEMM_MIN_ROWS, 96, generator=g).bfloat16(), None, res)
        qkv = layer._project("qkv_w", x, None)
        assert not unpacked
        monkeypatch.setattr(nk, "_panel_gemm_k", lambda k: False)
        qkv_fallback = layer._project("qkv_w", x, None)
    assert unpacked and amx.dtype == qkv.dtype == torch.bfloat16
    torch.testing.assert_close(qkv.float(), qkv_fallback.float(), rtol=2**-7, atol=2**-7 * qkv.abs().max().item())
