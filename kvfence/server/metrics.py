"""Prometheus metrics of one API server, in a registry of its own (two apps in one process never mix).

What it knows: counters the front end updates as requests pass (requests by endpoint
and status, rejections by code, aborts, prompt/generated tokens, integrity results by
status), the request histograms vLLM users read, with vLLM's meanings (time to first
token, inter-token latency, time per output token, end to end, and, from the engine's
`RequestTimings`, queue, prefill, decode and inference time; prompt and generation
lengths), a `model_name` label on every family that has a `vllm:*` counterpart (the
mapping is in docs/api.md), and a collector that reads the engine's live numbers at
scrape time from `EngineClient.stats()`, whose shape is:

    {"roles": {role: {"pages_total", "pages_used", "pages_free", "pages_quarantined", "page_size"}},
     "num_running": int, "num_waiting": int, "num_preemptions": int,  # preemptions since start
     "prefix_cache": {"queries", "hits", "corrupt_pages", "pages"},  # aggregated, or the prefill workers summed; tokens
     "transfers": {result: count, ...},          # PD mode; e.g. {"ok": 12, "failed": 1}
     "workers": {worker_id: {"role", "up", "routed", "pages_free", "num_running", ...}},  # PD mode, per worker
     "worker_deaths": {role: count}}             # PD mode

Missing keys are simply not exported. Registries the EngineClient exposes (attribute
`metrics_registry`, or `integrity_metrics.registry` as the PD router has) are
appended to the same page. The page has no `*_created` samples (prometheus_client adds one
per counter and histogram; vLLM turns them off too), so every series is its family's own.
What it does not know: where the numbers come from, or HTTP (the app serves `render()` at
GET /metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.engine_client import RequestTimings

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # tokens: 1, 2, 5, 10, ... 5e6
_PAGE_KEYS = ("pages_total", "pages_used", "pages_free", "pages_quarantined")
# per-worker gauges (PD mode): stats key -> (metric name, help); each labelled by worker and role
_WORKER_GAUGES = (
    ("pages_total", "kvfence_worker_kv_pages_total", "KV pages of the worker's pool"),
    ("pages_free", "kvfence_worker_kv_pages_free", "Free KV pages the worker reported"),
    ("pages_used", "kvfence_worker_kv_pages_used", "KV pages in use the worker reported"),
    ("pages_quarantined", "kvfence_worker_kv_pages_quarantined", "Quarantined KV pages the worker reported"),
    ("num_running", "kvfence_worker_running_requests", "Requests running on the worker"),
    ("num_waiting", "kvfence_worker_waiting_requests", "Requests queued on the worker"),
    ("handoffs_in_flight", "kvfence_worker_handoffs_in_flight", "KV handoffs in flight on the worker"),
    ("queued_prompt_tokens", "kvfence_worker_queued_prompt_tokens", "Prompt tokens queued on a prefill worker"),
    ("load_free_pages", "kvfence_worker_routing_free_pages", "Free pages the router routes by (report - in transit)"),
    ("load_requests", "kvfence_worker_routing_requests", "Requests the router routes by (report + in transit)"),
    ("torch_threads", "kvfence_worker_torch_threads", "Threads of the worker's last step (core board workers only)"),
    ("steps_borrowing_cores", "kvfence_worker_steps_borrowing_cores", "Steps the worker ran on idle neighbours' cores"),
)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the engine is busy or gone
            logger.exception("EngineClient.stats() failed during a /metrics scrape")
            return
        roles: dict[str, dict[str, Any]] = stats.get("roles") or {}
        for key in _PAGE_KEYS:
            family = GaugeMetricFamily(
                f"kvfence_kv_{key}", f"KV pool {key.replace('_', ' ')} per role", labels=["role"]
            )
            for role, numbers in roles.items():
                if key in numbers:
                    family.add_metric([role], float(numbers[key]))
            yield family
        usage = GaugeMetricFamily(
            "kvfence_kv_usage_ratio", "Fraction of KV pages in use per role", labels=["model_name", "role"]
        )
        tokens = GaugeMetricFamily("kvfence_kv_capacity_tokens", "KV pool capacity in tokens per role", labels=["role"])
        for role, numbers in roles.items():
            total = numbers.get("pages_total")
            if total:
                usage.add_metric([self._model, role], float(numbers.get("pages_used", 0)) / float(total))
                if "page_size" in numbers:
                    tokens.add_metric([role], float(total * numbers["page_size"]))
        yield usage
        yield tokens
        for key, help_text in (("num_running", "Requests running in the engine"), ("num_waiting", "Requests queued")):
            if key in stats:
                family = GaugeMetricFamily(f"kvfence_{key}_requests", help_text, labels=["model_name"])
                family.add_metric([self._model], float(stats[key]))
                yield family
        if "num_preemptions" in stats:
            preemptions = CounterMetricFamily(
                "kvfence_preemptions", "Requests preempted (pages taken back, recomputed later)", labels=["model_name"]
            )
            preemptions.add_metric([self._model], float(stats["num_preemptions"]))
            yield preemptions
        yield from _prefix_cache_families(stats.get("prefix_cache"), self._model)
        transfers = CounterMetricFamily("kvfence_kv_transfers", "KV handoffs by result", labels=["result"])
        for result, count in (stats.get("transfers") or {}).items():
            transfers.add_metric([str(result)], float(count))
        yield transfers
        yield from _worker_families(stats)


def _prefix_cache_families(numbers: dict[str, Any] | None, model: str) -> Iterator[Metric]:
    """Prefix-cache counters with vLLM's meanings (queries and hits in prompt tokens), when the engine has numbers."""
    if not numbers:
        return
    for key, name, help_text in (
        ("queries", "kvfence_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        ("hits", "kvfence_prefix_cache_hits", "Prompt tokens served from the prefix cache"),
        ("corrupt_pages", "kvfence_prefix_cache_corrupt_pages", "Cached pages whose digest no longer matched"),
    ):
        family = CounterMetricFamily(name, help_text, labels=["model_name"])
        family.add_metric([model], float(numbers.get(key, 0)))
        yield family
    pages = GaugeMetricFamily("kvfence_prefix_cache_pages", "KV pages held by the prefix cache", labels=["model_name"])
    pages.add_metric([model], float(numbers.get("pages", 0)))
    yield pages


def _worker_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """Per-worker load and health of a disaggregated deployment (nothing when `stats` has no workers)."""
    workers: dict[str, dict[str, Any]] = stats.get("workers") or {}
    if not workers:
        return
    labels = ["worker", "role"]
    up = GaugeMetricFamily("kvfence_worker_up", "1 while the worker is registered and heard from", labels=labels)
    routed = CounterMetricFamily("kvfence_worker_routed_requests", "Requests routed to the worker", labels=labels)
    for wid, w in workers.items():
        up.add_metric([wid, str(w.get("role"))], 1.0 if w.get("up") else 0.0)
        routed.add_metric([wid, str(w.get("role"))], float(w.get("routed", 0)))
    yield up
    yield routed
    for key, name, help_text in _WORKER_GAUGES:
        family = GaugeMetricFamily(name, help_text, labels=labels)
        for wid, w in workers.items():
            if w.get("up") and isinstance(w.get(key), (int, float)):
                family.add_metric([wid, str(w.get("role"))], float(w[key]))
        yield family
    deaths = CounterMetricFamily("kvfence_worker_deaths", "Workers declared dead, by role", labels=["role"])
    for role, count in (stats.get("worker_deaths") or {}).items():
        deaths.add_metric([str(role)], float(count))
    yield deaths
    if "control_messages_dropped" in stats:
        dropped = CounterMetricFamily(
            "kvfence_control_messages_dropped", "Router messages dropped: the worker's link queue was full"
        )
        dropped.add_metric([], float(stats["control_messages_dropped"]))
        yield dropped


class _WithoutCreated(Collector):
    """A registry's families without prometheus_client's `*_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    def __init__(
        self, stats: Callable[[], dict[str, Any]], extra: list[CollectorRegistry] | None = None, model_name: str = ""
    ) -> None:
        """`extra`: registries the EngineClient owns (e.g. the router's handoff counters), rendered after ours;
        `model_name`: the served name, the `model_name` label of the families vLLM labels so."""
        self.extra = list(extra or [])
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        model = ["model_name"]
        self.requests = Counter(
            "kvfence_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter(
            "kvfence_requests_rejected", "Requests refused before generation, by error code", ["code"], registry=r
        )
        self.aborted = Counter("kvfence_requests_aborted", "Requests aborted because the client went away", registry=r)
        self.finished = Counter(
            "kvfence_requests_finished", "Finished choices by finish reason", ["model_name", "reason"], registry=r
        )
        self.integrity = Counter("kvfence_integrity_results", "Integrity records by status", ["status"], registry=r)
        self.in_flight = Gauge("kvfence_http_requests_in_flight", "Generation requests being served", registry=r)
        self._model = model_name

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, model, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, model, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("kvfence_prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("kvfence_generation_tokens", "Tokens generated")
        self.ttft = histogram("kvfence_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram(
            "kvfence_inter_token_latency_seconds",
            "Time between two consecutive output increments of a choice (one engine step's tokens)",
            _LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "kvfence_time_per_output_token_seconds",
            "Mean time per output token after the first, per choice",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "kvfence_e2e_request_latency_seconds", "Request latency, admission to last token", _E2E_BUCKETS
        )
        self.queue_time = histogram(
            "kvfence_request_queue_time_seconds", "Engine: arrival to first scheduled step", _E2E_BUCKETS
        )
        self.prefill_time = histogram(
            "kvfence_request_prefill_time_seconds", "Engine: first scheduled step to first token", _E2E_BUCKETS
        )
        self.decode_time = histogram(
            "kvfence_request_decode_time_seconds", "Engine: first token to last token", _E2E_BUCKETS
        )
        self.inference_time = histogram(
            "kvfence_request_inference_time_seconds", "Engine: first scheduled step to last token", _E2E_BUCKETS
        )
        self.prompt_length = histogram(
            "kvfence_request_prompt_tokens", "Prompt tokens per finished choice", _LENGTH_BUCKETS
        )
        self.generation_length = histogram(
            "kvfence_request_generation_tokens", "Generated tokens per finished choice", _LENGTH_BUCKETS
        )
        r.register(_EngineStatsCollector(stats, model_name))

    def observe_finished(
        self,
        *,
        reason: str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft: float | None,
        first_to_last: float,
        e2e: float,
        timings: RequestTimings | None,
    ) -> None:
        """One finished choice: its tokens, finish reason and latencies (engine timings when it sent them)."""
        self.generation_tokens.inc(num_output_tokens)
        self.finished.labels(self._model, reason or "unknown").inc()
        self.prompt_length.observe(num_prompt_tokens)
        self.generation_length.observe(num_output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if num_output_tokens > 1:
            self.tpot.observe(first_to_last / (num_output_tokens - 1))
        self.e2e.observe(e2e)
        if timings is not None:
            self.queue_time.observe(timings.queued_s)
            self.prefill_time.observe(timings.prefill_s)
            self.decode_time.observe(timings.decode_s)
            self.inference_time.observe(timings.inference_s)

    def observe_integrity(self, record: dict[str, Any] | None) -> None:
        if record is not None:
            self.integrity.labels(str(record.get("status", "unknown"))).inc()

    def render(self) -> bytes:
        return b"".join(generate_latest(_WithoutCreated(r)) for r in [self.registry, *self.extra])  # type: ignore[arg-type]
