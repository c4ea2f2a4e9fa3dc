"""Turn one forward's logits into one next token per sampling request.

What it knows: greedy choice (temperature 0: argmax, first index on ties, as
transformers does) and random sampling with temperature, top-k and top-p, vectorised
over the batch. Randomness comes from each request's own `torch.Generator`, one
uniform draw per token, and every row goes through the same sort / softmax / cumsum
path whatever else is in the batch, so a seed gives the same tokens alone or batched.

What it does not know: stop rules, requests beyond their sampling params, the model.
"""

from __future__ import annotations

import torch

from kvfence.engine.sampling_params import SamplingParams


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """logits: [N, V] float32, one row per request in `params`; returns N token ids."""
        N, V = logits.shape
        assert N == len(params) == len(generators), (N, len(params), len(generators))
        if N == 0:
            return []
        tokens = logits.argmax(dim=-1)  # [N]; the answer for greedy rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sampled = self._sample(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
            tokens[rows] = sampled
        return tokens.tolist()

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits: [M, V] of the non-greedy rows -> [M] token ids."""
        M, V = logits.shape
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        scaled = logits.float() / temps[:, None]  # [M, V]
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)  # [M, V]; ties by token id
        top_k = [p.top_k if p.top_k > 0 else V for p in params]
        if any(k < V for k in top_k):
            ks = torch.tensor(top_k)
            sorted_logits.masked_fill_(torch.arange(V)[None, :] >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)  # [M, V], descending
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
            probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)  # the first token always stays
        cdf = probs.cumsum(dim=-1)  # [M, V]
        u = torch.stack([torch.rand((), generator=g) for g in generators])  # [M], one draw per request
        u = u * cdf[:, -1]  # inverse CDF over the (unnormalised) kept mass
        choice = torch.searchsorted(cdf, u[:, None], right=True)  # [M, 1]
        last_kept = (probs > 0).sum(dim=-1, keepdim=True) - 1  # kept tokens are a prefix of the sorted row
        choice = torch.minimum(choice, last_kept)  # u rounding up to the total must not pick a dropped token
        return sorted_idx.gather(1, choice).squeeze(1)  # [M]
