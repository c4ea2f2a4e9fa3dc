"""The front door's API key: OpenAI-style `Authorization: Bearer <key>` on every path but /health and /metrics.

What it knows: where the key comes from (`--api-key`, else the environment variable KVFENCE_API_KEY; an empty
value is no key), how a request proves it (the Bearer token, compared in constant time over SHA-256 digests of
both sides, so neither the key's bytes nor its length leak through timing), what a refusal looks like (401 with
the OpenAI error body, code `invalid_api_key`, and `WWW-Authenticate: Bearer`; the token sent is never echoed or
logged), and which paths stay open, as in vLLM: /health (for load balancers) and /metrics (for Prometheus; put
it behind the network if its numbers are sensitive). It runs before the body is read, so an unauthenticated
client cannot make the server buffer a body. What it does not know: the routes behind it.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvfence.server.http import ApiError, endpoint_label
from kvfence.server.metrics import Metrics

OPEN_PATHS = frozenset({"/health", "/metrics"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self._expected = _digest(api_key.encode("utf-8"))

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), self._expected):
                    return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        present = any(name == b"authorization" for name, _ in scope.get("headers", []))
        message = (
            "Incorrect API key provided; send it as 'Authorization: Bearer <key>'"
            if present
            else "Missing API key; send it as 'Authorization: Bearer <key>'"
        )
        self.metrics.requests.labels(endpoint_label(scope["path"]), "401").inc()
        self.metrics.rejected.labels("invalid_api_key").inc()
        response = ApiError(401, message, code="invalid_api_key").response({"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
