"""The one body every generation endpoint runs, and the `Endpoint` interface each one fills in.

What it knows: the steps a generation request takes, in order: parse the body strictly (400 naming the field),
check the model name (404), take the request id, let the endpoint turn the body into choices (prompt, admission,
sampling parameters), compile their grammar within budget (grammar_gate.py), count the prompt tokens, and then
either stream (streaming.py with the endpoint's renderer) or run every choice to the end and answer with the
endpoint's body, or with the first failure's error (500 and every choice's integrity record). The integrity
header goes on both. What it does not know: any endpoint's shapes (completions.py, chat.py, responses.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from kvfence.engine.sampling_params import StructuredOutputs
from kvfence.server.choice import Choice, count_prompt_tokens, failure, integrity_header, integrity_records
from kvfence.server.context import ServerContext, request_id
from kvfence.server.http import parse_body, parse_json_object
from kvfence.server.streaming import StreamRenderer, stream_response


class Prepared(NamedTuple):
    """A request made ready to run: its choices, and the grammar they share (checked before they run)."""

    choices: list[Choice]
    grammar: StructuredOutputs | None = None
    grammar_param: str = "response_format"  # the field the grammar came from, for its errors
    plan: Any = None  # what else the endpoint decided and renders by (chat: its ToolPlan)


class Endpoint(Protocol):
    @property
    def request_model(self) -> type[BaseModel]: ...

    @property
    def id_prefix(self) -> str:
        """ "cmpl", "chatcmpl", "resp": response ids are "<prefix>-<request id>"."""
        ...

    async def prepare(self, req: Any, base_id: str) -> Prepared: ...

    def streams(self, req: Any) -> bool: ...

    def renderer(self, req: Any, base_id: str, prepared: Prepared) -> StreamRenderer: ...

    def response(self, req: Any, base_id: str, prepared: Prepared) -> dict[str, Any]: ...


async def serve_generation(ctx: ServerContext, endpoint: Endpoint, request: Request) -> Response:
    req = parse_body(endpoint.request_model, parse_json_object(await request.body()))
    ctx.check_model(req.model)
    base_id = f"{endpoint.id_prefix}-{request_id(request)}"
    prepared = await endpoint.prepare(req, base_id)
    await ctx.grammar.check(prepared.grammar, prepared.grammar_param)
    choices = prepared.choices
    ctx.metrics.prompt_tokens.inc(count_prompt_tokens(choices))
    if endpoint.streams(req):
        renderer = endpoint.renderer(req, base_id, prepared)
        return await stream_response(ctx.generation.events(choices), choices, renderer)
    await ctx.generation.run_to_end(request, choices)
    headers = integrity_header(choices)
    if (err := failure(choices)) is not None:
        return err.response(headers, integrity_records(choices))
    return JSONResponse(endpoint.response(req, base_id, prepared), headers=headers)
