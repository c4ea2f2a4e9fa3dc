"""The native kernels' work sharing (run_chunks in models/native_kernels.cpp): whichever threads take the chunks
of a projection or of decode attention, and however many there are (more than the cores included, so that
helpers start late or not at all), the results are bit-identical to one thread's.

Building the kernel takes a minute or more on two cores, so these tests are slow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tests.helpers.native import PAGE, attention_case


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _per_threads(fn: Callable[[], torch.Tensor]) -> dict[int, torch.Tensor]:
    out = {}
    for n in (1, 2, 5, 2, 1):  # back to fewer threads: helpers started earlier must stay out
        torch.set_num_threads(n)
        got = fn()
        assert n not in out or torch.equal(out[n], got)
        out[n] = got
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_gives_the_same_bits_on_any_number_of_threads(dtype: torch.dtype, restore_threads: None) -> None:
    from kvfence.models import native_kernels

    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1000, 96, generator=g).to(dtype), torch.randn(1000, generator=g)  # 32 panels of 32 columns
    x, res = torch.randn(11, 96, generator=g), torch.randn(11, 1000, generator=g)
    packed = native_kernels.load().pack_panels(w)
    runs = _per_threads(lambda: native_kernels.load().packed_linear(x, packed, 1000, b, res))
    for got in runs.values():
        assert torch.equal(got, runs[1])
    want = torch.nn.functional.linear(x.to(dtype).double(), w.double(), b.double()) + res.double()
    torch.testing.assert_close(runs[1].double(), want, rtol=1e-4, atol=1e-4)  # and it is the product


@pytest.mark.slow
def test_decode_attention_gives_the_same_bits_on_any_number_of_threads(restore_threads: None) -> None:
    from kvfence.models.native_kernels import paged_decode_attention

    q, k, v, pages, lens = attention_case([5, 33, 17, 64, 1, 40, 9], H=8, Hkv=2, D=64)  # 14 units
    runs = _per_threads(lambda: paged_decode_attention(q, k, v, pages, lens, PAGE, 0.125))
    for got in runs.values():
        assert torch.equal(got, runs[1])
    assert not runs[1].isnan().any()
