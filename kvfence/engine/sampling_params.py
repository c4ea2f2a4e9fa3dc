"""How one request wants its tokens chosen and when it wants to stop.

What it knows: the per-request sampling knobs (temperature, top-p, top-k, seed) and
stop conditions (max_tokens, stop strings, stop token ids, ignore_eos), validated
where they are made so a bad value is an `InvalidRequestError` naming the parameter.
What it does not know: the vocabulary, the tokenizer or the context length (the
engine checks those), nor `n` (several completions are several requests, made above
the engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfence.errors import InvalidRequestError


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 -> all
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; the matched string is cut from the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    detokenize: bool = True  # produce text deltas (off for benchmarks on token ids)

    def __post_init__(self) -> None:
        # accept lists / a single string for convenience, store tuples (the object is frozen)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise _bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise _bad("temperature", f"must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise _bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise _bad("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise _bad("stop_token_ids", f"must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0
