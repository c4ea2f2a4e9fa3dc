"""Grammars that constrain a request's output to JSON, over xgrammar.

What it knows: how to describe a tokenizer to xgrammar once per engine (byte-level or
sentencepiece-style vocabulary, the eos ids that end a finished grammar, and the
tokenizer's special tokens, which a grammar never allows), how to compile a request's
`StructuredOutputs` (`json_object`: any JSON object; `json`: one JSON schema, strict
as vLLM compiles it; both without free whitespace, so a weak model cannot wander in
blanks), and one `Grammar` per request: the bitmask of tokens that may come next,
applied to that request's logits row before anything else reads it, and the tokens
that were actually appended. A schema xgrammar cannot compile is an
`InvalidRequestError` on `response_format`.

What it does not know: sampling, scheduling or HTTP. Why xgrammar and not llguidance or
outlines-core: `python -m kvfence.bench.grammar` (numbers in docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.errors import InvalidRequestError

_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'  # a string character as xgrammar bounds strings: control characters allowed
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'  # what JSON allows unescaped in a string


def _hf_wrapper(tokenizer: Any) -> Any:
    """A transformers tokenizer over our `tokenizers` backend (what xgrammar reads vocabularies from)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer and logits width; xgrammar caches compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] | set[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        detected = xgr.TokenizerInfo.from_huggingface(
            _hf_wrapper(tokenizer), vocab_size=self.vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        backend = tokenizer.backend
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        vocab = [""] * self.vocab_size  # an empty entry is a token no grammar allows (specials, padding rows)
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size and i not in special:
                vocab[i] = text
        info = xgr.TokenizerInfo(
            vocab,
            detected.vocab_type,
            vocab_size=self.vocab_size,
            stop_token_ids=sorted(eos_token_ids),
            add_prefix_space=detected.add_prefix_space,
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of `spec`; InvalidRequestError (param response_format) when it cannot be built."""
        try:
            if spec.json_object:
                schema, strict = '{"type": "object"}', False  # strict mode would allow only {}
            else:
                schema, strict = spec.json, True  # as vLLM compiles a schema
            ebnf = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
            # xgrammar 0.2 writes length-bounded strings as [^"\\\r\n]{m,n}, which lets control characters
            # (invalid in JSON, e.g. \x02) through; they are excluded as in its own unbounded strings
            ebnf = ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
            return self._compiler.compile_grammar(ebnf)
        except (RuntimeError, ValueError) as e:
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(
                f"response_format: the JSON schema cannot be compiled into a grammar: {detail}", param="response_format"
            ) from None

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        return Grammar(self._xgr, self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


class Grammar:
    """One request's place in its grammar: which tokens may come next, and the tokens it has taken."""

    def __init__(self, xgr: Any, matcher: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def accept(self, token_id: int) -> bool:
        """Advance by one appended token; False if the grammar does not allow it (the matcher is unchanged)."""
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its eos was accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def mask_logits(self, logits: torch.Tensor) -> None:
        """logits: [V] float32, one request's row: tokens the grammar forbids become -inf, in place."""
        if self.is_terminated:
            return  # only a request that ignores its eos gets here; nothing left to constrain
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits[None, :], self._bitmask)
