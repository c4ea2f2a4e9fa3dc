"""Named fault-injection points for the KV handoff, enabled only on purpose.

What it knows: the list of faults the handoff code can simulate (each one a real
failure mode of a PD deployment, `placeholder_handoff` being the 2026 incident),
and for each enabled fault which request it targets and which logical page. A
`FaultInjector` is an object a test (or an explicit `--inject-fault` flag) builds and
passes down to the manifest builder, sender and receiver; nothing here is a module
global and importing this file enables nothing.

What it does not know: how a fault is carried out; each hook lives next to the code
it breaks (`transfer.base` sender/receiver cores, `disagg.handoff` manifest building)
and asks `injector.hit(name, request_id)` whether to misbehave.

Faults:
  placeholder_handoff       prefill replaces the prompt by a 1-token stand-in (token 0),
                            its manifest claims 1 token, it sends one page and reports done
  short_write               one page frame carries fewer bytes than a page
  drop_page                 one logical page is never sent, the transfer still reports done
  corrupt_byte              one byte of one page is flipped in flight (after digests)
  reorder_pages             the payloads of two logical pages are swapped (labels kept)
  stale_page                the receiver marks one page written but does not copy it, so the
                            destination keeps what a previous request left there
  delayed_write_after_abort the sender ignores an abort and keeps writing, slowly; the receiver
                            lets the writes land (one-sided, RDMA-like) into the aborted pages
  wrong_layout              the manifest describes a different layout (page size doubled)
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_NAMES: tuple[str, ...] = (
    "placeholder_handoff",
    "short_write",
    "drop_page",
    "corrupt_byte",
    "reorder_pages",
    "stale_page",
    "delayed_write_after_abort",
    "wrong_layout",
)


@dataclass(frozen=True)
class FaultPoint:
    """One enabled fault: which request (None = every request), which logical page, how slow."""

    name: str
    request_id: str | None = None
    page: int = 0
    delay_s: float = 0.02

    def __post_init__(self) -> None:
        if self.name not in FAULT_NAMES:
            raise ValueError(f"unknown fault {self.name!r}; known faults: {', '.join(FAULT_NAMES)}")
        assert self.page >= 0, self.page
        assert self.delay_s >= 0, self.delay_s


class FaultInjector:
    """The set of enabled faults for one process; thread-safe enough for counters (GIL-atomic ints)."""

    def __init__(self, points: tuple[FaultPoint, ...] | list[FaultPoint] = ()) -> None:
        self._points: dict[str, FaultPoint] = {}
        self.fired: dict[str, int] = {name: 0 for name in FAULT_NAMES}
        for p in points:
            self._points[p.name] = p

    @classmethod
    def from_flag(cls, names: str | None) -> FaultInjector | None:
        """Build from a comma-separated `--inject-fault` flag value; None when the flag is absent."""
        if not names:
            return None
        return cls([FaultPoint(n.strip()) for n in names.split(",") if n.strip()])

    def enable(
        self, name: str, *, request_id: str | None = None, page: int = 0, delay_s: float = 0.02
    ) -> FaultInjector:
        self._points[name] = FaultPoint(name, request_id=request_id, page=page, delay_s=delay_s)
        return self

    def point(self, name: str, request_id: str) -> FaultPoint | None:
        """The fault if it is enabled for this request, without counting it as fired."""
        p = self._points.get(name)
        if p is None or (p.request_id is not None and p.request_id != request_id):
            return None
        return p

    def hit(self, name: str, request_id: str) -> FaultPoint | None:
        """The fault if enabled for this request; counts it as fired."""
        p = self.point(name, request_id)
        if p is not None:
            self.fired[name] += 1
        return p

    @property
    def enabled(self) -> list[str]:
        return sorted(self._points)
