"""Keys for tests that build transports or workers by hand: one `PlaneAuth` per test (a fresh cluster key), shared
by the sender and the receiver of that test, and fresh transfer ids, as the router would issue them."""

from __future__ import annotations

from typing import Any

from kvfence.auth.keys import ClusterKey
from kvfence.auth.plane import PlaneAuth
from kvfence.transfer.base import new_transfer_id


def plane_auth(key: ClusterKey | None = None) -> PlaneAuth:
    """A data-plane auth object for `key` (default: a fresh random key)."""
    return PlaneAuth(key if key is not None else ClusterKey.generate())


def xid() -> str:
    """A transfer capability, as the router draws one per request."""
    return new_transfer_id()


def cap(request_id: str) -> str:
    """A fixed transfer capability per request id, for tests that build both handoff sides by hand (the router
    would draw a random one; these tests are about the handoff, not the secrecy of its id)."""
    import hashlib

    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def sealed(manifest: object, auth: PlaneAuth) -> bytes:
    """A manifest's bytes as prefill puts them on the wire: sealed with `auth`'s manifest key."""
    from kvfence.integrity.manifest import seal

    return seal(manifest.to_bytes(), auth.manifest_key)  # type: ignore[attr-defined]


# -- a cluster key for tests that start worker processes by hand ---------------------------------------------------

TEST_KEY = ClusterKey.generate()  # one per test process: its workers and its hubs share it


def secure_hub(host: str = "127.0.0.1", port: int = 0) -> Any:
    """A router hub (CURVE server) that admits the workers started with `worker_env()`."""
    from kvfence.auth.curve import CurveKeys
    from kvfence.disagg.messages import ZmqHub

    return ZmqHub(host, port, curve=CurveKeys.from_cluster_key(TEST_KEY))


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker process started by hand: the test's cluster key, as `kvfence serve` hands it."""
    import os

    from kvfence.auth.keys import ENV_KEY

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_CLUSTER_KEY")}
    return {**env, ENV_KEY: TEST_KEY.to_hex(), **(extra or {})}
