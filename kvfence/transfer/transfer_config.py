"""Which transfer backends exist and the bounds of a sender, as plain values.

What it knows: the backend names `--transfer-backend` chooses from and `TransferConfig`, the sender-side bounds and
deadlines, checked when made. Plain Python, so the flag tables (`kvfence.commands.args`) and the processes that only
parse flags (the launcher, the router) read the defaults without importing the data plane (torch). What it does
not know: how a transfer runs (`kvfence.transfer.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.errors import KvfenceError

# The transfer backends (`--transfer-backend`): how page bytes reach decode. "local" is threads and queues in one
# process (tests only, no flag).
TRANSFER_BACKENDS = ("tcp", "mooncake", "local")


@dataclass(frozen=True)
class TransferConfig:
    """Sender-side bounds (invariant 7, docs/handoff.md) and deadlines."""

    max_transfer_pages: int = 64  # pages per chunk frame
    max_inflight_bytes: int = 64 << 20  # bytes sent but not yet acknowledged by the receiver
    send_timeout_s: float = 30.0  # the whole send (manifest to last frame)
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 10.0  # a socket that moves no byte for this long in the middle of a frame is dropped

    def __post_init__(self) -> None:
        for name in ("max_transfer_pages", "max_inflight_bytes", "send_timeout_s", "connect_timeout_s", "io_timeout_s"):
            value = getattr(self, name)
            if not value > 0:  # explicit, not assert: these come from CLI flags and `python -O` drops asserts
                raise KvfenceError(f"transfer: {name} must be > 0, got {value!r}")
