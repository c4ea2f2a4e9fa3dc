"""The deployment secret and the keys derived from it.

What it knows: a `ClusterKey` is 32 random bytes that every process of one deployment holds;
where a process finds it (in this order: `--cluster-key-file PATH`, the file named by
`$KVFENCE_CLUSTER_KEY_FILE`, the hex key in `$KVFENCE_CLUSTER_KEY`, which `kvfence serve` sets
for the processes it starts; else the process refuses to start unless `--insecure-no-auth` was
given); the key file format (the key as hex, 64 characters, whitespace ignored; a file others
can read is refused); and the purpose-bound keys every plane uses, each HMAC-SHA256(key,
"kvfence/v1/" + purpose), so no two planes ever share a key. The key's id (`key_id`, 12 hex
characters of another derived value) may be logged and shown: it lets an operator check that
every process holds the same key without revealing it.

What it does not know: how a plane uses its key (`auth.handshake`, `auth.curve`,
`integrity.manifest`). The secret never appears in `repr`, logs, /server_info or metrics.

It also knows where the front door's API key comes from (`api_key_from`: `--api-key`, else $KVFENCE_API_KEY), a
separate secret that clients hold; how a request proves it is `server.auth`'s.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.errors import KvfenceError

KEY_BYTES = 32
ENV_KEY = "KVFENCE_CLUSTER_KEY"  # the key itself, hex: how `kvfence serve` hands it to the processes it starts
ENV_KEY_FILE = "KVFENCE_CLUSTER_KEY_FILE"  # a file holding the key, for roles started by hand on several hosts
_INSECURE_SECRET = bytes(KEY_BYTES)  # --insecure-no-auth: every process "knows" it, so it proves nothing


class ClusterKeyError(KvfenceError):
    """No usable cluster key: missing, unreadable, malformed, or readable by others."""


@dataclass(frozen=True)
class ClusterKey:
    """The deployment secret. `secure` is False only for `--insecure-no-auth` (the all-zero key)."""

    secret: bytes = field(repr=False)
    secure: bool = True

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ClusterKeyError(f"a cluster key is {KEY_BYTES} bytes, got {len(self.secret)}")
        if self.secure and self.secret == _INSECURE_SECRET:
            raise ClusterKeyError("the all-zero key is the --insecure-no-auth key, not a secret")

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def insecure(cls) -> ClusterKey:
        """The key of `--insecure-no-auth`: the planes run the same protocol, but anyone can speak it."""
        return cls(_INSECURE_SECRET, secure=False)

    @classmethod
    def from_hex(cls, text: str, source: str) -> ClusterKey:
        digits = "".join(text.split())
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raise ClusterKeyError(f"{source}: a cluster key is {2 * KEY_BYTES} hex characters") from None
        if len(raw) != KEY_BYTES:
            raise ClusterKeyError(f"{source}: a cluster key is {2 * KEY_BYTES} hex characters, got {len(digits)}")
        return cls(raw)

    def to_hex(self) -> str:
        return self.secret.hex()

    def derive(self, purpose: str) -> bytes:
        """The 32-byte key of one purpose (a plane, a direction): HMAC-SHA256(secret, "kvfence/v1/" + purpose)."""
        return hmac.new(self.secret, b"kvfence/v1/" + purpose.encode(), hashlib.sha256).digest()

    @property
    def key_id(self) -> str:
        """12 hex characters naming this key (safe to log: it reveals nothing about the secret)."""
        return self.derive("key-id").hex()[:12]

    def describe(self) -> dict[str, object]:
        """What /server_info and start-up logs may say about the key."""
        return {"enabled": self.secure, "key_id": self.key_id if self.secure else None}


def read_key_file(path: str | Path) -> ClusterKey:
    """The key in `path` (hex); a file that others than its owner may read is refused, as ssh refuses keys."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as e:
        raise ClusterKeyError(f"cannot read the cluster key file {p}: {e.strerror or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterKeyError(f"cluster key file {p} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    return ClusterKey.from_hex(text, f"cluster key file {p}")


def write_key_file(path: str | Path, key: ClusterKey) -> None:
    """Write `key` to a new file readable by its owner only (refuses to overwrite an existing file)."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.to_hex() + "\n")


def load_cluster_key(key_file: str | None, insecure: bool, environ: Mapping[str, str] | None = None) -> ClusterKey:
    """The key this process runs with (see the module docstring for where it is looked for).

    Refuses (`ClusterKeyError`) when none is found and `insecure` is False, and when a key is found
    and `insecure` is also set (one of the two is a mistake)."""
    env = os.environ if environ is None else environ
    key: ClusterKey | None = None
    if key_file:
        key = read_key_file(key_file)
    elif env.get(ENV_KEY_FILE):
        key = read_key_file(env[ENV_KEY_FILE])
    elif env.get(ENV_KEY):
        key = ClusterKey.from_hex(env[ENV_KEY], f"${ENV_KEY}")
    if key is not None and insecure:
        raise ClusterKeyError("--insecure-no-auth was given together with a cluster key; drop one of them")
    if key is not None:
        return key
    if insecure:
        return ClusterKey.insecure()
    raise ClusterKeyError(
        "no cluster key: pass --cluster-key-file PATH (or set $KVFENCE_CLUSTER_KEY_FILE) with the same key on every "
        "process of the deployment (`kvfence cluster-key PATH` writes a new one), or --insecure-no-auth to run "
        "without authentication (anyone who can reach the worker ports can then forge KV handoffs)"
    )


INSECURE_WARNING = (
    "AUTHENTICATION IS OFF (--insecure-no-auth): any process that can reach this deployment's ports can register "
    "workers, read prompts and forge KV handoffs that verify. Never use this outside a test."
)


# -- the front door's key (clients -> router; the cluster key above is between kvfence's own processes) ---------

API_KEY_ENV = "KVFENCE_API_KEY"


def api_key_from(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The API key the server requires: `--api-key`, else $KVFENCE_API_KEY; None when neither is set."""
    env = os.environ if environ is None else environ
    key = flag if flag is not None else env.get(API_KEY_ENV)
    return key or None
