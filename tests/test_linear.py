"""models.linear: the oneDNN projection path agrees with F.linear, and is skipped where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfence.models import linear as L

needs_onednn = pytest.mark.skipif(not L.onednn_available(torch.float32), reason="this torch build has no oneDNN")


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    x, w, b = _rand(rows, 48, seed=1), _rand(40, 48, seed=2), _rand(40, seed=3)
    packed = L.pack_weight(w)
    assert packed is not None and packed.is_mkldnn
    with torch.inference_mode():
        torch.testing.assert_close(L.linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(L.linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 64])
def test_linear_add_matches_residual_plus_product(rows: int) -> None:
    r, x, w, b = _rand(rows, 40, seed=4), _rand(rows, 48, seed=5), _rand(40, 48, seed=6), _rand(40, seed=7)
    packed = L.pack_weight(w)
    with torch.inference_mode():
        out = L.linear_add(r, x, w, None, packed)
        torch.testing.assert_close(out, r + F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(L.linear_add(r, x, w, b, packed), r + F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(L.linear_add(r, x, w), r + F.linear(x, w), rtol=1e-5, atol=1e-5)  # unpacked
    assert out.data_ptr() != r.data_ptr()  # the residual is not overwritten


@needs_onednn
def test_packed_linear_takes_a_non_contiguous_input() -> None:
    x = _rand(32, 96, seed=8)[:, :48]  # a column slice: row stride 96
    w = _rand(40, 48, seed=9)
    with torch.inference_mode():
        torch.testing.assert_close(L.linear(x, w, None, L.pack_weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_route_only_where_it_applies() -> None:
    w = _rand(40, 48)
    packed = L.pack_weight(w)
    with torch.inference_mode():
        assert L._use_packed(_rand(1, 48), packed)  # batch-1 decode too
        assert L._use_packed(_rand(2, 8, 48), packed)  # any leading dims
        assert not L._use_packed(_rand(8, 48), None)  # nothing packed: F.linear
        assert not L._use_packed(_rand(8, 48).double(), packed)
        assert not L._use_packed(_rand(0, 48), packed)  # no rows: F.linear returns the empty product
        assert L.linear(_rand(0, 48), _rand(40, 48), None, packed).shape == (0, 40)
    assert not L._use_packed(_rand(8, 48), packed)  # autograd on: the oneDNN op has no backward here


def test_unsupported_dtype_is_never_probed_usable() -> None:
    assert not L.onednn_available(torch.float64)
    assert not L.onednn_available(torch.float16)


def test_no_packed_copy_where_onednn_does_not_apply() -> None:
    assert L.pack_weight(_rand(8, 8).double()) is None


@needs_onednn
def test_model_packs_its_loaded_weights_and_can_drop_them(make_model) -> None:
    from kvfence.models.loader import load_model

    lm = load_model(make_model("LlamaForCausalLM"), progress=False)
    layer = lm.model.layers[0]
    assert set(layer.packed) == {"qkv_w", "o_w", "gate_up_w", "down_w"}
    with torch.inference_mode():
        for name, packed in layer.packed.items():
            w = getattr(layer, name)
            x = _rand(3, w.shape[1], seed=14)
            torch.testing.assert_close(L.linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert lm.model.lm_head_packed is not None
    lm.model.pack_weights(False)
    assert layer.packed == {} and lm.model.lm_head_packed is None
    lm.model.pack_weights()
    assert set(layer.packed) == {"qkv_w", "o_w", "gate_up_w", "down_w"} and lm.model.lm_head_packed is not None


@needs_onednn
def test_kernel_bench_prints_a_row_per_shape_and_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.bench import kernels

    assert kernels.main(["--hidden", "32", "--intermediate", "48", "--vocab", "64", "--rows", "1,20"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [(r[0], r[1]) for r in rows] == [
        (n, w) for n in ("1", "20") for w in ("qkv", "o", "gate_up", "down", "lm_head")
    ]
    assert all(float(t) > 0 for r in rows for t in r[2:5])  # F.linear, oneDNN, packed: each timed
    assert all(r[5].endswith("x") and r[6].endswith("x") for r in rows)  # ratios (their size depends on the load)


def test_row_buckets_bound_padding_and_the_number_of_shapes() -> None:
    buckets = [L.row_bucket(n) for n in range(1, 8193)]
    assert all(b >= n for n, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert max(b / n for n, b in enumerate(buckets[:256], start=1)) <= 1.5
    assert max(b / n for n, b in enumerate(buckets[256:], start=257)) <= 1.25
    assert L.row_bucket(32) == 32 and L.row_bucket(2048) == 2048  # a decode batch, a full token budget: no padding
    assert len(set(buckets)) <= 36


@needs_onednn
def test_padded_products_keep_leading_dims_and_values() -> None:
    x, w = _rand(3, 7, 48, seed=20), _rand(40, 48, seed=21)  # 21 rows: padded to 24
    with torch.inference_mode():
        y = L.linear(x, w, None, L.pack_weight(w))
    assert y.shape == (3, 7, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@needs_onednn
@pytest.mark.slow  # 1,200 oneDNN products and an RSS reading
def test_many_row_counts_do_not_grow_memory_without_bound() -> None:
    """oneDNN keeps a ~0.6 MB primitive per input shape; 600 distinct row counts unpadded grew RSS ~330 MB."""
    w, r = _rand(512, 128, seed=22), _rand(600, 512, seed=23)
    packed = L.pack_weight(w)
    with torch.inference_mode():
        L.linear(_rand(1, 128), w, None, packed)
        before = _rss_mib()
        for rows in range(1, 601):
            x = _rand(rows, 128, seed=rows)
            L.linear(x, w, None, packed)
            L.linear_add(r[:rows], x, w, None, packed)
    assert _rss_mib() - before < 120


def test_a_model_loaded_for_another_device_keeps_no_packed_copies(make_model) -> None:
    from kvfence.models.loader import load_model

    lm = load_model(make_model("LlamaForCausalLM"), progress=False, device="meta")  # any non-CPU device
    assert all(not layer.packed for layer in lm.model.layers) and lm.model.lm_head_packed is None
