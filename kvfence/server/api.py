"""The OpenAI-compatible HTTP API in front of an `EngineClient` (aggregated engine or PD router): its routes.

What it knows: the route table and what serves each route, the exception handlers that turn every failure into
the OpenAI error shape, the middleware (the API key at the door, then the body cap), the info endpoints, and the
OpenAPI document. Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (completions.py, chat.py,
responses.py, all through endpoint.py's one body), POST /tokenize and /detokenize (tokenization.py), GET
/v1/models and /v1/models/{id}, /health, /metrics and /server_info (here). docs/api.md is the reference.

Errors (always `{"error": {"message", "type", "param", "code"}}`):
  401 invalid_api_key        the server has an API key and the request did not send it (auth.py)
  413 request_too_large      body over `max_body_bytes`, checked while reading, before parsing
  400 invalid_json           not UTF-8, not JSON, NaN/Infinity, nested too deep, not an object
  400 invalid_type/_value    a field has the wrong type or is out of range (param names the field)
  400 unsupported_value      a field kvfence does not implement has a non-default value
  400 context_length_exceeded prompt (+ max_tokens) over the context length or a role's KV pool
  400 grammar_too_complex    a response_format / forced tool call whose grammar is over the compile budget
  404 model_not_found        `model` is not the served model name
  404/405                    unknown path / method
  500 server_error           a generation failed (message from the engine; integrity record attached)
                             or an unexpected exception (logged with its traceback)
  503                        no healthy worker, or no grammar compile slot came free in time

What it does not know: scheduling, KV pages or transfers (all behind `EngineClient`), how a prompt is made or a
response shaped (the endpoint modules), nor how the server process is started (launch.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from kvfence.engine.engine_client import EngineClient
from kvfence.engine.sampling_params import MAX_LOGPROBS
from kvfence.engine.structured_output import GrammarCompiler
from kvfence.errors import KvfenceError
from kvfence.server import openai_schema as p
from kvfence.server.auth import ApiKeyMiddleware
from kvfence.server.chat import ChatEndpoint
from kvfence.server.completions import CompletionsEndpoint
from kvfence.server.context import DEFAULT_MAX_BODY_BYTES, ApiSettings, ServerContext
from kvfence.server.endpoint import serve_generation
from kvfence.server.generation import Generation
from kvfence.server.grammar_gate import GrammarGate
from kvfence.server.http import ApiError, BodyLimitMiddleware, parse_json_object, to_api_error
from kvfence.server.metrics import CONTENT_TYPE, Metrics
from kvfence.server.prompts import Prompts, Tokenizer
from kvfence.server.responses import ResponsesEndpoint
from kvfence.server.responses_schema import ResponsesRequest
from kvfence.server.tokenization import DetokenizeRequest, Tokenization, TokenizeChatRequest, TokenizePromptRequest

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ApiSettings", "build_app"]

logger = logging.getLogger(__name__)
_SECRET_FLAGS = ("--api-key",)


def redacted_argv(argv: list[str]) -> list[str]:
    """The command line with secret flags' values replaced (what /server_info may show)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg in _SECRET_FLAGS:
            out.append(arg)
            hide_next = True
        elif arg.startswith(tuple(f + "=" for f in _SECRET_FLAGS)):
            out.append(arg.split("=", 1)[0] + "=<redacted>")
        else:
            out.append(arg)
    return out


class Info:
    """The endpoints that describe the server: models, health, server_info."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.started = time.time()

    def _card(self) -> p.ModelCard:
        cap = self.ctx.engine.capacity()
        name = self.ctx.settings.served_model_name
        return p.ModelCard(id=name, created=int(self.started), max_model_len=cap.context_length)

    def models(self) -> dict[str, Any]:
        return p.ModelList(data=[self._card()]).model_dump()

    def model(self, model_id: str) -> dict[str, Any]:
        self.ctx.check_model(model_id)
        return self._card().model_dump()

    def server_info(self) -> dict[str, Any]:
        from kvfence import __version__

        settings = self.ctx.settings
        cap = self.ctx.engine.capacity()
        budget = settings.grammar_budget
        return {
            "version": __version__,
            "served_model_name": settings.served_model_name,
            "launch_command": redacted_argv(list(sys.argv)),
            "server_args": {k: v for k, v in settings.server_args.items() if k != "api_key"},
            "capacity": {
                "context_length": cap.context_length,
                "max_total_tokens": dict(cap.max_total_tokens),
                "page_size": cap.page_size,
                "max_request_tokens": cap.max_request_tokens,
            },
            "api": {
                "max_body_bytes": settings.max_body_bytes,
                "max_n": p.MAX_N,
                "max_stop": p.MAX_STOP,
                "max_prompts": p.MAX_PROMPTS,
                "vocab_size": settings.vocab_size,
                "max_logprobs": MAX_LOGPROBS,
                "logprobs_mode": settings.logprobs_mode,
                "tool_call_parser": settings.tool_call_parser,
                "max_grammar_bytes": budget.max_grammar_bytes,
                "grammar_compile_timeout_s": budget.compile_timeout_s,
                "api_key_required": settings.api_key is not None,
            },
            "engine": self.ctx.engine.server_info(),
            "stats": self.ctx.engine.stats(),
            "started_at": self.started,
        }

    def health(self) -> Response:
        engine = self.ctx.engine
        check = getattr(engine, "check_health", None)
        try:
            if check is not None:
                check()
            engine.stats()
        except Exception as e:
            return JSONResponse(
                p.error_body(f"engine unhealthy: {e}", "server_error", code="unhealthy"), status_code=503
            )
        return JSONResponse({"status": "ok"})


# ---- the app -------------------------------------------------------------------------------------------------------

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": p.ErrorResponse, "description": "Invalid request"},
    401: {"model": p.ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    413: {"model": p.ErrorResponse, "description": "Body too large"},
    500: {"model": p.ErrorResponse, "description": "Generation failed"},
}


def _body_spec(*names: str) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _metrics_registry(engine: EngineClient) -> Any:
    """The registry an EngineClient exposes for /metrics, if any (`metrics_registry`, or the router's
    `integrity_metrics.registry`)."""
    return getattr(engine, "metrics_registry", None) or getattr(
        getattr(engine, "integrity_metrics", None), "registry", None
    )


def build_app(
    engine: EngineClient,
    tokenizer: Tokenizer,
    settings: ApiSettings,
    grammar_compiler: Callable[[], GrammarCompiler] | None = None,
) -> FastAPI:
    """The FastAPI app for one EngineClient; every app has its own metrics registry. `grammar_compiler`: the
    engine's own, when it runs in this process (its step loop then finds the grammars compiled here cached)."""
    extra = _metrics_registry(engine)
    metrics = Metrics(engine.stats, [extra] if extra is not None else [], settings.served_model_name)
    ctx = ServerContext(
        engine=engine,
        settings=settings,
        prompts=Prompts(tokenizer, settings.vocab_size),
        generation=Generation(engine, metrics),
        grammar=GrammarGate(tokenizer, settings.vocab_size, settings.grammar_budget, grammar_compiler),
        metrics=metrics,
    )
    info = Info(ctx)
    completions_endpoint, chat_endpoint = CompletionsEndpoint(ctx), ChatEndpoint(ctx)
    responses_endpoint, tokenization = ResponsesEndpoint(ctx), Tokenization(ctx)
    app = FastAPI(title="kvfence", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.context = ctx

    def observe_rejection(e: ApiError) -> None:
        metrics.rejected.labels(e.code or str(e.status)).inc()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> Response:
        observe_rejection(e)
        return e.response()

    @app.exception_handler(KvfenceError)
    async def _kvfence_error(_: Request, e: KvfenceError) -> Response:
        api = to_api_error(e)
        if api.status >= 500:
            logger.error("request failed: %s", e)
        observe_rejection(api)
        return api.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return ApiError(e.status_code, str(e.detail), code=code).response(e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        return to_api_error(e).response()

    responses = dict(_ERROR_RESPONSES)

    @app.post(
        "/v1/completions",
        openapi_extra=_body_spec("CompletionRequest"),
        responses={200: {"model": p.CompletionResponse}, **responses},
    )
    async def completions(request: Request) -> Response:
        return await serve_generation(ctx, completions_endpoint, request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_body_spec("ChatCompletionRequest"),
        responses={200: {"model": p.ChatCompletionResponse}, **responses},
    )
    async def chat_completions(request: Request) -> Response:
        return await serve_generation(ctx, chat_endpoint, request)

    @app.post("/v1/responses", openapi_extra=_body_spec("ResponsesRequest"), responses=responses)
    async def create_response(request: Request) -> Response:
        return await serve_generation(ctx, responses_endpoint, request)

    @app.post(
        "/tokenize", openapi_extra=_body_spec("TokenizePromptRequest", "TokenizeChatRequest"), responses=responses
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        return await tokenization.tokenize(parse_json_object(await request.body()))

    @app.post("/detokenize", openapi_extra=_body_spec("DetokenizeRequest"), responses=responses)
    async def detokenize(request: Request) -> dict[str, Any]:
        return await tokenization.detokenize(parse_json_object(await request.body()))

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> dict[str, Any]:
        return info.models()

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses=responses)
    async def model(model_id: str) -> dict[str, Any]:
        return info.model(model_id)

    @app.get("/health")
    async def health() -> Response:
        return info.health()

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return info.server_info()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [
                    (p.CompletionRequest, "validation"),
                    (p.ChatCompletionRequest, "validation"),
                    (ResponsesRequest, "validation"),
                    (TokenizePromptRequest, "validation"),
                    (TokenizeChatRequest, "validation"),
                    (DetokenizeRequest, "validation"),
                ],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, metrics=metrics)
    if settings.api_key is not None:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, metrics=metrics)
    return app
