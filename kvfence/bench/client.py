"""One OpenAI-compatible request, timed on the client: the shared piece of `bench serve` and `bench soak`.

What it knows: how to send a /v1/completions request (streamed or not) with httpx,
read its server-sent events, and record what a client can observe of it: the HTTP
status and error code, when each token event arrived (TTFT, inter-token gaps, end to
end latency), how many tokens came back (the server's `usage` when it sends one, else
the number of token events), the finish reason, and kvfence's integrity record when
the response carries one. It can also close a stream on purpose after k token events
(a client abort). Also: the loopback check every tool here applies before sending
anything, and small readers for /server_info, /v1/models and Prometheus text.

What it does not know: what to send, when, or what the numbers mean; `serve.py` and
`soak.py` decide that.

A "token event" is a stream chunk whose choice has non-empty text, or no finish reason
yet (a token whose bytes are an incomplete UTF-8 character arrives with empty text but
is still a token); the closing chunk that only carries a finish reason is not one.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

INTEGRITY_FAILURES = ("rejected", "failed")  # statuses of kvfence.integrity.record that mean a bad handoff


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds from `perf_counter`, relative to `sent_at`."""

    kind: str  # caller's label: "bench", "normal", "overlength", "abort", ...
    prompt_len: int  # tokens sent (token-id prompts) or the server's usage.prompt_tokens for text prompts
    max_tokens: int
    sent_at: float = 0.0  # perf_counter() when the request was sent
    status: int | None = None  # HTTP status; None when no response arrived (connection error, timeout)
    error_code: str | None = None  # error.code of the body / SSE error event, or the exception class name
    error_message: str = ""
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None  # usage.prompt_tokens, when the server sent usage
    finish_reason: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive token events
    latency: float | None = None  # send -> last byte of the response
    integrity: dict[str, Any] | None = None
    aborted: bool = False  # the client closed the stream on purpose
    completed_stream: bool = False  # saw `data: [DONE]` (streams) or a full JSON body

    @property
    def ok(self) -> bool:
        """A 200 whose body ended normally (no error event, no transport error)."""
        return self.status == 200 and self.error_code is None and (self.completed_stream or self.aborted)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (latency - ttft) / (output_tokens - 1)."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def integrity_status(self) -> str | None:
        return None if self.integrity is None else str(self.integrity.get("status"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


# ---- where we may send -----------------------------------------------------------------------------------------


def is_loopback_url(url: str) -> bool:
    """True when every address the URL's host resolves to is a loopback address."""
    host = urlsplit(url).hostname
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_target(url: str, allow_remote: bool) -> str:
    """The URL without a trailing slash; raises ValueError for a non-http(s) or (unless allowed) remote target."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) base URL such as http://127.0.0.1:8000")
    if not allow_remote and not is_loopback_url(url):
        raise ValueError(
            f"{url!r} is not a loopback address; pass --i-am-authorised to load a server you are authorised to test"
        )
    return url.rstrip("/")


# ---- one request -----------------------------------------------------------------------------------------------


def _error_of(body: bytes) -> tuple[str | None, str]:
    try:
        err = json.loads(body).get("error") or {}
        return (str(err.get("code")) if err.get("code") is not None else None), str(err.get("message", ""))[:300]
    except (ValueError, AttributeError):
        return None, body[:300].decode("utf-8", "replace")


def _error_integrity(body: bytes) -> dict[str, Any] | None:
    """The integrity record kvfence attaches to a failed generation: {"kvfence": {"integrity": [record, ...]}}."""
    try:
        records = (json.loads(body).get("kvfence") or {}).get("integrity")
    except (ValueError, AttributeError):
        return None
    if isinstance(records, dict):
        return records
    if isinstance(records, list):
        return next((r for r in records if isinstance(r, dict)), None)
    return None


def _take_integrity(result: RequestResult, obj: dict[str, Any], choice: dict[str, Any] | None) -> None:
    for holder in (choice or {}, obj):
        record = (holder.get("kvfence") or {}).get("integrity")
        if isinstance(record, list):  # an error body or error event: one record per choice
            record = next((r for r in record if isinstance(r, dict)), None)
        if isinstance(record, dict):
            result.integrity = record
            return


async def send_completion(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    *,
    kind: str,
    prompt_len: int,
    abort_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST /v1/completions with `body`; streams when body["stream"] is true. Never raises for HTTP/network errors.

    `abort_after`: close the stream after this many token events (a client that goes away).
    """
    result = RequestResult(kind=kind, prompt_len=prompt_len, max_tokens=int(body.get("max_tokens", 16)))
    stream = bool(body.get("stream"))
    t0 = result.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                result.error_code, result.error_message = _error_of(raw)
                result.integrity = _error_integrity(raw)
                result.error_code = result.error_code or f"http_{resp.status_code}"
                result.latency = time.perf_counter() - t0
                return result
            if not stream:
                raw = await resp.aread()
                result.latency = time.perf_counter() - t0
                _read_json_body(result, raw)
                return result
            await _read_stream(resp, result, t0, abort_after)
    except httpx.HTTPError as e:
        result.error_code = type(e).__name__
        result.error_message = str(e)[:300]
    if result.latency is None:
        result.latency = time.perf_counter() - t0
    return result


def _read_json_body(result: RequestResult, raw: bytes) -> None:
    try:
        obj = json.loads(raw)
    except ValueError:
        result.error_code, result.error_message = "invalid_response", raw[:300].decode("utf-8", "replace")
        return
    choice = (obj.get("choices") or [None])[0]
    usage = obj.get("usage") or {}
    result.output_tokens = int(usage.get("completion_tokens", 0))
    if "prompt_tokens" in usage:
        result.prompt_tokens_reported = int(usage["prompt_tokens"])
    if choice is not None:
        result.finish_reason = choice.get("finish_reason")
    _take_integrity(result, obj, choice)
    result.ttft = result.latency  # a non-streamed response arrives all at once
    result.completed_stream = True


async def _read_stream(resp: httpx.Response, result: RequestResult, t0: float, abort_after: int | None) -> None:
    events = 0
    last: float | None = None
    usage_tokens: int | None = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            result.completed_stream = True
            result.latency = now - t0
            break
        try:
            obj = json.loads(data)
        except ValueError:
            result.error_code, result.error_message = "invalid_event", data[:300]
            continue
        if "error" in obj:  # the server failed after the 200 went out
            err = obj["error"] or {}
            result.error_code = str(err.get("code") or err.get("type") or "stream_error")
            result.error_message = str(err.get("message", ""))[:300]
            _take_integrity(result, obj, None)
            continue
        usage = obj.get("usage")
        if usage:
            usage_tokens = int(usage.get("completion_tokens", 0))
            if "prompt_tokens" in usage:
                result.prompt_tokens_reported = int(usage["prompt_tokens"])
        for choice in obj.get("choices") or []:
            _take_integrity(result, obj, choice)
            if choice.get("finish_reason") is not None:
                result.finish_reason = choice["finish_reason"]
            if choice.get("text") or choice.get("finish_reason") is None:
                events += 1
                if last is None:
                    result.ttft = now - t0
                else:
                    result.itl.append(now - last)
                last = now
        if abort_after is not None and events >= abort_after and not result.completed_stream:
            result.aborted = True
            result.latency = now - t0
            break  # leaving the `async with` closes the connection mid-stream
    result.output_tokens = usage_tokens if usage_tokens is not None else events


# ---- reading server state --------------------------------------------------------------------------------------


async def get_json(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """GET url as a JSON object, or None when it is missing, not JSON, or unreachable."""
    try:
        resp = await client.get(url, timeout=timeout)
        if resp.status_code != 200:
            return None
        obj = resp.json()
        return obj if isinstance(obj, dict) else None
    except (httpx.HTTPError, ValueError):
        return None


async def get_text(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> str | None:
    try:
        resp = await client.get(url, timeout=timeout)
        return resp.text if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(metric name, sorted label pairs): value} from Prometheus text format (comments skipped)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        labels: tuple[tuple[str, str], ...] = ()
        name = name_labels
        if "{" in name_labels:
            name, _, rest = name_labels.partition("{")
            pairs = []
            for part in rest.rstrip("}").split(","):
                if "=" in part:
                    k, _, v = part.partition("=")
                    pairs.append((k.strip(), v.strip().strip('"')))
            labels = tuple(sorted(pairs))
        try:
            out[(name, labels)] = float(value)
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class ServerFacts:
    """What a benchmark needs to know about a target, read from its info endpoints."""

    model: str
    context_length: int | None
    max_request_tokens: int | None  # prompt + max_tokens limit across roles (kvfence /server_info)
    vocab_size: int | None
    server_info: dict[str, Any] | None


async def read_server_facts(client: httpx.AsyncClient, base_url: str, model: str | None = None) -> ServerFacts:
    """Model name from /v1/models (unless given), limits from /server_info when the server has one."""
    models = await get_json(client, f"{base_url}/v1/models")
    cards = (models or {}).get("data") or []
    info = await get_json(client, f"{base_url}/server_info")
    if model is None:
        if not cards:
            raise ValueError(f"{base_url}/v1/models lists no model; pass --model-name")
        model = str(cards[0]["id"])
    card: dict[str, Any] = next((c for c in cards if c.get("id") == model), {})
    cap = (info or {}).get("capacity") or {}
    api = (info or {}).get("api") or {}
    context = cap.get("context_length") or card.get("max_model_len")
    return ServerFacts(
        model=model,
        context_length=int(context) if context else None,
        max_request_tokens=int(cap["max_request_tokens"]) if cap.get("max_request_tokens") else None,
        vocab_size=int(api["vocab_size"]) if api.get("vocab_size") else None,
        server_info=info,
    )
