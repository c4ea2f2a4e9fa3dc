"""The control plane's ZeroMQ CURVE: encrypted, authenticated router <-> worker links that only key holders open.

What it knows: the two CURVE key pairs of a deployment, both derived from the cluster key (the
router's server pair and one client pair every worker uses), so nothing but the cluster key has to
be distributed; how to make the router's ROUTER socket a CURVE server whose ZAP authenticator
(pyzmq's `ThreadAuthenticator`) admits only the deployment's client key; how to make a worker's
DEALER socket a CURVE client; and how the router notices refused handshakes (a socket monitor's
handshake-failure events, counted as `control_handshake_failed` security events).

CURVE (CurveZMQ over Curve25519 + XSalsa20-Poly1305, libzmq's implementation) gives every link
mutual authentication, confidentiality and per-message integrity with fresh short-term keys per
connection, so recorded traffic replayed on a new connection fails the handshake and a stranger
can neither register a worker, take over a worker's id, nor read the prompts on the wire.

What it does not know: messages (`disagg.messages`) or what a worker may do once admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfence.auth.events import SecurityEvent, SecurityEvents
from kvfence.auth.keys import ClusterKey
from kvfence.errors import KvfenceError

logger = logging.getLogger(__name__)

_FAILED_EVENTS = ("EVENT_HANDSHAKE_FAILED_NO_DETAIL", "EVENT_HANDSHAKE_FAILED_PROTOCOL", "EVENT_HANDSHAKE_FAILED_AUTH")


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's CURVE keys (Z85-encoded, as libzmq takes them); never logged."""

    server_public: bytes = field(repr=False)
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_cluster_key(cls, key: ClusterKey) -> CurveKeys:
        import zmq
        from zmq.utils import z85

        if not zmq.has("curve"):
            raise KvfenceError("this pyzmq/libzmq build has no CURVE support; the control plane cannot be secured")
        server_secret = z85.encode(key.derive("control-plane/curve-server"))
        client_secret = z85.encode(key.derive("control-plane/curve-client"))
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def for_key(key: ClusterKey) -> CurveKeys | None:
    """The CURVE keys of a secure deployment; None under --insecure-no-auth (plain ZeroMQ links)."""
    return CurveKeys.from_cluster_key(key) if key.secure else None


class _AllowDeploymentClient:
    """ZAP credentials provider: admit the deployment's client key only."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._client_public


class CurveServer:
    """The router socket's CURVE side: its ZAP authenticator and the monitor that counts refused handshakes."""

    def __init__(self, ctx: Any, sock: Any, keys: CurveKeys, events: SecurityEvents) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        self.events = events
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvfence.auth.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowDeploymentClient(keys.client_public))
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        mask = 0
        for name in _FAILED_EVENTS:
            mask |= getattr(zmq, name)
        self.monitor = open_monitor(sock, mask)
        self._zmq = zmq

    def drain_monitor(self) -> None:
        """Count the handshake failures the monitor reported (call when `monitor` is readable)."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0, self._zmq.POLLIN):
            try:
                event = recv_monitor_message(self.monitor, self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                return
            self.events.record(
                SecurityEvent.CONTROL_HANDSHAKE_FAILED,
                f"control-plane connection from {event.get('endpoint', b'?')!r} refused (event {event.get('event')}, "
                f"value {event.get('value')}): not a holder of this deployment's cluster key",
            )

    def close(self) -> None:
        try:
            self.monitor.close(0)
        finally:
            self._auth.stop()


def open_monitor(sock: Any, events: int) -> Any:
    """A PAIR socket that receives `sock`'s `events` (libzmq's socket monitor) and never makes libzmq wait.

    libzmq's I/O thread sends each event while holding the lock that `disable_monitor` and closing the socket
    take, and it blocks there when the monitor's queue is full (a peer failing handshakes fast fills the default
    1,000 + 1,000 messages in seconds). pyzmq calls `zmq_socket_monitor` with the GIL held, so no Python thread
    can empty the queue meanwhile: the process freezes. A receive high-water mark of 0 on our end makes the
    inproc pipe unbounded, so the I/O thread never waits; whoever owns the socket drains it as it polls."""
    import uuid

    import zmq

    addr = f"inproc://kvfence-monitor-{uuid.uuid4().hex}"
    sock.monitor(addr, events)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)  # unbounded: the sender (libzmq's I/O thread) must never block
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(addr)
    return monitor


def stop_monitor(sock: Any, drain: Callable[[], object]) -> None:
    """Stop `sock`'s event monitor opened by `open_monitor`, first handing what it queued to `drain` (its owner's
    own drain, which counts the events). The monitor socket stays open: its owner closes it."""
    drain()
    sock.monitor(None, 0)


def make_client(sock: Any, keys: CurveKeys) -> None:
    """Make a worker's DEALER socket a CURVE client of the deployment's router (before it connects)."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
