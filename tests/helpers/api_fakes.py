"""A fake EngineClient and byte tokenizer for the HTTP API tests, and a server around them.

The fake generates a deterministic letter per step ("a".."z" from the prompt, the seed
and the step), or, when given a `script`, that text one character per step (finishing
with "stop" at its end, as a model's eos would), finds stop strings, attaches an integrity record to the last chunk and
records every generate/abort call, so tests can assert what reached the engine. When
asked for logprobs it scores each letter -0.5 (its prompt tokens -1.0), so response
shapes can be checked; it knows nothing of a model, and the real numbers are tested
against transformers elsewhere. Its own behaviour is checked in tests/test_api_fakes.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvfence.engine.engine_client import Capacity, GenerationChunk
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.token_logprobs import TokenLogprobs
from kvfence.server.api import ApiSettings, build_app
from kvfence.server.launch import ServerThread

MODEL = "fake-model"


class ByteTokenizer:
    """One token per UTF-8 byte; the chat template is `<tools>[names]\\n` when given tools, `<role>content\\n` per
    message, then `<assistant>`."""

    vocab_size = 256
    eos_token_ids = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        tools = extra.get("tools")
        text = f"<tools>{[t['function']['name'] for t in tools]}\n" if tools else ""
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def expected_text(prompt_ids: list[int], seed: int | None, max_tokens: int) -> str:
    """What FakeEngine generates without stop strings."""
    return "".join(chr(97 + (sum(prompt_ids) + (seed or 0) + i) % 26) for i in range(max_tokens))


class FakeEngine:
    model_name = MODEL

    def __init__(
        self,
        context_length: int = 256,
        pools: dict[str, int] | None = None,
        page_size: int = 4,
        delay: float = 0.0,
        integrity_status: str | None = "verified",
        fail_with: BaseException | None = None,
        error_finish: str | None = None,
        script: str | None = None,
    ) -> None:
        self._capacity = Capacity(context_length, dict(pools or {"aggregated": 1024}), page_size)
        self.delay = delay
        self.integrity_status = integrity_status
        self.fail_with = fail_with
        self.error_finish = error_finish  # finish every request with finish_reason "error" and this message
        self.script = script  # the text every request generates, one character per step
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()

    def capacity(self) -> Capacity:
        return self._capacity

    def _record(self, request_id: str, num_tokens: int) -> dict[str, Any] | None:
        if self.integrity_status is None:
            return None
        return {"status": self.integrity_status, "request_id": request_id, "tokens_covered": num_tokens}

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.calls.append((request_id, list(prompt_token_ids), params))
        self.active.add(request_id)
        try:
            if self.fail_with is not None:
                raise self.fail_with
            n = len(prompt_token_ids)
            if self.error_finish is not None:
                await asyncio.sleep(0)
                yield GenerationChunk(
                    [],
                    "",
                    True,
                    "error",
                    n,
                    0,
                    integrity={"status": "rejected", "reason": self.error_finish},
                    error=self.error_finish,
                    extra={"code": "kv_integrity_failed"},
                )
                return
            text, sent = "", 0
            k = params.logprobs or 0
            prompt_lps = None
            if params.prompt_logprobs is not None:
                prompt_lps = [None] + [TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in prompt_token_ids[1:]]
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay)
                if self.script is not None:
                    tok = ord(self.script[i])
                else:
                    tok = 97 + (sum(prompt_token_ids) + (params.seed or 0) + i) % 26
                text += chr(tok)
                finished, reason = i == params.max_tokens - 1, "length"
                if self.script is not None and i == len(self.script) - 1:
                    finished, reason = True, "stop"
                hits = [text.find(s) for s in params.stop if s in text]
                if hits:
                    text, finished, reason = text[: min(hits)], True, "stop"
                piece = text[sent:]
                sent = len(text)
                yield GenerationChunk(
                    [tok],
                    piece,
                    finished,
                    reason if finished else None,
                    n,
                    i + 1,
                    logprobs=None if params.logprobs is None else [TokenLogprobs(tok, -0.5, ((tok, -0.5),)[:k])],
                    prompt_logprobs=prompt_lps if i == 0 else None,
                    integrity=self._record(request_id, n + i + 1) if finished else None,
                )
                if finished:
                    return
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def server_info(self) -> dict[str, Any]:
        return {"mode": "fake", "context_length": self._capacity.context_length}

    def stats(self) -> dict[str, Any]:
        used = 2 * len(self.active)
        return {
            "roles": {"aggregated": {"pages_total": 64, "pages_used": used, "pages_free": 64 - used, "page_size": 4}},
            "num_running": len(self.active),
            "num_waiting": 0,
            "transfers": {"ok": 3, "failed": 1},
        }


def make_app(engine: FakeEngine, max_body_bytes: int = 4 * 1024 * 1024) -> Any:
    settings = ApiSettings(served_model_name=MODEL, max_body_bytes=max_body_bytes, vocab_size=256)
    return build_app(engine, ByteTokenizer(), settings)


def serve(engine: FakeEngine, **kwargs: Any) -> ServerThread:
    return ServerThread(make_app(engine, **kwargs)).start()
