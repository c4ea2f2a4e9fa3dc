"""What a serving process says when it starts: one line with everything it chose.

What it knows: the fields an operator checks first (model and where it came from, dtype, kernels, context
length, KV pool in pages and tokens, page size, the ports, whether an API key is required) and how to read them
from a role's `server_info()` dict (an engine's or the router's, whichever keys it has); the line printed before
a model loads, so a start that takes a while (a big model, a first native-kernel build) is not silent. What it
does not know: how the values were resolved, or where the line goes (the caller prints it to stderr).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def engine_info(engine: Any, model_name: str, context_length: int) -> dict[str, Any]:
    """The start-up fields of one role's `LLMEngine` (a prefill or decode worker's; the aggregated server's
    `server_info()` has the same keys)."""
    r = engine.resolved
    return {
        "model_name": model_name,
        "architecture": getattr(engine.loaded, "architecture", None),
        "model_dir": engine.config.model.model_dir,
        "dtype": engine.config.model.dtype,
        "kernels": r.kernels,
        "context_length": context_length,
        "num_pages": r.num_pages,
        "max_total_tokens": {"pool": r.pool_tokens},
        "page_size": r.page_size,
    }


def loading_line(role: str, model_dir: str) -> str:
    return f"kvfence {role}: loading {model_dir}"


def _pools(info: Mapping[str, Any]) -> str:
    pools = info.get("max_total_tokens") or {}
    num_pages = info.get("num_pages")
    if len(pools) == 1 and num_pages is not None:
        (tokens,) = pools.values()
        return f"KV pool {num_pages} pages = {tokens} tokens"
    if pools:
        return "KV pools " + ", ".join(f"{role} {tokens} tokens" for role, tokens in pools.items())
    return "KV pool unknown"


def startup_line(
    role: str,
    info: Mapping[str, Any],
    ports: Mapping[str, str],
    api_key_required: bool | None,
    cluster_auth: str | None = None,
) -> str:
    """One line: `kvfence <role>: model ..., dtype ..., kernels ..., context N tokens, KV pool ..., page size
    P, api key required|off, cluster auth ..., <port name> <address>...` (fields the role does not have are left
    out; the ports last, so the line ends with the address the caller lists last, e.g. `serving http://...`)."""
    parts: list[str] = []
    model = info.get("model_name") or info.get("served_model_name")
    if model is not None:
        where = [str(x) for x in (info.get("architecture"), info.get("model_dir")) if x]
        parts.append(f"model {model}" + (f" ({', '.join(where)})" if where else ""))
    for key, label in (("dtype", "dtype"), ("kernels", "kernels")):
        if info.get(key) is not None:
            parts.append(f"{label} {info[key]}")
    if info.get("context_length") is not None:
        parts.append(f"context {info['context_length']} tokens")
    parts.append(_pools(info))
    if info.get("page_size") is not None:
        parts.append(f"page size {info['page_size']}")
    if api_key_required is not None:
        parts.append("api key required" if api_key_required else "api key off")
    if cluster_auth is not None:
        parts.append(cluster_auth)
    parts += [f"{name} {address}" for name, address in ports.items()]
    return f"kvfence {role}: " + ", ".join(parts)
