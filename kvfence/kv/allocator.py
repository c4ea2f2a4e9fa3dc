"""Page allocator for one KV pool: who owns which page, and since when.

What it knows: a fixed number of pages; for each page its owner request id (or
none) and an epoch that is bumped on every allocation, so a stale reference to a
page (owner, epoch) can be told from a current one. Pages can be set aside in
quarantine (freed by their owner but not reusable until released, because a
transfer may still write into them). Paired verbs: `can_allocate` / `allocate` /
`free`; `transfer` hands pages to another owner (the prefix cache) and `free_pages` frees some pages of an
owner; `check()` asserts conservation (free + used + quarantined == total, no
page owned twice) and is called by tests after every scenario.

What it does not know: page contents (the pool), token positions (the request),
or when a quarantine may end (the handoff state machine decides).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class PageRef(NamedTuple):
    page: int
    epoch: int


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, num_pages
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._free_set: set[int] = set(range(num_pages))
        self.owner: list[str | None] = [None] * num_pages
        self.epoch: list[int] = [0] * num_pages
        # owner -> its pages, in allocation order (a dict as an ordered set: the prefix cache owns most of a big
        # pool and frees a few of them at a time, which must not cost a pass over all of them)
        self._owned: dict[str, dict[int, None]] = {}
        self._quarantine: dict[int, str] = {}  # page -> request id it was quarantined for

    # -- counters -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    @property
    def num_used(self) -> int:
        return sum(len(p) for p in self._owned.values())

    def pages_of(self, request_id: str) -> list[int]:
        return list(self._owned.get(request_id, ()))

    def owned_pages_of(self, request_id: str) -> list[int]:
        """The same as `pages_of` (a request's page table may also hold pages it reads but does not own)."""
        return self.pages_of(request_id)

    def refs_of(self, request_id: str) -> list[PageRef]:
        return [PageRef(p, self.epoch[p]) for p in self._owned.get(request_id, ())]

    def is_current(self, request_id: str, ref: PageRef) -> bool:
        return self.owner[ref.page] == request_id and self.epoch[ref.page] == ref.epoch

    # -- paired verbs ---------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Give `n` more pages to `request_id`; raises if not `can_allocate(n)`."""
        if not self.can_allocate(n):
            raise MemoryError(f"cannot allocate {n} pages: {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._free_set.discard(p)
            assert self.owner[p] is None, (p, self.owner[p])
            self.owner[p] = request_id
            self.epoch[p] += 1
        if pages:  # no empty entry for a zero-page allocation (it would never be dropped)
            self._owned.setdefault(request_id, {}).update(dict.fromkeys(pages))
        return pages

    def free(self, request_id: str) -> list[int]:
        """Return all pages of `request_id` to the free list; returns them."""
        pages = list(self._owned.pop(request_id, ()))
        for p in pages:
            assert self.owner[p] == request_id, (p, self.owner[p], request_id)
            self.owner[p] = None
            self._free.append(p)
            self._free_set.add(p)
        return pages

    def free_tail(self, request_id: str, keep: int) -> list[int]:
        """Keep the first `keep` pages of `request_id`, free the rest; returns the freed ones."""
        pages = self._owned.get(request_id, {})
        assert 0 <= keep <= len(pages), (keep, len(pages))
        tail = list(pages)[keep:]
        self._release(request_id, tail)
        for p in tail:
            self.owner[p] = None
            self._free.append(p)
            self._free_set.add(p)
        return tail

    def transfer(self, request_id: str, pages: list[int], new_owner: str) -> None:
        """Hand some pages of `request_id` to `new_owner` (same epoch: the content stays valid)."""
        self._release(request_id, pages)
        for p in pages:
            self.owner[p] = new_owner
        if pages:
            self._owned.setdefault(new_owner, {}).update(dict.fromkeys(pages))

    def free_pages(self, request_id: str, pages: list[int]) -> None:
        """Return some pages of `request_id` to the free list."""
        self._release(request_id, pages)
        for p in pages:
            self.owner[p] = None
            self._free.append(p)
            self._free_set.add(p)

    def _release(self, request_id: str, pages: list[int]) -> None:
        """Take `pages` (each owned by `request_id`, none twice) off its list: O(len(pages)), not O(its pages)."""
        owned = self._owned.get(request_id, {})
        assert len(set(pages)) == len(pages) and all(p in owned for p in pages), (pages, request_id)
        for p in pages:
            del owned[p]
        if not owned:
            self._owned.pop(request_id, None)

    def quarantine(self, request_id: str) -> list[int]:
        """Take all pages of `request_id` out of circulation until `release_quarantine`."""
        pages = list(self._owned.pop(request_id, ()))
        for p in pages:
            assert self.owner[p] == request_id, (p, self.owner[p], request_id)
            self.owner[p] = None
            self._quarantine[p] = request_id
        return pages

    def release_quarantine(self, request_id: str) -> list[int]:
        """Return the quarantined pages of `request_id` to the free list."""
        pages = [p for p, rid in self._quarantine.items() if rid == request_id]
        for p in pages:
            del self._quarantine[p]
            self._free.append(p)
            self._free_set.add(p)
        return pages

    # -- invariants -----------------------------------------------------------
    def check(self) -> None:
        """Conservation: every page is exactly one of free, owned or quarantined."""
        owned = [p for pages in self._owned.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(self._free) == len(self._free_set), "a page is on the free list twice"
        free, used, quar = self._free_set, set(owned), set(self._quarantine)
        assert not (free & used) and not (free & quar) and not (used & quar), "a page is in two states"
        assert len(free) + len(used) + len(quar) == self.num_pages, (
            f"conservation broken: free {len(free)} + used {len(used)} + quarantined {len(quar)} "
            f"!= total {self.num_pages}"
        )
        for rid, pages in self._owned.items():
            for p in pages:
                assert self.owner[p] == rid, (p, self.owner[p], rid)
        for p in free | quar:
            assert self.owner[p] is None, (p, self.owner[p])
