"""The settings of the disaggregated router, as a frozen dataclass checked when made.

What it knows: the router's deadlines and timeouts (handoff, request, registration, worker liveness, heartbeat),
how many workers of each role it waits for, the context rule, the served model name and whether prefill's first
token streams before decode's verdict, with their defaults (which `kvfence.commands.args` shows as the flags'
defaults), and how long a worker that lost its router tries to register again. Plain Python, so the flag tables
import it without the router's own dependencies. What it does not know: what the router does with them
(`kvfence.disagg.router`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.disagg.config_checks import require_positive
from kvfence.errors import KvfenceError

RECONNECT_TIMEOUT_S = 60.0  # how long a worker that lost its router tries to register again (--reconnect-timeout-s)


@dataclass(frozen=True)
class RouterConfig:
    handoff_deadline_s: float = 60.0  # decode must have verified the KV this long after the order (flag)
    request_timeout_s: float = 300.0  # a request with no news from any worker for this long is failed (flag)
    register_timeout_s: float = 300.0  # how long to wait at start for the workers below
    worker_timeout_s: float = 10.0  # a worker silent this long is declared dead (flag)
    heartbeat_interval_s: float = 0.5  # router -> worker keepalive period
    suspect_after_s: float = 1.0  # a worker silent this long is routed to only when no other can take the request
    wait_prefill_workers: int = 1  # start serving once this many prefill workers registered (later ones join)
    wait_decode_workers: int = 1  # ... and this many decode workers
    allow_context_above_pool: bool = False
    model_name: str | None = None  # name served to clients; default: the workers' model name
    first_token_before_verdict: bool = True  # stream prefill's first token before decode's verdict (flag)
    prefix_affinity: bool = True  # a prompt goes back to the prefill worker that cached its prefix (workers.py)

    def __post_init__(self) -> None:
        for name in ("handoff_deadline_s", "request_timeout_s", "register_timeout_s", "suspect_after_s"):
            require_positive(self, name)
        if not self.worker_timeout_s > self.heartbeat_interval_s > 0:
            raise KvfenceError(
                f"router: need worker_timeout_s ({self.worker_timeout_s}) > heartbeat_interval_s "
                f"({self.heartbeat_interval_s}) > 0"
            )
        if self.wait_prefill_workers < 1 or self.wait_decode_workers < 1:
            raise KvfenceError(
                f"router: wait for at least one worker of each role (prefill {self.wait_prefill_workers}, "
                f"decode {self.wait_decode_workers})"
            )
