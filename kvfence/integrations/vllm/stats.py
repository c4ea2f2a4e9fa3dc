"""The connector's numbers through vLLM's connector stats API: logged by vLLM and exported on its /metrics.

What it knows: `KvfenceStats` carries counter increments since the worker's last report (a flat dict of floats:
`consumer_verified`, `consumer_failed`, `failed_reason_<reason>`, `consumer_verify_s`, `consumer_bytes`,
`producer_digested`, `producer_verified`, `producer_rejected`, `producer_send_failed`, `producer_lease_expired`,
`producer_refused`, `records_undelivered`) plus the gauge `producer_held_now`; aggregation sums increments and keeps
the latest gauge. `KvfencePromMetrics` turns them into Prometheus series on vLLM's registry:

  vllm:kvfence_handoffs_verified_total            decode: loads whose every check passed
  vllm:kvfence_handoffs_failed_total{reason}      decode: loads that failed the request, by reason code
  vllm:kvfence_verify_seconds_total               decode: time spent verifying
  vllm:kvfence_received_bytes_total               decode: KV bytes received
  vllm:kvfence_records_undelivered_total          decode: records the front end did not take
  vllm:kvfence_transfers_total{outcome}           prefill: held transfers by how they ended (verified,
                                                  rejected, send_failed, lease_expired)
  vllm:kvfence_pulls_refused_total                prefill: pulls for unknown, consumed or expired transfer ids
  vllm:kvfence_blocks_held_transfers              prefill: transfers holding blocks now

What it does not know: where the numbers come from (connector.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_GAUGES = ("producer_held_now",)
_OUTCOMES = ("verified", "rejected", "send_failed", "lease_expired")


@dataclass
class KvfenceStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = v if k in _GAUGES else self.data.get(k, 0.0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not self.data


class KvfencePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine: dict) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        counter: Any = self._counter_cls  # vLLM's Counter / Gauge classes (prometheus_client's or its own)
        gauge: Any = self._gauge_cls

        def per_engine_metric(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.verified = per_engine_metric(
            counter(name="vllm:kvfence_handoffs_verified", documentation="KV loads verified", labelnames=labelnames)
        )
        self._failed: Any = counter(
            name="vllm:kvfence_handoffs_failed",
            documentation="KV loads that failed their request, by reason",
            labelnames=[*labelnames, "reason"],
        )
        self.verify_s = per_engine_metric(
            counter(name="vllm:kvfence_verify_seconds", documentation="Time verifying loads", labelnames=labelnames)
        )
        self.bytes = per_engine_metric(
            counter(name="vllm:kvfence_received_bytes", documentation="KV bytes received", labelnames=labelnames)
        )
        self.undelivered = per_engine_metric(
            counter(
                name="vllm:kvfence_records_undelivered",
                documentation="Integrity records the front end did not take",
                labelnames=labelnames,
            )
        )
        self._transfers: Any = counter(
            name="vllm:kvfence_transfers",
            documentation="Held transfers on prefill, by how they ended",
            labelnames=[*labelnames, "outcome"],
        )
        self.refused = per_engine_metric(
            counter(
                name="vllm:kvfence_pulls_refused",
                documentation="Pulls for unknown, consumed or expired transfer ids",
                labelnames=labelnames,
            )
        )
        self.held = per_engine_metric(
            gauge(
                name="vllm:kvfence_blocks_held_transfers",
                documentation="Transfers whose blocks prefill holds now",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        labels = self.per_engine_labelvalues[engine_idx]
        if d.get("consumer_verified"):
            self.verified[engine_idx].inc(d["consumer_verified"])
        if d.get("consumer_verify_s"):
            self.verify_s[engine_idx].inc(d["consumer_verify_s"])
        if d.get("consumer_bytes"):
            self.bytes[engine_idx].inc(d["consumer_bytes"])
        if d.get("records_undelivered"):
            self.undelivered[engine_idx].inc(d["records_undelivered"])
        if d.get("producer_refused"):
            self.refused[engine_idx].inc(d["producer_refused"])
        for k, v in d.items():
            if k.startswith("failed_reason_") and v:
                self._failed.labels(*labels, k.removeprefix("failed_reason_")).inc(v)
        for outcome in _OUTCOMES:
            if d.get(f"producer_{outcome}"):
                self._transfers.labels(*labels, outcome).inc(d[f"producer_{outcome}"])
        if "producer_held_now" in d:
            self.held[engine_idx].set(d["producer_held_now"])
