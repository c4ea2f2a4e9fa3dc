"""Reading a /metrics page with prometheus_client's own text parser (the format Prometheus scrapes).

`value(text, name, **labels)` is the one sample of that name whose labels include the given ones; it fails the
test when there is none or more than one. `families(text)` is every family on the page, parsed.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def value(text: str, name: str, **labels: str) -> float:
    found = [
        s.value
        for family in families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples on the page"
    return float(found[0])
