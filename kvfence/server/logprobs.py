"""Log probabilities in the OpenAI API's two shapes, made from the engine's `TokenLogprobs`.

What it knows: the legacy completions shape (parallel lists `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`; each top dict holds the chosen token and the `logprobs`
most likely ones, so up to n + 1 entries, as OpenAI documents and vLLM returns; an
echoed prompt's first token, which nothing predicts, has null entries) and the chat
shape (`content`: one object per token with its `bytes` and exactly `top_logprobs`
alternatives, best first). JSON has no -inf: a token the processing removed (processed
logprobs under top-k / top-p, or a grammar) is reported as -9999.0, the value OpenAI
and vLLM use. A token's string is that token decoded alone, special tokens kept.

What it does not know: how the numbers were computed (the engine's sampler), HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.server import openai_schema as p

NEG_INF_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and anything below) becomes -9999.0."""
    return logprob if logprob > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    token_text: Callable[[int], str],
    text_offset: int = 0,
) -> p.CompletionLogprobs:
    """One entry per token id (`entries[i]` scores `token_ids[i]`); offsets start at `text_offset`."""
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    top: list[dict[str, float] | None] = []
    for tok, e in zip(tokens, entries, strict=True):
        if e is None:
            top.append(None)
            continue
        d = {tok: finite(e.logprob)}
        for tid, lp in e.top:
            d.setdefault(token_text(tid), finite(lp))
        top.append(d)
    return p.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else finite(e.logprob) for e in entries],
        top_logprobs=top,
        text_offset=offsets,
    )


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs], token_text: Callable[[int], str]
) -> p.ChatChoiceLogprobs:
    """`content` of a chat choice (or of a stream delta): one object per token."""
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))

    def top(tid: int, lp: float) -> p.ChatTopLogprob:
        s = token_text(tid)
        return p.ChatTopLogprob(token=s, logprob=finite(lp), bytes=list(s.encode("utf-8")))

    content = []
    for tid, e in zip(token_ids, entries, strict=True):
        s = token_text(tid)
        content.append(
            p.ChatTokenLogprob(
                token=s,
                logprob=finite(e.logprob),
                bytes=list(s.encode("utf-8")),
                top_logprobs=[top(t, lp) for t, lp in e.top],
            )
        )
    return p.ChatChoiceLogprobs(content=content)
