"""The native kernels' work sharing (run_chunks in models/native_kernels.cpp): whichever threads take the chunks
of a projection or of decode attention, and however many there are (more than the cores included, so that
helpers start late or not at all), the results are bit-identical to one thread's. And the kernels run without
the GIL: other Python threads go on during a long call, and two Python threads may call them at once.

Building the kernel takes a minute or more on two cores, so these tests are slow.
"""

from __future__ import annotations

import threading
import time
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


def _big_projection() -> tuple[torch.Tensor, torch.Tensor]:
    from kvfence.models.native_kernels import pack_panels

    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 2048, generator=g), pack_panels(torch.randn(8192, 2048, generator=g))  # 4 GFLOP a call


@pytest.mark.slow
def test_a_long_kernel_call_lets_other_python_threads_run() -> None:
    from kvfence.models.native_kernels import packed_linear

    x, w = _big_projection()
    ticks: list[float] = []
    done = threading.Event()

    def count() -> None:  # what the server's event loop would do meanwhile
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    packed_linear(x, w, 8192)  # warm
    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.02)
    start = time.monotonic()
    for _ in range(5):
        packed_linear(x, w, 8192)
    end = time.monotonic()
    done.set()
    counter.join()
    inside = [t for t in ticks if start < t < end]
    # holding the GIL, the counter gets in only at the four gaps between calls (the interpreter's forced
    # handoffs every 5 ms wait for the call to return); released, it ticks about once a millisecond, and at
    # least every few on a busy machine
    assert end - start > 0.15, "the calls are too short to tell"
    assert len(inside) >= max(30, (end - start) / 0.001 / 8), (len(inside), end - start)


@pytest.mark.slow
def test_two_python_threads_calling_the_kernels_at_once_get_each_call_s_own_bits() -> None:
    from kvfence.models.native_kernels import packed_linear, paged_decode_attention

    x, w = _big_projection()
    q, k, v, pages, lens = attention_case([5, 33, 17, 64, 1, 40, 9], H=8, Hkv=2, D=64)
    alone = packed_linear(x, w, 8192), paged_decode_attention(q, k, v, pages, lens, PAGE, 0.125)
    got: dict[str, list[torch.Tensor]] = {"linear": [], "attention": []}

    def linear() -> None:
        got["linear"] += [packed_linear(x, w, 8192) for _ in range(6)]

    def attention() -> None:
        got["attention"] += [paged_decode_attention(q, k, v, pages, lens, PAGE, 0.125) for _ in range(200)]

    threads = [threading.Thread(target=linear), threading.Thread(target=attention)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got["linear"]) == 6 and len(got["attention"]) == 200
    assert all(torch.equal(r, alone[0]) for r in got["linear"])
    assert all(torch.equal(r, alone[1]) for r in got["attention"])
