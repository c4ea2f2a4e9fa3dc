"""What a data-plane endpoint (a sender or a receiver of KV) needs to authenticate: its keys and its event counter.

What it knows: the two keys the data plane derives from the cluster key (one for the connection
handshake and frame MACs, one for manifest MACs), how long a peer may take to answer the handshake,
how many connections may be authenticating at once, and the process's `SecurityEvents`.

What it does not know: sockets or frames (`auth.handshake`, `transfer.tcp`), or manifests
(`integrity.manifest.seal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.auth.events import SecurityEvents
from kvfence.auth.keys import ClusterKey


@dataclass(frozen=True)
class PlaneAuth:
    key: ClusterKey
    events: SecurityEvents = field(default_factory=SecurityEvents)
    handshake_timeout_s: float = 5.0  # a connection that has not proved the key by then is dropped
    max_pending_handshakes: int = 64  # connections still authenticating; more are refused at once
    data_key: bytes = field(init=False, repr=False)
    manifest_key: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_key", self.key.derive("data-plane"))
        object.__setattr__(self, "manifest_key", self.key.derive("manifest"))

    @property
    def secure(self) -> bool:
        return self.key.secure
