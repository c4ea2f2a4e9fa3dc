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

Compiling is the expensive part (a JSON schema with a 20,000-value enum takes over 10 s on
a 2,048-token vocabulary, and grows faster than the schema), so compiled grammars are kept
in a bounded LRU cache keyed by the request's `StructuredOutputs`, and `compile_within`
compiles under a `GrammarBudget`: the grammar's size is checked before compiling, the
compile runs on a thread of its own (xgrammar releases the GIL), at most
`max_concurrent` at a time, and the caller waits for it at most `compile_timeout_s`. A
grammar over budget is `GrammarTooComplexError` (HTTP 400) and is remembered, so the
same schema is refused at once next time; a compile that overran keeps its thread until
xgrammar returns (a compile cannot be interrupted) and is not cached. The front end calls
`compile_within` before admission, so a step loop that then calls `compile` on the same
compiler finds the grammar in the cache.

What it does not know: sampling, scheduling or HTTP. Why xgrammar and not llguidance or
outlines-core: `python -m kvfence.bench.grammar` (numbers in docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.errors import InvalidRequestError, KvfenceError

if TYPE_CHECKING:  # the router compiles grammars without torch; only the engine masks logits
    import torch

_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"  # a string character as xgrammar bounds strings: control characters allowed
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped in a string


def _hf_wrapper(tokenizer: Any) -> Any:
    """A transformers tokenizer over our `tokenizers` backend (what xgrammar reads vocabularies from)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's grammar may cost to compile."""

    max_grammar_bytes: int = 128 * 1024  # the grammar (EBNF) xgrammar would compile; a 6,000-value enum is ~130 KB
    compile_timeout_s: float = 5.0  # how long a request waits for its compile (queueing for a slot included)
    max_concurrent: int = 2  # compiles running at once (each holds a core until xgrammar returns)

    def __post_init__(self) -> None:
        if self.max_grammar_bytes <= 0 or self.compile_timeout_s <= 0 or self.max_concurrent <= 0:
            raise ValueError(f"a grammar budget needs positive limits, got {self}")


class GrammarTooComplexError(InvalidRequestError):
    """A grammar over its budget (size or compile time): HTTP 400."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message, code="grammar_too_complex", param=param)


class GrammarCompilerBusyError(KvfenceError):
    """Every compile slot stayed taken for the whole budget (other requests' grammars): try again later."""


_CACHE_ENTRIES = 64  # compiled grammars kept
_CACHE_BYTES = 256 * 1024 * 1024  # and their memory, at most
_REFUSED_ENTRIES = 1024  # schemas remembered as over budget


def _key(spec: StructuredOutputs) -> bytes:
    return hashlib.sha256(f"{spec.json_object}\0{spec.json}".encode()).digest()


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer and logits width, keeping the last ones compiled.

    Thread-safe: the front end compiles from worker threads while an engine thread reads the cache."""

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
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the cache is ours
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[bytes, Any] = collections.OrderedDict()  # key -> CompiledGrammar
        self._cache_bytes = 0
        self._refused: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # key -> why
        self._running: dict[bytes, concurrent.futures.Future[Any]] = {}  # compiles in flight
        self._slots: threading.BoundedSemaphore | None = None  # made by the first budget

    @staticmethod
    def _invalid(e: Exception, param: str) -> InvalidRequestError:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return InvalidRequestError(f"{param}: the JSON schema cannot be compiled into a grammar: {detail}", param=param)

    def ebnf(self, spec: StructuredOutputs, param: str = "response_format") -> str:
        """The grammar xgrammar compiles for `spec` (cheap to make; its size predicts the compile's cost)."""
        try:
            if spec.json_object:
                schema, strict = '{"type": "object"}', False  # strict mode would allow only {}
            else:
                assert spec.json is not None  # StructuredOutputs holds one of the two
                schema, strict = spec.json, True  # as vLLM compiles a schema
            ebnf = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
        except (RuntimeError, ValueError) as e:
            raise self._invalid(e, param) from None
        # xgrammar 0.2 writes length-bounded strings as [^"\\\r\n]{m,n}, which lets control characters
        # (invalid in JSON, e.g. \x02) through; they are excluded as in its own unbounded strings
        return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)

    def _cached(self, key: bytes) -> Any:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _keep(self, key: bytes, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key in self._cache or size > _CACHE_BYTES:
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            while len(self._cache) > _CACHE_ENTRIES or self._cache_bytes > _CACHE_BYTES:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= int(old.memory_size_bytes)

    def _compile_ebnf(self, ebnf: str, param: str) -> Any:
        try:
            return self._compiler.compile_grammar(ebnf)
        except (RuntimeError, ValueError) as e:
            raise self._invalid(e, param) from None

    def compile(self, spec: StructuredOutputs, param: str = "response_format") -> Any:
        """The compiled grammar of `spec`, from the cache or compiled here without a budget (the engine's call);
        InvalidRequestError (on `param`) when it cannot be built."""
        key = _key(spec)
        compiled = self._cached(key)
        if compiled is None:
            compiled = self._compile_ebnf(self.ebnf(spec, param), param)
            self._keep(key, compiled)
        return compiled

    def _refuse(self, key: bytes, why: str, param: str) -> GrammarTooComplexError:
        with self._lock:
            self._refused[key] = why
            self._refused.move_to_end(key)
            while len(self._refused) > _REFUSED_ENTRIES:
                self._refused.popitem(last=False)
        return GrammarTooComplexError(f"{param}: {why}", param)

    def _slot_pool(self, budget: GrammarBudget) -> threading.BoundedSemaphore:
        with self._lock:
            if self._slots is None:
                self._slots = threading.BoundedSemaphore(budget.max_concurrent)
            return self._slots

    def compile_within(self, spec: StructuredOutputs, budget: GrammarBudget, param: str = "response_format") -> Any:
        """The compiled grammar of `spec`, compiled under `budget` (blocks the calling thread, at most about
        `budget.compile_timeout_s`). Raises GrammarTooComplexError (400) for a grammar over its size or time,
        GrammarCompilerBusyError when no compile slot came free in time, InvalidRequestError when it cannot be
        built. The first budget given fixes the number of compile slots."""
        deadline = time.monotonic() + budget.compile_timeout_s
        key = _key(spec)
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        with self._lock:
            refused = self._refused.get(key)
            running = self._running.get(key)
        if refused is not None:
            raise GrammarTooComplexError(f"{param}: {refused}", param)
        if running is None:
            ebnf = self.ebnf(spec, param)
            if len(ebnf) > budget.max_grammar_bytes:
                why = (
                    f"the grammar of this JSON schema is {len(ebnf)} bytes, over the server's limit of "
                    f"{budget.max_grammar_bytes} (--max-grammar-bytes); make the schema smaller"
                )
                raise self._refuse(key, why, param)
            running = self._start(key, ebnf, param, self._slot_pool(budget), deadline)
        try:
            return running.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            why = (
                f"compiling the grammar of this JSON schema took longer than the server's budget of "
                f"{budget.compile_timeout_s:g} s (--grammar-compile-timeout-s); make the schema simpler"
            )
            raise self._refuse(key, why, param) from None

    def _start(
        self, key: bytes, ebnf: str, param: str, slots: threading.BoundedSemaphore, deadline: float
    ) -> concurrent.futures.Future[Any]:
        """A compile of `ebnf` on a thread of its own, once a slot is free (waiting until `deadline` at most)."""
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise GrammarCompilerBusyError(
                f"{param}: every grammar compile slot is busy with other requests' grammars; try again later"
            )
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            running = self._running.get(key)
            if running is not None:  # another request started the same compile meanwhile
                slots.release()
                return running
            self._running[key] = future

        def run() -> None:
            try:
                compiled = self._compile_ebnf(ebnf, param)
                if time.monotonic() <= deadline:
                    self._keep(key, compiled)
                future.set_result(compiled)
            except BaseException as e:
                future.set_exception(e)
            finally:
                with self._lock:
                    self._running.pop(key, None)
                slots.release()

        # not a daemon: a process that exits during a compile waits for xgrammar to return (tearing the
        # interpreter down under a running compile aborts the process)
        threading.Thread(target=run, name="kvfence-grammar-compile").start()
        return future

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A new matcher for one request (from the cache when the front end compiled `spec` already)."""
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
