"""A saved SGLang Prometheus scrape (the body of GET /metrics): pool, context, role and failure counters.

What it knows: how to read the Prometheus text exposition format (prometheus_client's own parser, the library
SGLang renders it with: label values may hold commas, `=`, quotes and newlines), and the SGLang metric names it
reads, all from observability/metrics_collector.py of 0.5.19 ..
0.5.23: the gauges `sglang:max_total_num_tokens` and `sglang:context_len`, the counters
`sglang:num_transfer_failed_reqs_total`, `sglang:num_bootstrap_failed_reqs_total`,
`sglang:num_aborted_requests_total`, `sglang:num_requests_total`, and from 0.5.22
`sglang:decode_deferred_kv_release_total{outcome="drained"|"timeout"|"error"}`; each series carries the labels
`model_name` and `engine_type` ("prefill", "decode", "unified", or "dynamic" for a role-switching server).
What it does not know: anything a scrape cannot say (settings, per-request history); counters count since the
server started.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvfence.audit.findings import Finding, Severity
from kvfence.errors import KvfenceError

POOL = "sglang:max_total_num_tokens"
CONTEXT = "sglang:context_len"
TRANSFER_FAILED = "sglang:num_transfer_failed_reqs_total"
BOOTSTRAP_FAILED = "sglang:num_bootstrap_failed_reqs_total"
ABORTED = "sglang:num_aborted_requests_total"
REQUESTS = "sglang:num_requests_total"
DEFERRED_RELEASE = "sglang:decode_deferred_kv_release_total"
KNOWN = (POOL, CONTEXT, TRANSFER_FAILED, BOOTSTRAP_FAILED, ABORTED, REQUESTS, DEFERRED_RELEASE)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class MetricsSnapshot:
    source: str
    samples: list[Sample] = field(default_factory=list)

    def values(self, name: str, **labels: str) -> list[float]:
        return [
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def gauge_min(self, name: str) -> int | None:
        """Smallest value over all series (per-rank pools differ only when a rank is short of memory)."""
        vals = self.values(name)
        return int(min(vals)) if vals else None

    def counter(self, name: str, **labels: str) -> int | None:
        vals = self.values(name, **labels)
        return int(sum(vals)) if vals else None

    def label_values(self, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name.startswith("sglang:") and label in s.labels}

    @property
    def is_sglang(self) -> bool:
        return any(s.name.startswith("sglang:") for s in self.samples)

    def facts(self) -> dict[str, object]:
        return {
            "source": self.source,
            "engine_type": sorted(self.label_values("engine_type")),
            "model_name": sorted(self.label_values("model_name")),
            "max_total_num_tokens": self.gauge_min(POOL),
            "context_len": self.gauge_min(CONTEXT),
            "transfer_failed": self.counter(TRANSFER_FAILED),
            "bootstrap_failed": self.counter(BOOTSTRAP_FAILED),
            "aborted": self.counter(ABORTED),
            "requests": self.counter(REQUESTS),
            "deferred_release": {o: self.counter(DEFERRED_RELEASE, outcome=o) for o in ("drained", "timeout", "error")},
        }


def parse_metrics(text: str, source: str) -> MetricsSnapshot:
    """Samples of a Prometheus text scrape; KvfenceError when it is not one or holds no sample."""
    try:
        samples = [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except (ValueError, TypeError, IndexError) as e:
        raise KvfenceError(f"{source}: not a Prometheus text scrape ({e})") from e
    if not samples:
        raise KvfenceError(f"{source}: no Prometheus samples found (expected the body of GET /metrics)")
    return MetricsSnapshot(source, samples)


def metric_findings(m: MetricsSnapshot, role: str, pool_rule: bool = False) -> list[Finding]:
    """Failure counters (and, with pool_rule, pool against context) of one server's scrape."""
    out: list[Finding] = []
    xfer, boot = m.counter(TRANSFER_FAILED), m.counter(BOOTSTRAP_FAILED)
    if (xfer or 0) + (boot or 0) > 0:
        out.append(
            Finding(
                "metrics-transfer-failures",
                Severity.WARNING,
                role,
                f"{m.source}: {xfer or 0} transfer failure(s) and {boot or 0} bootstrap failure(s) since start-up",
                "run `kvfence audit logs` over the same period to see which requests and whether decode freed pages "
                "early",
                m.source,
            )
        )
    timeouts = m.counter(DEFERRED_RELEASE, outcome="timeout")
    if timeouts:
        out.append(
            Finding(
                "metrics-deferred-release-timeouts",
                Severity.WARNING,
                role,
                f"{m.source}: decode released held pages {timeouts} time(s) after the deferred-release timeout, "
                "without prefill's drain acknowledgement",
                "raise SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT on decode and check prefill health",
                m.source,
            )
        )
    pool, ctx = m.gauge_min(POOL), m.gauge_min(CONTEXT)
    if pool_rule and pool and ctx and ctx > pool:
        out.append(
            Finding(
                "metrics-pool-below-context",
                Severity.WARNING,
                role,
                f"{m.source}: sglang:context_len {ctx} is above sglang:max_total_num_tokens {pool}; one full-length "
                "request cannot fit (on SGLang 0.5.19 such a prompt is handed to decode as a 1-token stub)",
                f"lower --context-length to <= {pool}, or give the pool more memory",
                m.source,
            )
        )
    return out
