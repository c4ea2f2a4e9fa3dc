"""One position's log probabilities as every layer passes them on: the token there, its logprob, the best tokens.

What it knows: the shape of that record (a NamedTuple of plain ints and floats), nothing else, so that the processes
that only carry scores (the disaggregated router, the HTTP layer) import it without torch. What it does not know:
how the scores are computed (`kvfence.engine.sampler`) or written on the wire (`kvfence.disagg.messages`).
"""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """One position's scores: the token that is there, its logprob, and the most likely ones (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the `n` most likely tokens; () when n == 0
