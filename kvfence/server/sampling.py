"""From an OpenAI request body to the engine's `SamplingParams`, one per choice.

What it knows: which body fields become which engine knobs (the OpenAI ones and the
vLLM extensions kvfence implements: top_k, min_tokens, repetition_penalty,
stop_token_ids, ignore_eos), which fields it refuses at a non-default value (400
`unsupported_value` naming the field, never silently ignored), how a choice's seed is
chosen (the request's seed + the choice's index, so n choices differ; without one the
engine draws it from its own generator, random per server start unless `--seed`
fixes it), what `logprobs` / `top_logprobs` / `echo` ask of the engine, how
`max_tokens: 0` runs (the engine computes the prompt and one token that the API throws
away), and `response_format` -> `StructuredOutputs` (or the grammar of a forced tool call instead).

What it does not know: HTTP, tokenization, admission (the context length), grammars.
"""

from __future__ import annotations

from typing import Any

from kvfence.engine.sampling_params import SamplingParams, StructuredOutputs
from kvfence.errors import InvalidRequestError
from kvfence.server import openai_schema as p

# field -> (its neutral value, why it is refused); a request with any other value gets a 400
_REFUSED: dict[str, tuple[Any, str]] = {
    "min_p": (0.0, "is not supported by kvfence; send 0 or omit it"),
    "use_beam_search": (False, "beam search is not supported by kvfence"),
    "prompt_logprobs": (None, "is not supported by kvfence; use echo with logprobs (/v1/completions)"),
    "allowed_token_ids": (None, "is not supported by kvfence; use logit_bias"),
    "bad_words": (None, "is not supported by kvfence; use logit_bias"),
    "guided_json": (None, "is not supported by kvfence; use response_format"),
    "guided_regex": (None, "is not supported by kvfence"),
    "guided_choice": (None, "is not supported by kvfence"),
    "guided_grammar": (None, "is not supported by kvfence"),
    "structured_outputs": (None, "is not supported by kvfence; use response_format"),
}


def unsupported(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", code="unsupported_value", param=param)


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", code="invalid_value", param=param)


def refuse_unsupported(req: p.CompletionRequest | p.ChatCompletionRequest) -> None:
    for name, (neutral, why) in _REFUSED.items():
        if getattr(req, name) != neutral:
            raise unsupported(name, why)


def _structured_outputs(fmt: p.ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError(
            "response_format: type json_schema needs json_schema.schema (a JSON schema object)",
            code="missing_required_parameter",
            param="response_format.json_schema.schema",
        )
    return StructuredOutputs.of_schema(fmt.json_schema.schema_)


def _check_ids(param: str, ids: list[int], vocab_size: int | None) -> None:
    bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
    if bad is not None:
        raise _invalid(param, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} with string keys -> {id: bias}; keys that are not ids are a 400."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise _invalid("logit_bias", f"keys must be token ids (strings of digits), got {key[:40]!r}")
        out[int(key)] = float(value)
    _check_ids("logit_bias", list(out), vocab_size)
    return out


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request uses seed + i (wrapped into int64); unseeded ones stay unseeded."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


FROM_REQUEST: Any = object()  # params_for's default: the grammar is the request's response_format


def params_for(
    req: p.CompletionRequest | p.ChatCompletionRequest,
    *,
    max_tokens: int,
    index: int,
    logprobs_mode: str,
    vocab_size: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputs | None = FROM_REQUEST,
) -> SamplingParams:
    """SamplingParams of choice `index`; `max_tokens` is the admitted one (0: score the prompt only).
    `structured_outputs`, when given, replaces the response_format's grammar (a forced tool call's)."""
    if req.min_tokens > max_tokens:
        raise _invalid("min_tokens", f"must be at most max_tokens ({max_tokens}), got {req.min_tokens}")
    stop_ids = list(req.stop_token_ids or [])
    _check_ids("stop_token_ids", stop_ids, vocab_size)
    return SamplingParams(
        max_tokens=max(max_tokens, 1),  # max_tokens 0: the API drops the one token the engine samples
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=choice_seed(req.seed, index),
        stop=tuple(req.stop_list()),
        stop_token_ids=tuple(stop_ids),
        cache_salt=req.cache_salt,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=tuple(sorted(logit_bias(req.logit_bias, vocab_size).items())),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logprobs_mode=logprobs_mode,
        structured_outputs=(
            _structured_outputs(req.response_format) if structured_outputs is FROM_REQUEST else structured_outputs
        ),
    )
