"""Decode-attention and decode-step cases for the native kernel tests: scattered pages of random K/V (NaN
elsewhere), torch's attention over them, and a decode batch over a model's pool."""

from __future__ import annotations

from typing import Any

import torch

PAGE = 8


def attention_case(lens: list[int], H: int = 4, Hkv: int = 2, D: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [B, H, D], NaN-filled pools [S, Hkv, D] with each context written on shuffled pages, pages [B, P], lens [B]."""
    g = torch.Generator().manual_seed(seed)
    B, P = len(lens), -(-max(lens) // PAGE)
    num_pages = B * P + 3
    k = torch.full((num_pages * PAGE, Hkv, D), float("nan"))
    v = torch.full((num_pages * PAGE, Hkv, D), float("nan"))
    pages = torch.randperm(num_pages, generator=g)[: B * P].view(B, P)
    for b, n in enumerate(lens):
        slots = (pages[b][:, None] * PAGE + torch.arange(PAGE)).view(-1)[:n]
        k[slots] = torch.randn(n, Hkv, D, generator=g)
        v[slots] = torch.randn(n, Hkv, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    return q, k, v, pages, torch.tensor(lens)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    B, H, D = q.shape
    Hkv = k.shape[1]
    out = []
    for b in range(B):
        slots = (pages[b][:, None] * PAGE + torch.arange(PAGE)).view(-1)[: int(lens[b])]
        kb, vb = k[slots].transpose(0, 1), v[slots].transpose(0, 1)  # [Hkv, L, D]
        qb = q[b].view(Hkv, H // Hkv, D)  # [Hkv, G, D]
        out.append((torch.softmax(qb @ kb.transpose(1, 2) * D**-0.5, -1) @ vb).reshape(H, D))
    return torch.stack(out)  # [B, H, D]


def decode_batch(lm: Any, lens: list[int], seed: int) -> tuple[Any, Any]:
    """A pool whose pages hold random K/V for contexts of `lens` tokens (NaN elsewhere), and the decode batch
    that appends one token to each, on shuffled pages."""
    from kvfence.kv.pool import KVPool
    from kvfence.models.forward_batch import SeqChunk, build_forward_batch

    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(n + 1) // PAGE) for n in lens) + 2
    pool = KVPool(lm.model.kv_layout(lm.hf_config, PAGE, torch.float32), num_pages)
    pool.poison(range(num_pages))
    order = torch.randperm(num_pages, generator=g).tolist()
    chunks = []
    for n in lens:
        table, order = order[: -(-(n + 1) // PAGE)], order[-(-(n + 1) // PAGE) :]
        slots = torch.tensor([table[t // PAGE] * PAGE + t % PAGE for t in range(n)])
        for layer in range(pool.layout.num_layers):
            for buf in pool.layer_buffers(layer).values():
                buf[slots] = torch.randn(n, *buf.shape[1:], generator=g)
        chunks.append(SeqChunk([int(torch.randint(0, 100, (1,), generator=g))], n, table))
    return pool, build_forward_batch(chunks, PAGE)


def torch_then_native(lm: Any, fb: Any, pool: Any, other: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of decode batch `fb` by the torch forward (plain weights, over `pool`), then by the native step
    (the model switched to hold native panels, over `other`, a copy of the pool)."""
    import dataclasses

    model: Any = lm.model
    model.use_native_kernels(False)
    with torch.inference_mode():
        want = model.forward(fb, pool)  # [B, vocab]
        model.use_native_kernels(True)
        got = model.forward(dataclasses.replace(fb, native_decode=True), other)
    return want, got
