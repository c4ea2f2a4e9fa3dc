"""What one model forward needs to know about the batch: tokens, positions, slots.

What it knows: for a batch of sequences, each contributing a chunk of new tokens
(a prefill chunk or one decode token) on top of tokens already in the KV pool,
the flat token layout [T] the model runs on, which pool slot each new token's KV
goes to, and — for attention — each sequence's padded query rows and context
slots with a boolean mask. Built once per step by `build_forward_batch`; models
only read it.

What it does not know: which request a sequence is, how pages were allocated, or
what the model stores per slot (that is the model's `KVLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.q_index.shape[0])


def build_forward_batch(chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
    assert chunks, "empty batch"
    B = len(chunks)
    Q = max(len(c.token_ids) for c in chunks)
    K = max(c.start + len(c.token_ids) for c in chunks)
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logits_rows: list[int] = []
    q_index = torch.zeros(B, Q, dtype=torch.long)
    q_valid = torch.zeros(B, Q, dtype=torch.bool)
    kv_slots = torch.zeros(B, K, dtype=torch.long)
    kv_lens = torch.zeros(B, dtype=torch.long)
    pos_k = torch.arange(K)
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        assert n > 0, "a sequence must contribute at least one token"
        total = c.start + n
        assert len(c.page_table) * page_size >= total, (
            f"page table of {len(c.page_table)} pages cannot hold {total} tokens at page size {page_size}"
        )
        pages = torch.as_tensor(c.page_table, dtype=torch.long)
        slots = pages.repeat_interleave(page_size) * page_size + torch.arange(page_size).repeat(len(c.page_table))
        row0 = len(input_ids)
        input_ids.extend(c.token_ids)
        positions.extend(range(c.start, total))
        slot_mapping.extend(slots[c.start : total].tolist())
        q_index[b, :n] = torch.arange(row0, row0 + n)
        q_valid[b, :n] = True
        kv_slots[b, :total] = slots[:total]
        kv_lens[b] = total
        if c.logits == "last":
            logits_rows.append(row0 + n - 1)
        elif c.logits == "all":
            logits_rows.extend(range(row0, row0 + n))
        else:
            assert c.logits == "none", c.logits
    # query i of sequence b sits at absolute position start_b + i; it sees keys 0..start_b+i
    starts = torch.as_tensor([c.start for c in chunks], dtype=torch.long)
    q_pos = starts[:, None] + torch.arange(Q)[None, :]  # [B, Q]
    mask = pos_k[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
    mask &= pos_k[None, None, :] < kv_lens[:, None, None]
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padding rows attend one key so softmax stays finite; they are dropped
    dev = torch.device(device)
    return ForwardBatch(
        input_ids=torch.as_tensor(input_ids, dtype=torch.long, device=dev),
        positions=torch.as_tensor(positions, dtype=torch.long, device=dev),
        slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.long, device=dev),
        q_index=q_index.to(dev),
        q_valid=q_valid.to(dev),
        kv_slots=kv_slots.to(dev),
        kv_lens=kv_lens.to(dev),
        attn_mask=mask[:, None, :, :].to(dev),
        logits_index=torch.as_tensor(logits_rows, dtype=torch.long, device=dev),
        is_decode=Q == 1,
    )
