"""The handoff manifest: what prefill claims to have sent for one request.

What it knows: the request id and transfer id, the number of prompt tokens and
their hash as prefill saw them, the KV layout (fingerprint and full description),
the page count, one digest and one canary per page in logical order, the
digest algorithm, and (optionally) the first token prefill sampled with its scores,
so decode can start as soon as the pages verify, without waiting for the router's
relay. It encodes to compact JSON bytes (digests and canaries packed as
little-endian uint64 in base64; no pickle) with a version field, and refuses to
decode anything it does not fully understand.

On the wire a manifest is sealed (`seal`): a 32-byte HMAC-SHA256 tag under the cluster key's
manifest key, over the exact manifest bytes (request id, transfer id, token count and hash,
layout, every page digest and canary), followed by those bytes. Decode opens it (`unseal`)
before it parses a byte of it or touches the request's slot: a party without the key cannot
produce a manifest that verifies, nor alter one (docs/handoff.md, "Trust model").

What it does not know: whether any of it is true. Decode checks every field against
its own expectation (from the router) and its own layout in `integrity.verify`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector
from kvfence.integrity.canary import CANARY_SAMPLES, compute_canaries
from kvfence.integrity.digest import DIGEST_ALGORITHM, digest_algorithm_for, page_digests, token_hash
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool
from kvfence.math_utils import cdiv

MANIFEST_VERSION = 1
PLACEHOLDER_TOKEN = 0  # the stand-in token of the incident (SGLang set origin_input_ids=[0])


MANIFEST_TAG_BYTES = 32


class ManifestError(KvfenceError):
    """Manifest bytes that cannot be decoded (bad version, missing or malformed field)."""


class ManifestAuthError(ManifestError):
    """A sealed manifest whose MAC does not verify: not made by a holder of the cluster key, or altered."""


def seal(data: bytes, key: bytes) -> bytes:
    """The manifest as it travels: HMAC-SHA256(key, data) followed by `data`."""
    return hmac.new(key, data, hashlib.sha256).digest() + data


def unseal(payload: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """The manifest bytes inside `payload`, after checking its MAC in constant time (ManifestAuthError if not)."""
    raw = bytes(payload)
    if len(raw) < MANIFEST_TAG_BYTES:
        raise ManifestAuthError(f"sealed manifest of {len(raw)} bytes is shorter than its tag")
    tag, data = raw[:MANIFEST_TAG_BYTES], raw[MANIFEST_TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, data, hashlib.sha256).digest()):
        raise ManifestAuthError("manifest MAC does not verify: not sealed with this deployment's cluster key")
    return data


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """ceil(num_tokens / page_size): the pages a prompt of `num_tokens` needs."""
    return cdiv(num_tokens, page_size)


def _pack_u64(values: Sequence[int]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<u8").tobytes()).decode("ascii")


def _unpack_u64(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8:
        raise ManifestError(f"packed uint64 field has {len(raw)} bytes, not a multiple of 8")
    return tuple(int(x) for x in np.frombuffer(raw, dtype="<u8"))


@dataclass(frozen=True)
class HandoffManifest:
    request_id: str
    transfer_id: str
    num_tokens: int
    token_hash: str
    layout_fingerprint: str
    layout: dict  # KVLayout.describe()
    page_size: int
    num_pages: int
    page_digests: tuple[int, ...]  # logical order
    canaries: tuple[int, ...]  # logical order
    digest_algorithm: str = DIGEST_ALGORITHM
    canary_samples: int = CANARY_SAMPLES
    version: int = MANIFEST_VERSION
    first_token: int | None = None  # the token prefill sampled after the prompt (its word, like the rest)
    first_logprobs: list | None = None  # its scores in the control plane's wire form, when the request asked

    def __post_init__(self) -> None:
        # explicit checks, not asserts: a manifest arrives over the wire and `python -O` drops asserts
        if self.num_tokens < 0 or self.num_pages < 0 or self.page_size <= 0:
            raise ValueError(f"num_tokens {self.num_tokens}, num_pages {self.num_pages}, page_size {self.page_size}")
        if self.first_token is not None and self.first_token < 0:
            raise ValueError(f"first_token {self.first_token} is negative")
        if len(self.page_digests) != self.num_pages or len(self.canaries) != self.num_pages:
            raise ValueError(
                f"{len(self.page_digests)} page digests and {len(self.canaries)} canaries for {self.num_pages} pages"
            )

    def to_bytes(self) -> bytes:
        d = {
            "version": self.version,
            "request_id": self.request_id,
            "transfer_id": self.transfer_id,
            "num_tokens": self.num_tokens,
            "token_hash": self.token_hash,
            "layout_fingerprint": self.layout_fingerprint,
            "layout": self.layout,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "digest_algorithm": self.digest_algorithm,
            "canary_samples": self.canary_samples,
            "page_digests": _pack_u64(self.page_digests),
            "canaries": _pack_u64(self.canaries),
        }
        if self.first_token is not None:
            d["first_token"] = self.first_token
            d["first_logprobs"] = self.first_logprobs
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> HandoffManifest:
        try:
            d = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ManifestError("manifest is not a JSON object")
        if d.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"manifest version {d.get('version')!r} is not supported (want {MANIFEST_VERSION})")
        try:
            m = cls(
                request_id=str(d["request_id"]),
                transfer_id=str(d["transfer_id"]),
                num_tokens=int(d["num_tokens"]),
                token_hash=str(d["token_hash"]),
                layout_fingerprint=str(d["layout_fingerprint"]),
                layout=dict(d["layout"]),
                page_size=int(d["page_size"]),
                num_pages=int(d["num_pages"]),
                page_digests=_unpack_u64(d["page_digests"]),
                canaries=_unpack_u64(d["canaries"]),
                digest_algorithm=str(d["digest_algorithm"]),
                canary_samples=int(d["canary_samples"]),
                version=int(d["version"]),
                first_token=None if d.get("first_token") is None else int(d["first_token"]),
                first_logprobs=None if d.get("first_logprobs") is None else list(d["first_logprobs"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from e
        return m


def build_manifest(
    request_id: str,
    transfer_id: str,
    token_ids: Sequence[int],
    pool: KVPool,
    pages: Sequence[int],
    faults: FaultInjector | None = None,
    first_token: int | None = None,
    first_logprobs: list | None = None,
) -> HandoffManifest:
    """Prefill's manifest for the first ceil(len(token_ids)/page_size) of `pages` (logical order), carrying the
    first token prefill sampled when given.

    Fault hooks: `placeholder_handoff` (claim the 1-token stand-in), `wrong_layout`.
    """
    layout = pool.layout
    if faults is not None and faults.hit("placeholder_handoff", request_id):
        token_ids = [PLACEHOLDER_TOKEN]
    num_tokens = len(token_ids)
    num_pages = pages_for_tokens(num_tokens, layout.page_size)
    if len(pages) < num_pages:
        raise ValueError(f"request {request_id} has {len(pages)} pages, {num_tokens} tokens need {num_pages}")
    send_pages = list(pages[:num_pages])
    described = layout
    algorithm = digest_algorithm_for(pool)  # computed where the pages live: nothing is read to the host for it
    if faults is not None and faults.hit("wrong_layout", request_id):
        described = KVLayout(layout.architecture, layout.num_layers, layout.buffers, layout.page_size * 2, layout.dtype)
    return HandoffManifest(
        request_id=request_id,
        transfer_id=transfer_id,
        num_tokens=num_tokens,
        token_hash=token_hash(token_ids),
        layout_fingerprint=described.fingerprint,
        layout=described.describe(),
        page_size=described.page_size,
        num_pages=num_pages,
        page_digests=tuple(page_digests(pool, send_pages, algorithm)),
        canaries=tuple(compute_canaries(pool, send_pages, request_id)),
        digest_algorithm=algorithm,
        first_token=first_token,
        first_logprobs=first_logprobs,
    )
