"""Transfer ids: the capability the router issues for one KV handoff, and what logs show of it.

What it knows: how a fresh id is drawn (128 random bits, hex; only the router draws them), the shape a well-formed
one has, and the short reference records and logs carry instead of the id. Plain Python, so the router draws ids
without importing the data plane (torch). What it does not know: frames, pages or transports
(`kvfence.transfer.base`).
"""

from __future__ import annotations

import hashlib
import secrets

TRANSFER_ID_HEX = 32  # 128 bits


def new_transfer_id() -> str:
    """A fresh transfer capability: 128 random bits, hex (only the router draws them)."""
    return secrets.token_hex(TRANSFER_ID_HEX // 2)


def is_transfer_id(value: object) -> bool:
    """Whether `value` has the shape of a transfer capability (so a malformed one is refused before use)."""
    return isinstance(value, str) and len(value) == TRANSFER_ID_HEX and all(c in "0123456789abcdef" for c in value)


def transfer_ref(transfer_id: str) -> str:
    """What records and logs show for a transfer: 16 hex characters of its id's SHA-256, never the id itself."""
    return hashlib.sha256(transfer_id.encode()).hexdigest()[:16] if transfer_id else ""
