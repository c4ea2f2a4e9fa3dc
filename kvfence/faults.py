"""Named fault-injection points for the KV handoff, enabled only on purpose.

What it knows: the list of faults the handoff code can simulate (each one a real
failure mode of a PD deployment, `placeholder_handoff` being the 2026 incident),
and for each enabled fault which requests it targets and which logical page. A
`FaultInjector` is an object a test (or an explicit `--inject-fault` flag) builds and
passes down to the manifest builder, sender and receiver; nothing here is a module
global and importing this file enables nothing.

A fault selects requests from outside the process, so that a test can aim it at some
requests of a running `kvfence serve` and watch the others stay intact:

    --inject-fault NAME[@PATTERN][#PAGE][%N],...

PATTERN is a glob (`fnmatch`) over request ids, matched against the id the client chose with the
`X-Request-Id` header (`victim-*` selects `X-Request-Id: victim-1`) and against the engine's id for each
choice, `<cmpl|chatcmpl|resp>-<client id>-<choice>` (`cmpl-victim-1-0`); PAGE the logical page it damages,
and %N fires it on every Nth matching request (the 1st, the N+1th, ...), counted in the
order requests first reach the fault in this process.

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

import fnmatch
import re
from collections import OrderedDict
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


_REMEMBERED = 4096  # requests whose every-Nth verdict a fault remembers (a request asks several times)
_ENGINE_ID = re.compile(r"(?:cmpl|chatcmpl|resp)-(?P<client>.+)-\d+")  # kvfence.server.context.request_id


def client_request_id(request_id: str) -> str | None:
    """The id the client gave (`X-Request-Id`) inside an engine request id, or None when it is not one."""
    m = _ENGINE_ID.fullmatch(request_id)
    return m.group("client") if m else None


@dataclass(frozen=True)
class FaultPoint:
    """One enabled fault: which requests (a glob over ids; None = every request), which logical page,
    every how many matching requests, how slow."""

    name: str
    request_id: str | None = None
    page: int = 0
    delay_s: float = 0.02
    every: int = 1

    def __post_init__(self) -> None:
        if self.name not in FAULT_NAMES:
            raise ValueError(f"unknown fault {self.name!r}; known faults: {', '.join(FAULT_NAMES)}")
        if self.page < 0 or self.every < 1 or self.delay_s < 0:
            raise ValueError(f"fault {self.name}: page >= 0, every >= 1 and delay >= 0 are required")

    def matches(self, request_id: str) -> bool:
        """Whether the fault aims at this request: its engine id or the client's id inside it matches."""
        if self.request_id is None or fnmatch.fnmatchcase(request_id, self.request_id):
            return True
        client = client_request_id(request_id)
        return client is not None and fnmatch.fnmatchcase(client, self.request_id)

    @classmethod
    def parse(cls, spec: str) -> FaultPoint:
        """`NAME[@PATTERN][#PAGE][%N]` (see the module docstring); ValueError names what is wrong."""
        rest, every, page = spec.strip(), 1, 0
        try:
            if "%" in rest:
                rest, every_text = rest.rsplit("%", 1)
                every = int(every_text)
            if "#" in rest:
                rest, page_text = rest.rsplit("#", 1)
                page = int(page_text)
        except ValueError:
            raise ValueError(f"fault spec {spec!r}: PAGE and N must be integers (NAME[@PATTERN][#PAGE][%N])") from None
        name, _, pattern = rest.partition("@")
        return cls(name.strip(), request_id=pattern or None, page=page, every=every)


class FaultInjector:
    """The set of enabled faults for one process; thread-safe enough for counters (GIL-atomic ints)."""

    def __init__(self, points: tuple[FaultPoint, ...] | list[FaultPoint] = ()) -> None:
        self._points: dict[str, FaultPoint] = {}
        self.fired: dict[str, int] = {name: 0 for name in FAULT_NAMES}
        self._seen: dict[str, OrderedDict[str, bool]] = {}  # fault -> request id -> chosen (every-Nth)
        self._matched: dict[str, int] = {}  # fault -> matching requests seen so far (every-Nth)
        for p in points:
            self._points[p.name] = p

    @classmethod
    def from_flag(cls, specs: str | None) -> FaultInjector | None:
        """Build from a comma-separated `--inject-fault` flag value; None when the flag is absent."""
        if not specs:
            return None
        return cls([FaultPoint.parse(s) for s in specs.split(",") if s.strip()])

    def enable(
        self, name: str, *, request_id: str | None = None, page: int = 0, delay_s: float = 0.02, every: int = 1
    ) -> FaultInjector:
        self._points[name] = FaultPoint(name, request_id=request_id, page=page, delay_s=delay_s, every=every)
        return self

    def point(self, name: str, request_id: str) -> FaultPoint | None:
        """The fault if it is enabled for this request, without counting it as fired."""
        p = self._points.get(name)
        if p is None or not p.matches(request_id):
            return None
        if p.every > 1 and not self._chosen(p, request_id):
            return None
        return p

    def _chosen(self, p: FaultPoint, request_id: str) -> bool:
        """Every-Nth: the 1st, N+1th, ... matching request to reach fault `p`; a request keeps its verdict."""
        seen = self._seen.setdefault(p.name, OrderedDict())
        chosen = seen.get(request_id)
        if chosen is None:
            n = self._matched.get(p.name, 0)
            self._matched[p.name] = n + 1
            chosen = seen[request_id] = n % p.every == 0
            while len(seen) > _REMEMBERED:
                seen.popitem(last=False)
        return chosen

    def hit(self, name: str, request_id: str) -> FaultPoint | None:
        """The fault if enabled for this request; counts it as fired."""
        p = self.point(name, request_id)
        if p is not None:
            self.fired[name] += 1
        return p

    @property
    def enabled(self) -> list[str]:
        return sorted(self._points)
