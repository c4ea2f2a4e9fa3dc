"""The front end's grammar check: a request's grammar is compiled, within its budget, before it is admitted.

What it knows: that a `response_format` (or a forced tool call) is compiled here first, off the event loop and
under the server's `GrammarBudget`, so a schema the grammar engine refuses or that is over budget is a 400 in
every mode before any engine or worker sees it, and a compile slot that never came free is a 503. Which compiler:
the engine's own when the server runs in the same process as its engine (aggregated: the step loop then finds
the compiled grammar in that compiler's cache), else one of its own for the tokenizer (the disaggregated router),
made on first use. What it does not know: grammars themselves (engine/structured_output.py), HTTP routes.
"""

from __future__ import annotations

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
        self._compiler: GrammarCompiler | None = None

    def _make(self) -> GrammarCompiler:
        if self._factory is not None:
            return self._factory()
        vocab = self.vocab_size or int(getattr(self.tokenizer, "vocab_size", 0))
        return GrammarCompiler(self.tokenizer, vocab, getattr(self.tokenizer, "eos_token_ids", frozenset()))

    async def check(self, spec: StructuredOutputs | None, param: str = "response_format") -> None:
        """Compile `spec` within the budget; raises the request's HTTP error when it cannot be."""
        if spec is None or (self._factory is None and not hasattr(self.tokenizer, "backend")):
            return  # no grammar; or a test's fake tokenizer, which xgrammar cannot read
        if self._compiler is None:
            self._compiler = await anyio.to_thread.run_sync(self._make)
        compiler = self._compiler
        try:
            await anyio.to_thread.run_sync(compiler.compile_within, spec, self.budget, param)
        except GrammarCompilerBusyError as e:
            raise ApiError(503, str(e), type="server_error", param=param, code="grammar_compiler_busy") from None
