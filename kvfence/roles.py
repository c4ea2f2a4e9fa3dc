"""The roles a kvfence process can serve, named once.

What it knows: the role names (they travel on the wire in `Register.role`, key the
per-role numbers of /server_info and /metrics, and are the choices of `kvfence serve
--role`), which of them are engine workers that register with a router, and which one
runs prefill only. What it does not know: what any role does; it imports nothing.
"""

from __future__ import annotations

AGGREGATED = "aggregated"  # one process: engine and HTTP API
PREFILL = "prefill"  # disaggregated: computes the prompt's KV and hands it off
DECODE = "decode"  # disaggregated: verifies the handed-off KV and generates
ROUTER = "router"  # disaggregated: HTTP API and routing, no engine

ROLES: tuple[str, ...] = (AGGREGATED, PREFILL, DECODE, ROUTER)  # what `kvfence serve --role` accepts
WORKER_ROLES: tuple[str, ...] = (PREFILL, DECODE)  # engine processes that register with a router
DISAGG_ROLES: tuple[str, ...] = (PREFILL, DECODE, ROUTER)  # the processes of one disaggregated deployment
