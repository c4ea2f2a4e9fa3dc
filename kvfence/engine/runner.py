"""Run one scheduled step through the model and sample the next tokens.

What it knows: how to turn the scheduler's chunks into a `ForwardBatch` (prefill
chunks that do not reach the end of their prompt ask for no logits), run the model
over the KV pool under `torch.inference_mode`, and hand the logits rows to the
sampler. What it does not know: which requests should run, stop rules, or text.
"""

from __future__ import annotations

import torch

from kvfence.engine.forward_batch import SeqChunk, build_forward_batch
from kvfence.engine.sampler import Sampler
from kvfence.engine.scheduler import SchedulerOutput
from kvfence.kv.pool import KVPool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.pool = pool
        self.page_size = pool.page_size
        self.device = torch.device(device)
        self.sampler = Sampler()

    def execute(self, output: SchedulerOutput) -> list[int | None]:
        """One forward over every scheduled chunk; a token per chunk that samples, None for the others."""
        chunks: list[SeqChunk] = []
        for c in output.chunks:
            req = c.request
            ids = req.token_ids[c.start : c.start + c.num_tokens]
            chunks.append(SeqChunk(ids, c.start, req.page_table, "last" if c.sample else "none"))
        fb = build_forward_batch(chunks, self.page_size, self.device)
        sampling = [c.request for c in output.chunks if c.sample]
        with torch.inference_mode():
            logits = self.model.forward(fb, self.pool)  # [N, V] float32, N = len(sampling)
            tokens = self.sampler(logits, [r.sampling_params for r in sampling], [r.generator for r in sampling])
        it = iter(tokens)
        return [next(it) if c.sample else None for c in output.chunks]
