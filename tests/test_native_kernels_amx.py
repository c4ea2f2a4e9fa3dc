"""AMX tiles for bfloat16 projections (models/native_kernels.cpp, `amx_bf16`): used exactly where the CPU has
AMX-BF16 and the build targets it; a tile product's sums are close to a float64 product of the rounded values,
and a row's result does not depend on its batch-mates at any batch size (the AMX path is taken for every batch
size, because its bits differ from the AVX-512 path's). Projections whose K is not a multiple of 32 keep the
AVX-512 path (tests/test_native_bf16.py compares its bits across builds).

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
