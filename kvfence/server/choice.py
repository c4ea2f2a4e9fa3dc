"""One choice of a response: one engine request and everything it has produced so far.

What it knows: the request a choice runs (id, prompt ids, `SamplingParams`), what the engine streamed back
for it (token ids, text pieces, logprobs, the prompt's logprobs, the integrity record, the finish reason or
the error), the streaming cursors an endpoint's renderer keeps on it (echo sent, characters sent), and the
facts every endpoint derives from a list of choices: token usage, the first failure as an HTTP error, the
`X-Kvfence-Integrity` header and the top-level integrity record. What it does not know: how choices are made
from a request body (each endpoint's module), how they are run (generation.py) or rendered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvfence.engine.engine_client import GenerationChunk, RequestTimings
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.server import openai_schema as p
from kvfence.server.http import ApiError


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int  # which prompt of a batched /v1/completions request
    prompt_ids: list[int]
    params: SamplingParams
    score_only: bool = False  # max_tokens 0: the engine's one token is dropped
    echo_text: str | None = None  # the prompt's text, when echoed
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    echoed: bool = False  # streaming: the echoed prompt went out
    text_sent: int = 0  # streaming: characters sent so far (the text_offset of the next token)
    finished: bool = False
    finish_reason: str | None = None
    integrity: dict[str, Any] | None = None
    error: str | None = None
    error_code: str | None = None
    num_output_tokens: int = 0
    t_first: float | None = None  # monotonic time of the first output token
    t_last: float | None = None  # monotonic time of the latest output token
    timings: RequestTimings | None = None  # the engine's own account of the request, on its last chunk

    def absorb(self, chunk: GenerationChunk) -> None:
        if chunk.token_ids:
            now = time.monotonic()
            if self.t_first is None:
                self.t_first = now
            self.t_last = now
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if not self.score_only:
            self.token_ids += chunk.token_ids
            self.text.append(chunk.text)
            if chunk.logprobs:
                self.logprobs += chunk.logprobs
            self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens, len(self.token_ids))
        if chunk.integrity is not None:
            self.integrity = chunk.integrity
        if chunk.timings is not None:
            self.timings = chunk.timings
        if chunk.finished:
            self.finished = True
            self.finish_reason = chunk.finish_reason
            if self.score_only and chunk.finish_reason in ("stop", "length"):
                self.finish_reason = "length"  # nothing was generated: the 0-token limit ended it
            if chunk.finish_reason == "error":
                self.error = chunk.error or "generation failed"
                self.error_code = str(chunk.extra.get("code", "generation_failed"))

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    def prompt_entries(self) -> list[TokenLogprobs | None]:
        """The prompt's logprob entries of an echoed choice (null ones if the engine sent none, e.g. after an
        error)."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_ids):
            return list(self.prompt_logprobs)
        return [None] * len(self.prompt_ids)


def failed_chunk(chunk: GenerationChunk) -> bool:
    """The engine's last chunk of a choice that failed (its finish_reason "error" is internal, never sent)."""
    return chunk.finished and chunk.finish_reason == "error"


def count_prompt_tokens(choices: list[Choice]) -> int:
    """Prompt tokens of a response: each prompt once, however many choices it has."""
    return sum({c.prompt_index: len(c.prompt_ids) for c in choices}.values())


def usage(choices: list[Choice]) -> p.Usage:
    prompt_tokens = count_prompt_tokens(choices)
    completion = sum(c.num_output_tokens for c in choices)
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def failure(choices: list[Choice]) -> ApiError | None:
    """The HTTP error of the first failed choice (500, the engine's code), None when none failed."""
    bad = next((c for c in choices if c.error is not None), None)
    if bad is None:
        return None
    return ApiError(500, f"choice {bad.index}: {bad.error}", type="server_error", code=bad.error_code)


def integrity_records(choices: list[Choice]) -> dict[str, Any]:
    """`{"kvfence": {"integrity": [record per choice]}}`, attached to an error body or a stream's error event."""
    return {"kvfence": {"integrity": [c.integrity for c in choices]}}


def integrity_header(choices: list[Choice]) -> dict[str, str]:
    """`X-Kvfence-Integrity`: each choice's record status in index order (no header when none has a record)."""
    records = [c.integrity for c in choices]
    if all(r is None for r in records):
        return {}
    parts = []
    for r in records:
        status = "none" if r is None else str(r.get("status", "unknown"))
        parts.append("".join(ch for ch in status if ch.isascii() and ch.isprintable() and ch != ","))
    return {"X-Kvfence-Integrity": ",".join(parts)}


def top_level_integrity(choices: list[Choice]) -> dict[str, Any] | None:
    """The top-level `kvfence` object of a response with exactly one choice (its record), else None."""
    if len(choices) == 1 and choices[0].integrity is not None:
        return {"integrity": choices[0].integrity}
    return None


def choice_integrity(c: Choice) -> dict[str, Any] | None:
    return None if c.integrity is None else {"integrity": c.integrity}
