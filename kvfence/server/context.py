"""What every endpoint of one API server shares: its settings, its engine and the helpers built around them.

What it knows: the server's settings (`ApiSettings`: served name, limits, logprobs mode, tool-call format,
grammar budget, API key), the `ServerContext` the endpoint modules receive (engine, prompts, generation,
grammar gate, metrics), and the two checks every generation request starts with: the model name (404 unless it
is the served one) and the request id (the client's `X-Request-Id`, as vLLM honours it, else a random one).
What it does not know: any endpoint's body or response.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kvfence.engine.engine_client import EngineClient
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.structured_output import GrammarBudget
from kvfence.server import openai_schema as p
from kvfence.server import sampling
from kvfence.server.generation import Generation
from kvfence.server.grammar_gate import GrammarGate
from kvfence.server.http import ApiError
from kvfence.server.metrics import Metrics
from kvfence.server.prompts import Prompts

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    vocab_size: int | None = None  # token ids in a prompt must be below this (the engine checks too)
    server_args: Mapping[str, Any] = field(default_factory=dict)  # resolved launch settings, for /server_info
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (vLLM's --logprobs-mode)
    tool_call_parser: str = "hermes"  # the format `tool_choice: auto` parses (tool_parsers.PARSERS)
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)
    api_key: str | None = field(default=None, repr=False)  # clients must send it as a Bearer token (auth.py)


@dataclass
class ServerContext:
    engine: EngineClient
    settings: ApiSettings
    prompts: Prompts
    generation: Generation
    grammar: GrammarGate
    metrics: Metrics

    def check_model(self, name: str) -> None:
        if name != self.settings.served_model_name:
            raise ApiError(
                404,
                f"The model {name[:200]!r} does not exist; this server serves {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def params(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        max_tokens: int,
        index: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: Any = sampling.FROM_REQUEST,
    ) -> SamplingParams:
        return sampling.params_for(
            req,
            max_tokens=max_tokens,
            index=index,
            logprobs_mode=self.settings.logprobs_mode,
            vocab_size=self.settings.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
        )


def request_id(request: Request) -> str:
    """The client's `X-Request-Id` (as vLLM honours it), else a random one; the response `id` carries it.

    Engine request ids are `<cmpl|chatcmpl|resp>-<this>-<choice index>`: fault specs and logs can select them."""
    rid = request.headers.get("x-request-id")
    if rid is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(rid):
        raise ApiError(400, "X-Request-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -", param="X-Request-Id")
    return rid
