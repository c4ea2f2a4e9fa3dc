"""What one model forward needs to know about the batch: tokens, positions, slots.

What it knows: for a batch of sequences, each contributing a chunk of new tokens
(a prefill chunk or one decode token) on top of tokens already in the KV pool,
the flat token layout [T] the model runs on, which pool slot each new token's KV
goes to, and — for attention — each sequence's padded query rows and context
slots with a boolean mask. Built once per step by `build_forward_batch`; models
only read it. For speed it also lists each sequence's pages (attention copies whole
pages) and says when no mask is needed (equal-length decode), when the mask is plain
causal (equal-length fresh prompts), or gives it in additive form otherwise.

What it does not know: which request a sequence is, how pages were allocated, or
what the model stores per slot (that is the model's `KVLayout`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvfence.math_utils import cdiv


class SeqChunk(NamedTuple):
    """One sequence's share of a forward: `token_ids` placed at positions start..start+len-1."""

    token_ids: list[int]
    start: int  # tokens of this sequence already in the pool (context before the chunk)
    page_table: list[int]  # pages of this sequence, in logical order; must cover start+len(token_ids)
    logits: str = "last"  # "last" | "all" | "none": which rows of this chunk produce logits


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, pool slot each new token's KV is written to
    q_index: torch.Tensor  # [B, Q] int64, row of T for each padded query (padding -> 0)
    q_valid: torch.Tensor  # [B, Q] bool, real query rows; q_index[q_valid] == arange(T)
    kv_slots: torch.Tensor  # [B, K] int64, slots of each sequence's whole context (padding -> 0)
    kv_lens: torch.Tensor  # [B] int64, context length after this chunk
    attn_mask: torch.Tensor  # [B, 1, Q, K] bool, True where query may attend key
    logits_index: torch.Tensor  # [N] int64, rows of T whose logits are returned
    is_decode: bool  # every sequence contributes exactly one token
    # Fast paths for attention (optional: a batch made without them uses kv_slots / attn_mask).
    page_size: int = 0  # tokens per page, when kv_pages is set
    kv_pages: torch.Tensor | None = None  # [B, P] int64, pages covering each context (P = ceil(K / page_size))
    mask_mode: str = "mask"  # "mask": attn_mask; "none": every key visible; "causal": top-left causal (Q == K)
    attn_bias: torch.Tensor | None = None  # [B, 1, Q, K] float32, 0 / -inf form of attn_mask (mask_mode "bias")
    # The runner's per-layer copy of a steady decode batch's context (see engine.runner.DecodeContextCache):
    # context_cache.context(flat_pool_view, fb) -> [B, Hkv, K, D]. None: attention gathers from the pool.
    context_cache: Any = None
    # Decode attention by models.native_kernels (one C++ kernel reading the pool through kv_pages)
    # instead of torch ops; set by the runner when the engine was started with kernels "native".
    native_decode: bool = False
    # A batch mixing one-token rows (decode) with longer chunks (prefill) also comes split in two:
    # (rows of T, the same sequences laid out alone), so attention need not pad every decode row
    # to the longest chunk. Empty for an unmixed batch.
    parts: tuple[tuple[torch.Tensor, ForwardBatch], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.q_index.shape[0])


def build_forward_batch(chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
    """Lay out one forward. It runs once per engine step, on the critical path: decode batches (one
    token per sequence, most steps) take a shorter path that yields the same fields."""
    assert chunks, "empty batch"
    if all(len(c.token_ids) == 1 for c in chunks):
        return _build_decode(chunks, page_size, device)
    return _build_general(chunks, page_size, device)


def _build_decode(chunks: list[SeqChunk], page_size: int, device: torch.device | str) -> ForwardBatch:
    """One new token per sequence: no query padding, no causal structure, one mask row per sequence."""
    B = len(chunks)
    starts = [c.start for c in chunks]  # [B] tokens already in the pool = position of the new token
    K = max(starts) + 1
    P = cdiv(K, page_size)
    for c in chunks:
        assert len(c.page_table) * page_size > c.start, (
            f"page table of {len(c.page_table)} pages cannot hold {c.start + 1} tokens at page size {page_size}"
        )
    # like the general path: pages past a context (masked) are listed too, zero where a table is short
    rows = [c.page_table[:P] for c in chunks]
    if all(len(r) == P for r in rows):
        kv_pages = np.array(rows, dtype=np.int64)  # [B, P]
    else:
        kv_pages = np.array([r + [0] * (P - len(r)) for r in rows], dtype=np.int64)  # [B, P]
    slot_mapping = [c.page_table[c.start // page_size] * page_size + c.start % page_size for c in chunks]
    totals = np.array(starts, dtype=np.int64) + 1  # [B]
    k_pos = np.arange(K)
    visible = k_pos[None, :] < totals[:, None]  # [B, K]
    slots = (kv_pages[:, :, None] * page_size + np.arange(page_size)).reshape(B, P * page_size)[:, :K]  # [B, K]
    kv_slots = np.where(visible, slots, 0)  # [B, K]
    attn_bias = None
    if int(totals.min()) == K:
        mask_mode = "none"
    else:
        mask_mode = "bias"
        attn_bias = torch.from_numpy(np.where(visible, np.float32(0), np.float32("-inf"))[:, None, None, :])
    logits_rows = [b for b, c in enumerate(chunks) if c.logits != "none"]
    dev = torch.device(device)
    return ForwardBatch(
        input_ids=torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long, device=dev),
        positions=torch.from_numpy(totals - 1).to(dev),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
        q_index=torch.arange(B, device=dev)[:, None],
        q_valid=torch.ones(B, 1, dtype=torch.bool, device=dev),
        kv_slots=torch.from_numpy(kv_slots).to(dev),
        kv_lens=torch.from_numpy(totals).to(dev),
        attn_mask=torch.from_numpy(visible[:, None, None, :]).to(dev),
        logits_index=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        is_decode=True,
        page_size=page_size,
        kv_pages=torch.from_numpy(kv_pages).to(dev),
        mask_mode=mask_mode,
        attn_bias=None if attn_bias is None else attn_bias.to(dev),
    )


def _build_general(chunks: list[SeqChunk], page_size: int, device: torch.device | str) -> ForwardBatch:
    """Any mix of prefill chunks and decode tokens, queries padded to the longest chunk."""
    B = len(chunks)
    ns = np.fromiter((len(c.token_ids) for c in chunks), np.int64, B)  # [B] new tokens per sequence
    starts = np.fromiter((c.start for c in chunks), np.int64, B)  # [B]
    assert (ns > 0).all(), "a sequence must contribute at least one token"
    totals = starts + ns  # [B] context length after the chunk
    for c, total in zip(chunks, totals.tolist(), strict=True):
        assert len(c.page_table) * page_size >= total, (
            f"page table of {len(c.page_table)} pages cannot hold {total} tokens at page size {page_size}"
        )
    T, Q, K = int(ns.sum()), int(ns.max()), int(totals.max())
    P = cdiv(K, page_size)  # pages that cover the longest context
    kv_pages = np.array([(list(c.page_table[:P]) + [0] * P)[:P] for c in chunks], dtype=np.int64)  # [B, P]
    slots = (kv_pages[:, :, None] * page_size + np.arange(page_size)).reshape(B, P * page_size)[:, :K]  # [B, K]
    k_pos = np.arange(K)
    kv_slots = np.where(k_pos[None, :] < totals[:, None], slots, 0)  # [B, K]

    row0 = np.cumsum(ns) - ns  # [B] first row of T of each sequence
    seq = np.repeat(np.arange(B), ns)  # [T] sequence of each row
    positions = starts[seq] + np.arange(T) - row0[seq]  # [T]
    slot_mapping = slots[seq, positions]  # [T]
    q_pos = np.arange(Q)
    q_valid = q_pos[None, :] < ns[:, None]  # [B, Q]
    q_index = np.where(q_valid, row0[:, None] + q_pos[None, :], 0)  # [B, Q]
    input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, T)

    logits_rows: list[int] = []
    for c, r0, n in zip(chunks, row0.tolist(), ns.tolist(), strict=True):
        if c.logits == "last":
            logits_rows.append(r0 + n - 1)
        elif c.logits == "all":
            logits_rows.extend(range(r0, r0 + n))
        else:
            assert c.logits == "none", c.logits

    # query i of sequence b sits at absolute position start_b + i; it sees keys 0..start_b+i
    q_abs = starts[:, None] + q_pos[None, :]  # [B, Q]
    mask = k_pos[None, None, :] <= q_abs[:, :, None]  # [B, Q, K]
    mask &= k_pos[None, None, :] < totals[:, None, None]
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padding rows attend one key so softmax stays finite; they are dropped

    attn_bias = None
    if Q == 1 and (totals == K).all():
        mask_mode = "none"  # decode of equally long contexts: every key is visible
    elif (starts == 0).all() and (ns == Q).all():
        mask_mode = "causal"  # fresh prompts of equal length: plain causal, Q == K
    else:
        mask_mode = "bias"
        attn_bias = torch.from_numpy(np.where(mask, np.float32(0), np.float32("-inf"))[:, None, :, :])

    dev = torch.device(device)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    parts: tuple[tuple[torch.Tensor, ForwardBatch], ...] = ()
    one = ns == 1
    if one.any() and not one.all():  # decode rows beside prefill chunks: each kind attends on its own
        parts = tuple(
            (
                t(np.concatenate([np.arange(row0[b], row0[b] + ns[b]) for b in idx])),
                build_forward_batch([chunks[b] for b in idx], page_size, dev),
            )
            for idx in (np.flatnonzero(one), np.flatnonzero(~one))
        )

    return ForwardBatch(
        input_ids=t(input_ids),
        positions=t(positions),
        slot_mapping=t(slot_mapping),
        q_index=t(q_index),
        q_valid=t(q_valid),
        kv_slots=t(kv_slots),
        kv_lens=t(totals),
        attn_mask=t(mask[:, None, :, :]),
        logits_index=torch.as_tensor(logits_rows, dtype=torch.long, device=dev),
        is_decode=Q == 1,
        page_size=page_size,
        kv_pages=t(kv_pages),
        mask_mode=mask_mode,
        attn_bias=None if attn_bias is None else attn_bias.to(dev),
        parts=parts,
    )
