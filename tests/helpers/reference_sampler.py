"""A plain-Python reference of vLLM's logits processors and log-softmax, one row at a time: the oracle the
sampler and engine logprob tests compare against. It knows min_tokens, logit_bias and the repetition,
frequency and presence penalties in vLLM's order; it does not sample, and knows no temperature, top-k,
top-p or grammar masks."""

from __future__ import annotations

import math

from kvfence.engine.sampling_params import SamplingParams


def reference_processed(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams, eos: tuple[int, ...]
) -> list[float]:
    """vLLM's order, one token at a time in plain Python: min_tokens, logit_bias, repetition (prompt + output),
    then frequency (per output occurrence) and presence (once per output token)."""
    x = list(row)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def log_softmax(x: list[float]) -> list[float]:
    m = max(v for v in x if v != float("-inf"))
    z = math.log(sum(math.exp(v - m) for v in x if v != float("-inf"))) + m
    return [v - z for v in x]
