"""Run one scheduled step through the model and sample the next tokens.

What it knows: how to turn the scheduler's chunks into a `ForwardBatch` (prefill
chunks that do not reach the end of their prompt ask for no logits), run the model
over the KV pool under `torch.inference_mode`, and hand the logits rows to the
sampler (after each request's grammar mask); chunks of a request that asked for prompt
logprobs return every row, which scores the prompt tokens they predict. For a steady
decode batch (the same requests as last step, each one token longer) it keeps a
contiguous copy of the batch's context per layer, so a step appends one token instead
of gathering every page again; the pool stays the only source of truth (the copy is
rebuilt from it whenever the batch changes). With the native kernels it also runs several greedy decode
steps of a decode batch in one model call (`execute_steps`), and times each batch size's native steps so the
engine can size those calls.

What it does not know: which requests should run, stop rules, or text.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import torch

from kvfence.engine.request import Request
from kvfence.engine.sampler import History, Sampler, SamplerOutput, top_logprobs
from kvfence.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.kv.pool import KVPool
from kvfence.math_utils import cdiv, round_up
from kvfence.models.attention import gather_context
from kvfence.models.forward_batch import ForwardBatch, SeqChunk, build_forward_batch

DEFAULT_CONTEXT_CACHE_BYTES = 256 << 20


class RunnerOutput(NamedTuple):
    token_ids: list[int | None]  # per chunk: the sampled token, None for chunks that do not sample
    logprobs: list[TokenLogprobs | None]  # per chunk: the sampled token's scores, when its request asks
    prompt_logprobs: list[list[TokenLogprobs]]  # per chunk: entries for the prompt tokens it predicts, in order


class DecodeContextCache:
    """Per-(layer, buffer) contiguous copies [B, Hkv, cap, D] of a decode batch's context.

    Valid while the batch is the same Request objects in the same order, each exactly one
    token longer than at the previous step; such a step appends each row's new token as
    the model stores it into the pool (`store_kv` calls `append`). Any other decode batch
    rebuilds the copies from the pool; rows are zero past their length, so masking stays NaN-safe.
    """

    def __init__(self, bytes_per_token: int, max_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES) -> None:
        self.bytes_per_token = bytes_per_token  # all layers and buffers of one token
        self.max_bytes = max_bytes
        self.requests: tuple[Request, ...] = ()
        self.lens: torch.Tensor | None = None  # [B] context lengths the copies hold
        self.cap = 0
        # (data_ptr of a flat pool view, transposed) -> [B, H, cap, *rest], or [B, H, D, cap] when transposed
        self.bufs: dict[tuple[int, bool], torch.Tensor] = {}
        self.num_rebuilds = 0
        # transposed -> (the step's ForwardBatch, flat offsets of its new tokens in a buf of that layout)
        self._append_rows: dict[bool, tuple[ForwardBatch, torch.Tensor]] | None = None

    def invalidate(self) -> None:
        self.requests, self.lens, self.bufs = (), None, {}

    def prepare(self, requests: tuple[Request, ...], fb: ForwardBatch) -> bool:
        """Before a decode forward: append to, build, or skip the copies; False: attention gathers as usual.

        Copies are built only once a batch has been seen twice in a row, so steps that keep
        changing the batch (arrivals, finishes) pay for a plain gather, not for a rebuild.
        """
        K = int(fb.kv_slots.shape[1])
        steady = (
            self.lens is not None
            and len(requests) == len(self.requests)
            and all(a is b for a, b in zip(requests, self.requests, strict=True))
            and torch.equal(fb.kv_lens, self.lens + 1)
        )
        self.requests, self.lens = requests, fb.kv_lens
        if not steady:
            self.cap, self.bufs, self._append_rows = 0, {}, None
            return False
        if self.bufs and K <= self.cap:
            return True  # append this step's token to the copies
        # Room to grow: double the context when that fits the byte budget (a 128-token prompt then
        # decodes to 256 with one build), else a few dozen appends before the next rebuild.
        room = [c for c in (2 * K, K + 32) if len(requests) * round_up(c, 64) * self.bytes_per_token <= self.max_bytes]
        if not room:
            self.cap, self.bufs = 0, {}
            return False
        cap = round_up(room[0], 64)
        self.cap, self.bufs, self._append_rows = cap, {}, None  # rebuilt from the pool, layer by layer, now
        self.num_rebuilds += 1
        return True

    def context(self, cache: torch.Tensor, fb: ForwardBatch, transposed: bool = False) -> torch.Tensor:
        """cache: [S, H, D] flat pool view holding this step's K or V -> [B, H, K, D] (a view).

        transposed: keep this copy as [B, H, D, cap] and return [B, H, D, K] (a view), so that
        decode attention reads keys as the right-hand side of one batched q @ k^T.
        """
        K = int(fb.kv_slots.shape[1])
        key = (cache.data_ptr(), transposed)
        buf = self.bufs.get(key)
        if buf is None:  # first use since prepare() (re)built: copy the context from the pool, new token included
            ctx = gather_context(cache, fb)  # [B, K, H, D], zero past each length
            B, H, rest = ctx.shape[0], ctx.shape[2], tuple(ctx.shape[3:])
            # zero only past K: the first K columns are overwritten by the context right away
            if transposed:
                buf = cache.new_empty(B, H, *rest, self.cap)  # [B, H, D, cap]
                buf[..., :K] = ctx.permute(0, 2, 3, 1)
                buf[..., K:] = 0
            else:
                buf = cache.new_empty(B, H, self.cap, *rest)  # [B, H, cap, D]
                buf[:, :, :K] = ctx.transpose(1, 2)
                buf[:, :, K:] = 0
            self.bufs[key] = buf
        return buf[..., :K] if transposed else buf[:, :, :K]

    def append(self, cache: torch.Tensor, new: torch.Tensor, fb: ForwardBatch) -> None:
        """new: [B, H, *rest], this step's rows just stored into `cache` -> also into its copies.

        Copies that do not exist yet are built from the pool on first use, which then already
        holds these rows; so only copies made in an earlier step take the append.
        """
        for transposed in (True, False):
            buf = self.bufs.get((cache.data_ptr(), transposed))
            if buf is None:
                continue
            rows = self._rows(buf, fb, transposed)
            if transposed:  # one element per (b, h, d) at column `position`
                buf.view(-1).index_copy_(0, rows, new.reshape(-1))
            else:  # one [*rest] block per (b, h) at row `position`
                B, H, cap = buf.shape[:3]
                buf.view(B * H * cap, *buf.shape[3:]).index_copy_(0, rows, new.reshape(B * H, *new.shape[2:]))

    def _rows(self, buf: torch.Tensor, fb: ForwardBatch, transposed: bool) -> torch.Tensor:
        """Flat offsets where this step's tokens go in `buf`, computed once per step and layout."""
        cached = self._append_rows.get(transposed) if self._append_rows is not None else None
        if cached is not None and cached[0] is fb:
            return cached[1]
        if transposed:  # buf [B, H, D, cap] viewed flat: (b, h, d) block of cap elements
            B, H, D, cap = buf.shape
            per_row = H * D
        else:  # buf [B, H, cap, *rest] viewed as [B * H * cap, *rest]
            B, H, cap = buf.shape[:3]
            per_row = H
        rows = torch.arange(B * per_row, device=buf.device) * cap + fb.positions.repeat_interleave(per_row)
        if self._append_rows is None:
            self._append_rows = {}
        self._append_rows[transposed] = (fb, rows)
        return rows


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        device: torch.device | str = "cpu",
        context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES,
        eos_token_ids: tuple[int, ...] = (),
        kernels: str = "torch",
    ) -> None:
        self.model = model
        self.native_decode = kernels == "native"  # decode attention reads the pool in place
        self.pool = pool
        self.page_size = pool.page_size
        self.device = torch.device(device)
        self.sampler = Sampler(eos_token_ids)
        self.context_cache = DecodeContextCache(pool.layout.bytes_per_token, context_cache_bytes)
        # batch size -> seconds per native decode step, a running average of the last steps at that size
        self.step_seconds: dict[int, float] = {}

    def can_run_steps(self, batch_size: int) -> bool:
        """Whether `execute_steps` can run a decode batch of this size (the model's native greedy steps)."""
        applies = getattr(self.model, "decode_steps_apply", None)
        return self.native_decode and applies is not None and bool(applies(batch_size))

    def steps_within(self, batch_size: int, seconds: float) -> int:
        """How many native decode steps of this batch size take about `seconds`, from the steps measured so far
        (1 before any was: that step measures them)."""
        per_step = self.step_seconds.get(batch_size)
        return 1 if per_step is None else max(1, int(seconds / per_step))

    def _note_step_time(self, batch_size: int, seconds: float) -> None:
        old = self.step_seconds.get(batch_size)
        self.step_seconds[batch_size] = seconds if old is None else 0.5 * (old + seconds)

    def execute_steps(self, output: SchedulerOutput, stops: list[tuple[int, ...]], steps: int) -> list[list[int]]:
        """Up to `steps` greedy decode steps of a decode batch in one native call -> per step run, each chunk's
        token (a list per step, in chunk order). stops: per chunk, the tokens that end its request; the call
        ends after the first step where one is sampled. Each request's pages must already hold `steps` more
        tokens (Scheduler.grow_for_steps)."""
        chunks = output.chunks
        assert chunks and all(c.num_tokens == 1 and c.sample for c in chunks), "a decode batch"
        reqs = [c.request for c in chunks]
        P = cdiv(max(c.start for c in chunks) + steps, self.page_size)
        for c in chunks:
            if len(c.request.page_table) * self.page_size < c.start + steps:
                raise RuntimeError(f"{c.request}: its pages do not hold {steps} more tokens (grow_for_steps first)")
        # -1 past a row's own pages: the native call refuses to use a page outside the pool
        kv_pages = torch.tensor([(r.page_table[:P] + [-1] * P)[:P] for r in reqs], dtype=torch.long)  # [B, P]
        ids = torch.tensor([r.token_ids[c.start] for r, c in zip(reqs, chunks, strict=True)], dtype=torch.long)
        positions = torch.tensor([c.start for c in chunks], dtype=torch.long)  # [B]
        model: Any = self.model  # a model with decode_steps (can_run_steps)
        t0 = time.perf_counter()
        with torch.inference_mode():
            tokens = model.decode_steps(ids, positions, kv_pages, self.page_size, stops, steps, self.pool)
        self._note_step_time(len(chunks), (time.perf_counter() - t0) / tokens.shape[0])
        return tokens.tolist()  # [n, B]

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """One forward over every scheduled chunk; a token per chunk that samples, None for the others."""
        chunks: list[SeqChunk] = []
        spans: list[tuple[int, int]] = []  # per chunk: prompt rows to score (see _prompt_span)
        for c in output.chunks:
            req = c.request
            ids = req.token_ids[c.start : c.start + c.num_tokens]
            spans.append(_prompt_span(req, c.start, c.num_tokens))
            mode = "all" if spans[-1][1] else ("last" if c.sample else "none")
            chunks.append(SeqChunk(ids, c.start, req.page_table, mode))
        fb = build_forward_batch(chunks, self.page_size, self.device)
        if self.native_decode and fb.is_decode:
            fb = dataclasses.replace(fb, native_decode=True)  # no context copies to keep
        elif not fb.is_decode:
            self.context_cache.invalidate()
        elif self.context_cache.prepare(tuple(c.request for c in output.chunks), fb):
            fb = dataclasses.replace(fb, context_cache=self.context_cache)
        sampling = [c.request for c in output.chunks if c.sample]
        scored = _ScoredRows.of(output.chunks, spans) if any(n for _, n in spans) else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.forward(fb, self.pool)  # [R, V] float32; R = len(sampling) unless prompts are scored
        if fb.native_decode:
            self._note_step_time(len(output.chunks), time.perf_counter() - t0)
        with torch.inference_mode():
            sample_logits = logits if scored is None else logits[scored.sample_rows]  # [len(sampling), V]
            result = self._sample(sample_logits, sampling)
            prompt = [[] for _ in output.chunks] if scored is None else scored.score(logits)
        tokens, lps = iter(result.token_ids), iter(result.logprobs)
        return RunnerOutput(
            [next(tokens) if c.sample else None for c in output.chunks],
            [next(lps) if c.sample else None for c in output.chunks],
            prompt,
        )

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [N, V], one row per request; grammar masks first, then the sampler."""
        for row, req in zip(logits, requests, strict=True):
            if req.grammar is not None:
                req.grammar.mask_logits(row)
        histories = [
            History(r.prompt_token_ids, r.output_token_ids) if r.sampling_params.processes_logits else _NO_HISTORY
            for r in requests
        ]
        return self.sampler(logits, [r.sampling_params for r in requests], [r.generator for r in requests], histories)


_NO_HISTORY = History((), ())


def _prompt_span(req: Request, start: int, num_tokens: int) -> tuple[int, int]:
    """(offset in the chunk, count) of the chunk's rows that predict prompt tokens not yet scored; (0, 0) if none.

    The row at position p predicts token p + 1; prompt tokens 1 .. P-1 are scored, in order,
    once (a preempted request recomputing its prompt does not score it again).
    """
    if req.prompt_logprobs is None:
        return (0, 0)
    first = max(start, len(req.prompt_logprobs) - 1)
    last = min(start + num_tokens - 1, req.num_prompt_tokens - 2)
    return (first - start, last - first + 1) if last >= first else (0, 0)


class _ScoredRows(NamedTuple):
    """Where a forward that returns every row of some chunks keeps what: the sampling rows and the prompt rows."""

    sample_rows: list[int]  # row of each sampling chunk's last token
    prompt_rows: list[int]  # rows whose logits predict a prompt token
    prompt_next: list[int]  # the prompt token each of those rows predicts
    prompt_k: list[int]  # alternatives wanted per prompt row
    counts: list[int]  # prompt rows per chunk

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], spans: list[tuple[int, int]]) -> _ScoredRows:
        out = cls([], [], [], [], [])
        row = 0
        for c, (first, n) in zip(chunks, spans, strict=True):
            rows = c.num_tokens if n else int(c.sample)
            out.prompt_rows.extend(range(row + first, row + first + n))
            out.prompt_next.extend(c.request.token_ids[c.start + first + 1 : c.start + first + n + 1])
            out.prompt_k.extend([c.request.sampling_params.prompt_logprobs or 0] * n)
            out.counts.append(n)
            if c.sample:
                out.sample_rows.append(row + rows - 1)
            row += rows
        return out

    def score(self, logits: torch.Tensor) -> list[list[TokenLogprobs]]:
        """logits: [R, V] of the whole forward -> per chunk, its prompt tokens' entries (raw logprobs, in order)."""
        next_ids = torch.tensor(self.prompt_next, dtype=torch.long)
        entries = top_logprobs(logits[self.prompt_rows].log_softmax(dim=-1), next_ids, self.prompt_k)
        out, r0 = [], 0
        for n in self.counts:
            out.append(entries[r0 : r0 + n])
            r0 += n
        return out
