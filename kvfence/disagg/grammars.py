"""Compiling a request's response_format grammar off a worker's step loop.

What it knows: which requests of a prefill or decode worker wait for their grammar, a compile for each started on
a thread of its own under the deployment's `GrammarBudget` (`GrammarCompiler.compile_within`: size first, then
time, a bounded number at once, a cache), and how each ended: ready (the engine then builds the request's matcher
from the cache, at once) or refused with the reason. The front end refuses over-budget grammars before any worker
sees them; a worker compiles the admitted ones again in its own process, and a schema that takes seconds must not
keep the loop from its neighbours' steps, nor make the worker miss its heartbeats.

What it does not know: the worker's requests or their states; the worker asks `ready` / `failed` and acts.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.structured_output import GrammarBudget
from kvfence.errors import KvfenceError


class GrammarWaits:
    """The grammar compiles of one worker's requests, keyed by request id."""

    def __init__(self, engine: Any, budget: GrammarBudget) -> None:
        self._engine = engine  # LLMEngine: its grammar_compiler()
        self._budget = budget
        self._pool = concurrent.futures.ThreadPoolExecutor(budget.max_concurrent, thread_name_prefix="kvfence-grammar")
        self._waits: dict[str, concurrent.futures.Future[Any]] = {}
        self._made = threading.Lock()  # the engine's compiler is made on first use (about a second), off the loop

    def start(self, request_id: str, params: SamplingParams) -> bool:
        """Begin compiling `params`' grammar for `request_id`; False when it has none (nothing to wait for)."""
        spec = params.structured_outputs
        if spec is None:
            return False
        self._waits[request_id] = self._pool.submit(self._compile, spec)
        return True

    def _compile(self, spec: Any) -> Any:
        with self._made:
            compiler = self._engine.grammar_compiler()
        return compiler.compile_within(spec, self._budget)

    def waiting(self, request_id: str) -> bool:
        """Still compiling (False once it ended, either way, or when it never started)."""
        f = self._waits.get(request_id)
        return f is not None and not f.done()

    def outcome(self, request_id: str) -> str | None:
        """None while compiling or when there was nothing to compile; "" when it compiled; else why it failed.
        The first call after it ended forgets it."""
        f = self._waits.get(request_id)
        if f is None or not f.done():
            return None
        del self._waits[request_id]
        error = f.exception()
        if error is None:
            return ""
        return str(error) if isinstance(error, KvfenceError) else f"{type(error).__name__}: {error}"

    def ended(self) -> list[str]:
        """The requests whose compile has ended (ask `outcome` for each)."""
        return [rid for rid, f in self._waits.items() if f.done()]

    def forget(self, request_id: str) -> None:
        """The request is gone: its compile (if any) finishes for the cache and is ignored."""
        self._waits.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._waits)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
