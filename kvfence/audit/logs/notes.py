"""The notable requests of a log audit (too long, failed, mismatched, leak candidates), counted exactly, listed up
to a bound.

What it knows: a `RequestNote` (side, rid, bootstrap room, time, kind, detail, verdict and the evidence the verdict
rests on, the log line it was read from); the `NoteBook` counts every note per kind exactly, keeps the first
`listed_per_kind` of each kind for the report (so a log with millions of failures still gives a bounded report and
bounded memory), and remembers the first `places_per_kind` (side, line) of each kind for the findings' locations.
What it does not know: the rules (kvfence.audit.logs.rules) or the line formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LISTED_PER_KIND = 10_000
PLACES_PER_KIND = 10


@dataclass(slots=True)
class RequestNote:
    """A request worth listing: too long, failed, mismatched, or a leak candidate."""

    side: str
    rid: str | None
    room: str | None
    time: str
    kind: str
    detail: str
    status: str = ""
    coverage: str = ""
    version: str | None = None
    evidence: str = ""  # what the status rests on: a log line kind, or the release rule
    line: int | None = None  # 1-based line of the side's log file

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class NoteBook:
    def __init__(self, listed_per_kind: int | None = None, places_per_kind: int = PLACES_PER_KIND) -> None:
        self.listed_per_kind = LISTED_PER_KIND if listed_per_kind is None else listed_per_kind
        self.places_per_kind = places_per_kind
        self.listed: list[RequestNote] = []
        self.counts: dict[str, int] = {}
        self.not_listed: dict[str, int] = {}
        self._places: dict[str, list[tuple[str, int]]] = {}

    def add(self, note: RequestNote) -> None:
        n = self.counts.get(note.kind, 0)
        self.counts[note.kind] = n + 1
        if n < self.listed_per_kind:
            self.listed.append(note)
        else:
            self.not_listed[note.kind] = self.not_listed.get(note.kind, 0) + 1
        self.place(note.kind, note.side, note.line)

    def add_count(self, kind: str, n: int, side: str, line: int | None) -> None:
        """n events of a kind that no line lists one by one (a counter in a stats line)."""
        self.counts[kind] = self.counts.get(kind, 0) + n
        self.place(kind, side, line)

    def place(self, kind: str, side: str, line: int | None) -> None:
        """Remember where a note of this kind was read (the first few per kind)."""
        if line is None:
            return
        places = self._places.setdefault(kind, [])
        if len(places) < self.places_per_kind:
            places.append((side, line))

    def count(self, *kinds: str) -> int:
        return sum(self.counts.get(k, 0) for k in kinds)

    def places(self, *kinds: str) -> list[tuple[str, int]]:
        """(side, line) of the first notes of these kinds, prefill before decode, in file order."""
        out = [p for k in kinds for p in self._places.get(k, [])]
        return sorted(out, key=lambda p: (p[0] != "prefill", p[1]))[: self.places_per_kind]
