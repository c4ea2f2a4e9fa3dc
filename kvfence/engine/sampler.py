"""Turn one forward's logits into one next token per sampling request, and score it.

What it knows: the order vLLM processes logits in, applied to float32 rows: (grammar
masks are applied by the caller first) -> raw logprobs -> min_tokens (eos and stop ids
banned) -> logit_bias -> repetition penalty (prompt + output tokens) -> frequency and
presence penalties (output tokens) -> greedy argmax, or temperature -> top-k -> top-p
-> one draw. Greedy is argmax (first index on ties, as transformers does). Randomness
comes from each request's own `torch.Generator`, one uniform draw per token, and every
random row goes through the same sort / softmax / cumsum path whatever else is in the
batch, so a seed gives the same tokens alone or batched. Log probabilities come from
these same logits: `raw_logprobs` (vLLM's default) is the log-softmax before min_tokens,
bias and penalties (after a grammar mask); `processed_logprobs` is the distribution the
token was drawn from (after everything, temperature and top-k/top-p included; masked
tokens are -inf). A batch in which nobody asks for logprobs or processing takes the
plain path and pays for none of it.

What it does not know: stop rules, requests beyond their sampling params and token
history, grammars, the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs


class History(NamedTuple):
    """What penalties and min_tokens read of one request besides its params."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """logprobs: [R, V] float32, token_ids: [R] -> per row the token's logprob and its row's ks[r] best."""
    R = logprobs.shape[0]
    chosen = logprobs.gather(1, token_ids.view(R, 1)).squeeze(1).tolist()  # [R]
    k_max = max(ks, default=0)
    best_lp: list[list[float]] = [[] for _ in range(R)]
    best_id: list[list[int]] = [[] for _ in range(R)]
    if k_max > 0:
        values, indices = logprobs.topk(k_max, dim=-1)  # [R, k_max] each, best first
        best_lp, best_id = values.tolist(), indices.tolist()
    ids = token_ids.tolist()
    return [
        TokenLogprobs(ids[r], chosen[r], tuple(zip(best_id[r][: ks[r]], best_lp[r][: ks[r]], strict=True)))
        for r in range(R)
    ]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> [N] int64, each row's first index of its largest value, a NaN counting as the largest
    (torch.argmax's answer). CPU float32 rows go through numpy's argmax, the same answer (tests/test_sampler.py
    compares them on ties, NaNs, infinities and signed zeros) from the calling thread alone: torch's argmax is an
    OpenMP region that wakes its pool for microseconds of work, after which the pool's threads spin on the cores the
    next decode step's kernels need. Greedy batch-8 decode of the 100M preset: 0.2 ms of the 5 ms step went to
    torch's argmax; the step was ~3% faster with numpy's (docs/benchmarks.md, "Greedy argmax through numpy")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))  # [N]
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)  # banned with the stop ids while min_tokens is not reached

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[History] | None = None,
    ) -> SamplerOutput:
        """logits: [N, V] float32, one row per request in `params` (may be changed in place); N tokens out.

        `histories` (one per row) is needed when a row has penalties or min_tokens.
        """
        N, V = logits.shape
        assert N == len(params) == len(generators), (N, len(params), len(generators))
        if N == 0:
            return SamplerOutput([], [])
        wants = [p.logprobs is not None for p in params]
        processing = [p.processes_logits for p in params]
        if not any(wants) and not any(processing):  # the plain path: nothing to score or process
            return SamplerOutput(self._choose(logits, params, generators, None), [None] * N)

        raw_rows = [i for i in range(N) if wants[i] and params[i].logprobs_mode == "raw_logprobs"]
        raw = logits[raw_rows].log_softmax(dim=-1) if raw_rows else None  # [len(raw_rows), V]
        rows = [i for i in range(N) if processing[i]]
        if rows:
            assert histories is not None and len(histories) == N, "penalties and min_tokens need each row's history"
            logits[rows] = self._process(logits[rows], [params[i] for i in rows], [histories[i] for i in rows])
        processed: dict[int, torch.Tensor] = {}  # row -> [V] processed logprobs, for the rows that want them
        tokens = self._choose(logits, params, generators, processed)

        out: list[TokenLogprobs | None] = [None] * N
        lp_rows = [i for i in range(N) if wants[i]]
        if not lp_rows:
            return SamplerOutput(tokens, out)
        lp = torch.stack(
            [raw[raw_rows.index(i)] if raw is not None and i in raw_rows else processed[i] for i in lp_rows]
        )  # [L, V]
        chosen = torch.tensor([tokens[i] for i in lp_rows], dtype=torch.long)
        for i, entry in zip(lp_rows, top_logprobs(lp, chosen, [params[i].logprobs or 0 for i in lp_rows]), strict=True):
            out[i] = entry
        return SamplerOutput(tokens, out)

    # -- logits processors ------------------------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
        """logits: [M, V] of the rows that process -> [M, V]: min_tokens, logit_bias, then penalties."""
        M, V = logits.shape
        for r, (p, h) in enumerate(zip(params, histories, strict=True)):
            if p.min_tokens and len(h.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                ids = torch.tensor(sorted(t for t in banned if t < V), dtype=torch.long)
                row = logits[r].index_fill(0, ids, float("-inf"))
                if torch.isfinite(row).any():  # a grammar that allows only eos keeps it: never an empty row
                    logits[r] = row
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
                logits[r].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype))
        pen = [r for r, p in enumerate(params) if p.has_penalties]
        if not pen:
            return logits
        counts = torch.zeros(len(pen), V, dtype=logits.dtype)  # [P, V] occurrences in the output
        seen = torch.zeros(len(pen), V, dtype=torch.bool)  # [P, V] in the prompt or the output
        for j, r in enumerate(pen):
            out_ids = torch.as_tensor(list(histories[r].output_token_ids), dtype=torch.long)
            counts[j] = torch.bincount(out_ids, minlength=V)[:V].to(logits.dtype)
            seen[j, torch.as_tensor(list(histories[r].prompt_token_ids), dtype=torch.long)] = True
        seen |= counts > 0
        x = logits[pen]  # [P, V]
        rep = torch.tensor([params[r].repetition_penalty for r in pen], dtype=x.dtype)[:, None]  # [P, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([params[r].frequency_penalty for r in pen], dtype=x.dtype)[:, None]
        pres = torch.tensor([params[r].presence_penalty for r in pen], dtype=x.dtype)[:, None]
        logits[pen] = x - freq * counts - pres * (counts > 0).to(x.dtype)
        return logits

    # -- choosing ------------------------------------------------------------------------------------------------
    def _choose(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        processed: dict[int, torch.Tensor] | None,
    ) -> list[int]:
        """Greedy and random rows; fills `processed` (row -> [V] logprobs) for rows that want processed logprobs."""
        tokens = argmax_rows(logits)  # [N]; the answer for greedy rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        want = (
            set()
            if processed is None
            else {i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed_logprobs"}
        )
        if rows:
            keep = [i in want for i in rows]
            sampled, kept = self._sample(
                logits[rows], [params[i] for i in rows], [generators[i] for i in rows], any(keep)
            )
            tokens[rows] = sampled
            if kept is not None:
                for j, i in enumerate(rows):
                    if keep[j]:
                        processed[i] = kept[j].log_softmax(dim=-1)  # type: ignore[index]
        for i in want.difference(rows):  # greedy rows: the processed logits at temperature 1
            processed[i] = logits[i].log_softmax(dim=-1)  # type: ignore[index]
        return tokens.tolist()

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [M, V] of the non-greedy rows -> [M] token ids, and (keep) the [M, V] logits sampled from:
        scaled by temperature, -inf where top-k / top-p dropped a token."""
        M, V = logits.shape
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        scaled = logits.float() / temps[:, None]  # [M, V]
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)  # [M, V]; ties by token id
        top_k = [p.top_k if p.top_k > 0 else V for p in params]
        dropped = None  # [M, V] bool in sorted order: tokens top-k or top-p removed
        if any(k < V for k in top_k):
            ks = torch.tensor(top_k)
            dropped = torch.arange(V)[None, :] >= ks[:, None]
            sorted_logits.masked_fill_(dropped, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)  # [M, V], descending
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
            cut = mass_before >= top_p[:, None]  # the first token always stays
            probs = probs.masked_fill(cut, 0.0)
            dropped = cut if dropped is None else dropped | cut
        cdf = probs.cumsum(dim=-1)  # [M, V]
        u = torch.stack([torch.rand((), generator=g) for g in generators])  # [M], one draw per request
        u = u * cdf[:, -1]  # inverse CDF over the (unnormalised) kept mass
        choice = torch.searchsorted(cdf, u[:, None], right=True)  # [M, 1]
        last_kept = (probs > 0).sum(dim=-1, keepdim=True) - 1  # kept tokens are a prefix of the sorted row
        choice = torch.minimum(choice, last_kept)  # u rounding up to the total must not pick a dropped token
        kept = None
        if keep:  # back to vocabulary order, dropped tokens at -inf
            kept_sorted = sorted_logits if dropped is None else sorted_logits.masked_fill(dropped, float("-inf"))
            kept = torch.empty_like(scaled).scatter_(1, sorted_idx, kept_sorted)  # [M, V]
        return sorted_idx.gather(1, choice).squeeze(1), kept
