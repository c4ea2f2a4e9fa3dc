"""Integrity records: one per request, saying how its KV handoff ended.

What it knows: the fields every request's record carries (status verified /
rejected / failed, or `unverified` when verification was switched off for a
demonstration, or `local` in aggregated mode, where the prompt's KV never left the
process that reads it, so the fields about a handoff are null; reason code; tokens
covered; pages; digest algorithm; layout fingerprint; a reference to the transfer (a hash
of its id: the id itself is a capability and never leaves the workers); whether the manifest
was authenticated with a cluster key (False under --insecure-no-auth); timings), how to
print it as one JSON log line and as the `kvfence.integrity` field of an API response, and the Prometheus counters that
count them, held in a registry object the caller owns (no per-request globals).

What it does not know: how the handoff went; `disagg.handoff` fills it in.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvfence.integrity.algorithms import DIGEST_ALGORITHM
from kvfence.integrity.verdict import VERIFY_REASONS, Reason, VerifyResult

STATUSES = ("verified", "rejected", "failed", "unverified", "local")
LOCAL_DETAIL = "aggregated mode: the prompt's KV was computed in the process that decodes it; no handoff to verify"


def _required(f: Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def status_for(result: VerifyResult | None, verified: bool = True) -> str:
    """verified when ok; rejected when a check found bad pages; failed when the transfer never completed."""
    if result is None:
        return "failed"
    if result.ok:
        return "verified" if verified else "unverified"
    return "rejected" if result.reason in VERIFY_REASONS else "failed"


@dataclass(frozen=True)
class IntegrityRecord:
    request_id: str
    status: str
    reason: str | None
    detail: str
    tokens_expected: int
    tokens_covered: int | None  # None for a local record (nothing was transferred)
    pages: int | None
    digest_algorithm: str | None = DIGEST_ALGORITHM
    layout_fingerprint: str = ""
    transfer_ref: str | None = ""  # `transfer.base.transfer_ref` of the transfer id (None: local, no transfer)
    authenticated: bool | None = None  # the manifest was sealed with a secret cluster key (None: no manifest)
    role: str = "decode"
    timings: dict[str, float] = field(default_factory=dict)  # seconds: transfer, verify, total
    # output tokens the router released to the client before decode's verdict reached it: the first token, computed
    # on prefill's own KV, streams while the handoff runs (a non-streamed response still goes out whole, after the
    # verdict; docs/handoff.md, "What the client sees before the verdict")
    tokens_before_verdict: int = 0
    # why the request's first attempt was given up and it was run again on another pair (a worker lost before any
    # token reached the client); None when it ran once
    retried_after: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"integrity record: status {self.status!r} is not one of {STATUSES}")
        if (self.status in ("verified", "unverified", "local")) != (self.reason is None):
            raise ValueError(f"integrity record: status {self.status!r} does not go with reason {self.reason!r}")

    @classmethod
    def from_dict(cls, data: object) -> IntegrityRecord:
        """The inverse of `to_dict` (a record that came over the wire); anything else raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"integrity record: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown, missing = set(data) - names, {f.name for f in fields(cls) if f.name not in data and _required(f)}
        if unknown or missing:
            raise ValueError(f"integrity record: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        return cls(**data)

    @classmethod
    def local(cls, request_id: str, tokens_expected: int, layout_fingerprint: str) -> IntegrityRecord:
        """The record of an aggregated-mode request: same fields, null where a handoff would have filled them."""
        return cls(
            request_id=request_id,
            status="local",
            reason=None,
            detail=LOCAL_DETAIL,
            tokens_expected=tokens_expected,
            tokens_covered=None,
            pages=None,
            digest_algorithm=None,
            layout_fingerprint=layout_fingerprint,
            transfer_ref=None,
            role="aggregated",
        )

    @classmethod
    def from_result(
        cls,
        request_id: str,
        result: VerifyResult,
        *,
        tokens_expected: int,
        pages: int,
        layout_fingerprint: str,
        transfer_ref: str = "",
        authenticated: bool | None = None,
        role: str = "decode",
        timings: dict[str, float] | None = None,
        verified: bool = True,
    ) -> IntegrityRecord:
        return cls(
            request_id=request_id,
            status=status_for(result, verified),
            reason=None if result.ok else Reason(result.reason).value,
            detail=result.detail,
            tokens_expected=tokens_expected,
            tokens_covered=result.tokens_covered,
            pages=pages,
            digest_algorithm=result.digest_algorithm or DIGEST_ALGORITHM,
            layout_fingerprint=layout_fingerprint,
            transfer_ref=transfer_ref,
            authenticated=authenticated,
            role=role,
            timings=dict(timings or {}),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        """One JSON log line (no newline)."""
        return json.dumps({"event": "kvfence.integrity", **self.to_dict()}, separators=(",", ":"), sort_keys=True)

    def to_api(self) -> dict:
        """The `kvfence.integrity` field of an API response."""
        return {
            "status": self.status,
            "reason": self.reason,
            "detail": self.detail,
            "tokens_expected": self.tokens_expected,
            "tokens_covered": self.tokens_covered,
            "pages": self.pages,
            "digest_algorithm": self.digest_algorithm,
            "layout_fingerprint": self.layout_fingerprint,
            "transfer_ref": self.transfer_ref,
            "authenticated": self.authenticated,
            "tokens_before_verdict": self.tokens_before_verdict,
            "retried_after": self.retried_after,
        }


class IntegrityMetrics:
    """Prometheus counters for handoff endings, in a registry the process owns."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.verified = Counter("kvfence_handoff_verified", "KV handoffs whose pages verified", registry=self.registry)
        self.failed = Counter(
            "kvfence_handoff_failed", "KV handoffs rejected or failed, by reason", ["reason"], registry=self.registry
        )
        self.unverified = Counter(
            "kvfence_handoff_unverified",
            "KV handoffs admitted with verification switched off",
            registry=self.registry,
        )
        self.verify_seconds = Histogram(
            "kvfence_handoff_verify_seconds",
            "Time spent verifying one handoff",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )

    def observe(self, record: IntegrityRecord) -> None:
        if record.status == "verified":
            self.verified.inc()
        elif record.status == "unverified":
            self.unverified.inc()
        elif record.status == "local":
            pass  # no handoff happened: nothing to count here
        else:
            self.failed.labels(reason=record.reason or "unknown").inc()
        if "verify" in record.timings:
            self.verify_seconds.observe(record.timings["verify"])

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value, e.g. value("kvfence_handoff_failed_total", {"reason": "coverage_gap"})."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v
