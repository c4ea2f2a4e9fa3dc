"""Mooncake Transfer Engine backend: the extension point, not yet an implementation.

What it knows: how a Mooncake backend would plug in. It must provide the `Sender` /
`Receiver` protocols of `transfer.base` and reuse its cores:

- `MooncakeReceiver` registers the decode pool's tensors with the engine, keeps a
  `ReceiverCore(pool, one_sided=True)` (Mooncake writes straight into decode memory,
  so a closed slot is settled only when prefill confirms it stopped, the connection
  drops or the quarantine deadline passes), and marks coverage from prefill's
  per-chunk completion notices, which name logical indices.
- `MooncakeSender` maps each logical page to (src address, dst address, length) per
  (layer, buffer) slice using the page table decode sends back on `expect`, and submits
  `batch_transfer_sync` batches of at most `max_transfer_pages` pages (Mooncake's TCP
  lane refuses batches above ~1,024 entries with "TCP lane queue-full", so chunk).
- Manifest, done/abort/verdict frames still travel over the TCP control link of
  `transfer.tcp`; only page bytes move through Mooncake.

What it does not know yet: the implementation. Constructing either class raises a
`KvfenceError` saying why; use `transfer.tcp` meanwhile.
"""

from __future__ import annotations

from typing import Any

from kvfence.errors import KvfenceError


def mooncake_unavailable_reason() -> str | None:
    """None when the `mooncake` package imports; else why it does not."""
    try:
        import mooncake  # noqa: F401
    except ImportError as e:
        return f"the 'mooncake' package does not import ({e}); install mooncake-transfer-engine"
    return None


class _MooncakeBackend:
    role = "backend"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        reason = mooncake_unavailable_reason() or "the kvfence Mooncake backend is not implemented yet; use tcp"
        raise KvfenceError(f"Mooncake backend not available: {reason}")


class MooncakeSender(_MooncakeBackend):
    role = "sender"


class MooncakeReceiver(_MooncakeBackend):
    role = "receiver"
