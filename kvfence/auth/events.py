"""Security events: what a process counts and logs when something that is not part of the deployment knocks.

What it knows: the kinds of event (a data connection whose handshake failed, a frame whose MAC or
shape is wrong, a header over the size limit, a manifest that does not authenticate, a manifest for
a transfer id decode was not issued, a control connection the CURVE handshake refused), a
thread-safe count per kind (reported in worker stats and exported by the router's /metrics as
`kvfence_security_events_total{source, kind}`), and a rate-limited warning log line per event (an
attacker cannot flood the log: at most one line per kind per second, with the number suppressed).

What it does not know: which plane detected the event or what to do about it; detectors drop the
offending connection or frame themselves. Events never carry key material.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from enum import Enum

from prometheus_client.core import CounterMetricFamily, Metric

logger = logging.getLogger("kvfence.security")


class SecurityEvent(str, Enum):
    HANDSHAKE_FAILED = "handshake_failed"  # a data connection that did not prove it holds the key
    FRAME_MAC_INVALID = "frame_mac_invalid"  # a frame of an authenticated connection whose MAC fails
    FRAME_MALFORMED = "frame_malformed"  # a header that is not a frame of its direction (transfer.frames), bad pages
    HEADER_TOO_LARGE = "header_too_large"  # a frame header over the limit (refused before allocating it)
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a control payload over the limit
    MANIFEST_UNAUTHENTICATED = "manifest_unauthenticated"  # a manifest whose MAC does not verify
    CAPABILITY_MISMATCH = "capability_mismatch"  # a manifest for a transfer id the router did not issue
    CONTROL_HANDSHAKE_FAILED = "control_handshake_failed"  # the control plane's CURVE handshake refused a peer
    CONNECTION_LIMIT = "connection_limit"  # too many connections still authenticating: a new one was refused


class SecurityEvents:
    """Counts of security events of one process, and their rate-limited log."""

    def __init__(self, source: str = "", log_interval_s: float = 1.0) -> None:
        self.source = source  # whose events these are (a worker id, "router"), for logs
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._log_interval_s = log_interval_s
        self._last_logged: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def record(self, kind: SecurityEvent, detail: str) -> None:
        """Count one event and log it (unless one of its kind was logged less than a second ago)."""
        now = time.monotonic()
        with self._lock:
            self._counts[kind.value] += 1
            if now - self._last_logged.get(kind.value, -1e9) < self._log_interval_s:
                self._suppressed[kind.value] += 1
                return
            self._last_logged[kind.value] = now
            suppressed = self._suppressed.pop(kind.value, 0)
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        logger.warning("security event %s%s: %s%s", kind.value, f" at {self.source}" if self.source else "", detail,
                       more)  # fmt: skip

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class SecurityEventsCollector:
    """Prometheus collector: `kvfence_security_events_total{source, kind}` from `sources()` at scrape time
    (source -> kind -> count: the router's own events and those its workers reported)."""

    def __init__(self, sources: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvfence_security_events",
            "Security events (refused handshakes, frames, manifests, capabilities) by process and kind",
            labels=["source", "kind"],
        )
        try:
            sources = self._sources()
        except Exception:  # a scrape must not fail because a worker's report was odd
            logger.exception("security events: reading the sources failed")
            sources = {}
        for source, counts in sorted(sources.items()):
            for kind, count in sorted(counts.items()):
                family.add_metric([str(source), str(kind)], float(count))
        yield family
