"""The front end's grammar check: a request's grammar is compiled, within its budget, before it is admitted.

What it knows: that a `response_format` (or a forced tool call) is compiled here first, off the event loop and
under the server's `GrammarBudget`, so a schema the grammar engine refuses or that is over budget is a 400 in
every mode before any engine or worker sees it, and a compile slot that never came free is a 503. Which compiler:
the engine's own when the server runs in the same process as its engine (aggregated: the step loop then finds
the compiled grammar in that compiler's cache), else one of its own for the tokenizer (the disaggregated router).
Made on the first grammar, once, however many requests ask at the same time: making one imports xgrammar (and
torch, in a router that has none) and reads the vocabulary, ~1.2 s of one core and ~70 MiB beside torch (~260 MiB
in the router), which a server that never sees a grammar does not pay (as vLLM, which also makes its grammar
backend on first use). What it does not know: grammars themselves (engine/structured_output.py), HTTP routes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio

from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.engine.structured_output import GrammarBudget, GrammarCompiler, GrammarCompilerBusyError
from kvfence.server.http import ApiError


class GrammarGate:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None,
        budget: GrammarBudget,
        compiler: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        """`compiler`: the engine's (shared cache); None makes one for `tokenizer` on the first grammar."""
        self.tokenizer, self.vocab_size, self.budget = tokenizer, vocab_size, budget
        self._factory = compiler
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None

    @property
    def usable(self) -> bool:
        """False for a test's fake tokenizer, which xgrammar cannot read (its grammars are not checked here)."""
        return self._factory is not None or hasattr(self.tokenizer, "backend")

    def _get(self) -> GrammarCompiler:
        """The compiler, made now if it is not (one caller makes it; the others wait for it on the lock). A make
        that raises leaves none, so the next grammar tries again."""
        with self._lock:
            if self._compiler is None:
                if self._factory is not None:
                    self._compiler = self._factory()
                else:
                    vocab = self.vocab_size or int(getattr(self.tokenizer, "vocab_size", 0))
                    eos: frozenset[int] = frozenset(getattr(self.tokenizer, "eos_token_ids", frozenset()))
                    self._compiler = GrammarCompiler(self.tokenizer, vocab, eos)
            return self._compiler

    async def check(self, spec: StructuredOutputs | None, param: str = "response_format") -> None:
        """Compile `spec` within the budget; raises the request's HTTP error when it cannot be."""
        if spec is None or not self.usable:
            return
        compiler = await anyio.to_thread.run_sync(self._get)
        try:
            await anyio.to_thread.run_sync(compiler.compile_within, spec, self.budget, param)
        except GrammarCompilerBusyError as e:
            raise ApiError(503, str(e), type="server_error", param=param, code="grammar_compiler_busy") from None
