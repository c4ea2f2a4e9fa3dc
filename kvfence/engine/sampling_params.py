"""How one request wants its tokens chosen, scored and stopped.

What it knows: the per-request sampling knobs (temperature, top-p, top-k, seed), the
logits processors with vLLM's semantics (logit bias, min_tokens, repetition penalty
over prompt + output, presence / frequency penalties over the output), what to report
(log probabilities of the sampled tokens and of the prompt, raw or processed), the
grammar the output must follow (`StructuredOutputs`: any JSON object, or one JSON
schema), and the stop conditions (max_tokens, stop strings, stop token ids,
ignore_eos). Values are validated where they are made, so a bad one is an
`InvalidRequestError` naming the parameter.

What it does not know: the vocabulary, the tokenizer or the context length (the
engine checks token ids and compiles grammars), nor `n` (several completions are
several requests, made above the engine).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfence.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default --max-logprobs, OpenAI's top_logprobs limit)
MAX_CACHE_SALT = 1024  # longest cache_salt accepted (characters)
MAX_LOGIT_BIAS = 100.0  # |bias| limit, as in the OpenAI API
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, from a mapping or pairs; the values are checked later."""
    items = bias.items() if isinstance(bias, Mapping) else (bias or ())
    try:
        pairs = [(k, v) for k, v in items]  # type: ignore[union-attr,attr-defined]
        return tuple(sorted(pairs, key=lambda kv: kv[0] if _is_int(kv[0]) else -1))
    except (TypeError, ValueError):
        raise _bad("logit_bias", f"must map token ids to numbers, got {bias!r}") from None


@dataclass(frozen=True)
class StructuredOutputs:
    """The grammar a request's output must follow: `json_object` (any JSON object) or `json` (a schema).

    The schema is kept as canonical JSON text, so the params stay hashable and travel
    between processes unchanged.
    """

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False

    @classmethod
    def of_schema(cls, schema: Mapping[str, Any]) -> StructuredOutputs:
        """The grammar of a JSON schema given as an object (kept as its canonical text)."""
        return cls(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True, separators=(",", ":")))
        if (self.json is None) == (not self.json_object):
            raise _bad("response_format", "give exactly one of a JSON schema or json_object")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise _bad("response_format", f"the JSON schema must be an object, got {type(self.json).__name__}")
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise _bad("response_format", f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _bad("response_format", "the JSON schema must be an object")


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
    min_tokens: int = 0  # eos and stop_token_ids cannot be sampled (nor stop strings match) before this many
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; a dict is accepted
    logprobs: int | None = None  # per sampled token: its logprob and this many alternatives; None -> none
    prompt_logprobs: int | None = None  # per prompt token (from the second on), likewise
    logprobs_mode: str = "raw_logprobs"  # raw: the model's distribution; processed: the one sampled from
    structured_outputs: StructuredOutputs | None = None
    detokenize: bool = True  # produce text deltas (off for benchmarks on token ids)
    cache_salt: str | None = None  # the tenant's prefix-cache salt: requests share cached KV only under the same one

    def __post_init__(self) -> None:
        # accept lists / a single string / a dict for convenience, store tuples (the object is frozen)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.structured_outputs, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))

        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise _bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature):
            raise _bad("temperature", f"must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            limit = self.max_tokens
            raise _bad("min_tokens", f"must be an integer in [0, max_tokens {limit}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise _bad(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for t, b in self.logit_bias:
            if not _is_int(t) or t < 0:
                raise _bad("logit_bias", f"keys must be non-negative token ids, got {t!r}")
            if not _is_number(b) or abs(b) > MAX_LOGIT_BIAS:
                raise _bad("logit_bias", f"bias of token {t} must be a number in [-100, 100], got {b!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not (0 <= value <= MAX_LOGPROBS)):
                raise _bad(name, f"must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _bad("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise _bad("structured_outputs", f"must be StructuredOutputs, got {self.structured_outputs!r}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt or len(self.cache_salt) > MAX_CACHE_SALT
        ):
            raise _bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT} characters")
        if self.structured_outputs is not None and self.ignore_eos:
            raise _bad("ignore_eos", "cannot be combined with a response_format: a finished grammar ends with eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature / top-k / top-p changes the logits before sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def to_dict(self) -> dict:
        """JSON-ready fields (tuples as lists), the inverse of `from_dict`."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        so = self.structured_outputs
        d["structured_outputs"] = None if so is None else {"json": so.json, "json_object": so.json_object}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> SamplingParams:
        """Params from `to_dict` output (unknown keys are ignored, so older peers still parse)."""
        kwargs = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for key in ("stop", "stop_token_ids"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        if isinstance(kwargs.get("logit_bias"), list):
            kwargs["logit_bias"] = tuple((int(t), float(b)) for t, b in kwargs["logit_bias"])
        return cls(**kwargs)
