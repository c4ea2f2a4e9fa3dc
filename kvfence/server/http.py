"""HTTP plumbing of the API, independent of what is served: the OpenAI error object, the body's size cap,
strict JSON, schema errors that name the field, and the response encodings (JSON, SSE).

What it knows: how a request body may be malformed and which 4xx each case gets, how a pydantic error
becomes `{"error": {"message", "type", "param", "code"}}`, how kvfence's own exceptions map to HTTP
statuses. What it does not know: the endpoints, engines or sampling (the endpoint modules).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.errors import InvalidRequestError, KvfenceError, ServiceUnavailableError
from kvfence.server import openai_schema as p
from kvfence.server.metrics import Metrics

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/server_info",
)
_MODEL_PATH = "/v1/models/"


def endpoint_label(path: str) -> str:
    """The metrics label of a request path: one of ROUTES, "/v1/models/{model}", or "other" (a bounded set)."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith(_MODEL_PATH) else "other"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: Mapping[str, str] | None = None, extra: dict[str, Any] | None = None) -> JSONResponse:
        body = p.error_body(self.message, self.type, self.param, self.code)
        if extra:
            body.update(extra)
        return JSONResponse(body, status_code=self.status, headers=dict(headers or {}))


# ---- body: size cap, UTF-8, JSON, schema ---------------------------------------------------------------------------


class BodyLimitMiddleware:
    """Reads a request body up to `max_bytes` before the app sees it (413 beyond), and counts responses.

    The buffered body is replayed to the app once; later `receive()` calls go to the
    server, so a handler can still wait for the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope["path"])
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, counting_send)
            return
        too_large = ApiError(
            413, f"request body exceeds {self.max_bytes} bytes", param=None, code="request_too_large"
        ).response()
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes or declared < 0:
                    await too_large(scope, receive, counting_send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await too_large(scope, receive, counting_send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, counting_send)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8 JSON object; raises ApiError(400, code invalid_json) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    if not text.strip():
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
        # lone surrogates (\ud800) decode to a str that is not valid UTF-8: refuse them here
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise ApiError(400, "request body contains an unpaired UTF-16 surrogate escape", code="invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}
_UNION_HINTS = {
    "prompt": "must be a non-empty string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "must be a non-empty string or a list of at most 16 non-empty strings",
    "seed": "must be an integer in the signed 64-bit range or null",
}


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    top = loc[0] if loc else None
    # the path without pydantic's union-branch names ("str", "list[int]", ...)
    param = ".".join(x for x in loc if (x.isidentifier() or x.isdigit()) and x not in _TYPE_NAMES)
    if top in _UNION_HINTS and first["type"] not in ("missing",):
        message = f"{top}: {_UNION_HINTS[top]}"
    else:
        given = repr(first.get("input"))
        if len(given) > 80:
            given = given[:77] + "..."
        message = f"{param or 'body'}: {first['msg']}" + ("" if first["type"] == "missing" else f" (got {given})")
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    if first["type"] == "missing":
        code = "missing_required_parameter"
    return ApiError(400, message, param=param or None, code=code)


def parse_body(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def dump_model(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict without the optional kvfence/usage fields when they are empty."""
    d = model.model_dump(mode="json")
    for key in ("kvfence", "usage"):
        if d.get(key) is None:
            d.pop(key, None)
    for choice in d.get("choices", []):
        if choice.get("kvfence") is None:
            choice.pop("kvfence", None)
    return d


def sse_event(obj: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: `data: <compact JSON>`, after an `event: <name>` line when named (the Responses
    API names each event by its type, as OpenAI does)."""
    data = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
    return data if event is None else b"event: " + event.encode("ascii") + b"\n" + data


def to_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, ServiceUnavailableError):
        return ApiError(503, str(e), type="server_error", code=e.code)
    if isinstance(e, KvfenceError):
        return ApiError(500, str(e), type="server_error", code="engine_error")
    return ApiError(500, "internal server error; see the server log", type="server_error", code="internal_error")
