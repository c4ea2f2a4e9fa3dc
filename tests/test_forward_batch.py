"""build_forward_batch: the decode fast path lays out exactly what the general path does."""

from __future__ import annotations

import random

import pytest
import torch

from kvfence.engine.forward_batch import SeqChunk, _build_decode, _build_general, build_forward_batch

FIELDS = (
    "input_ids positions slot_mapping q_index q_valid kv_slots kv_lens attn_mask logits_index kv_pages attn_bias"
).split()


def _decode_chunks(rng: random.Random, page_size: int, equal: bool) -> list[SeqChunk]:
    chunks = []
    length = rng.randint(1, 70)
    for _ in range(rng.randint(1, 9)):
        start = length if equal else rng.randint(0, 70)
        pages = rng.sample(range(200), (start + page_size) // page_size + rng.randint(0, 3))  # may list spare pages
        chunks.append(SeqChunk([rng.randrange(1000)], start, pages, rng.choice(["last", "last", "none"])))
    return chunks


@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_path_matches_general_path(page_size: int, equal: bool) -> None:
    rng = random.Random(page_size * 2 + equal)
    for _ in range(25):
        chunks = _decode_chunks(rng, page_size, equal)
        fast, general = _build_decode(chunks, page_size, "cpu"), _build_general(chunks, page_size, "cpu")
        assert fast.is_decode and general.is_decode
        assert fast.mask_mode == general.mask_mode
        for name in FIELDS:
            a, b = getattr(fast, name), getattr(general, name)
            if a is None or b is None:
                assert a is None and b is None, name
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
            assert torch.equal(a, b), name


def test_dispatch_takes_decode_path_only_for_one_token_chunks() -> None:
    decode = [SeqChunk([3], 5, [0, 1]), SeqChunk([4], 2, [2])]
    mixed = [SeqChunk([3], 5, [0, 1]), SeqChunk([4, 5], 2, [2])]
    assert build_forward_batch(decode, 4).is_decode
    assert not build_forward_batch(mixed, 4).is_decode


def test_decode_path_rejects_a_short_page_table() -> None:
    with pytest.raises(AssertionError, match="cannot hold"):
        build_forward_batch([SeqChunk([3], 8, [0, 1])], 4)  # 9 tokens need 3 pages of 4
