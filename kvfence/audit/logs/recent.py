"""A map that remembers its most recent keys only: per-request state kept while a request can still be open.

What it knows: two generations of plain dicts; a key goes into the young one, and when that holds `half` keys the
old generation is dropped whole and the young one becomes old. So at most 2 * half keys are held, every key
written within the last `half` insertions is still there, lookups and insertions are O(1), and nothing is
evicted one key at a time. The log scanner keys requests by rid or bootstrap room; a request's lines lie within
far fewer than `half` other requests' lines (its lifetime), so forgetting older ones loses nothing it needs.
What it does not know: what the values are.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

DEFAULT_HALF = 1 << 16


class Recent(Generic[K, V]):
    def __init__(self, half: int = DEFAULT_HALF) -> None:
        assert half > 0
        self.half = half
        self._young: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        v = self._young.get(key)
        if v is None:
            v = self._old.get(key)
        return v

    def __contains__(self, key: K) -> bool:
        return key in self._young or key in self._old

    def put(self, key: K, value: V) -> None:
        young = self._young
        if key not in young and len(young) >= self.half:
            self._old, self._young = young, {}
            young = self._young
        young[key] = value

    def known(self, keys: set[K]) -> set[K]:
        """Those of `keys` it holds (one comprehension: no method call per key)."""
        young, old = self._young, self._old
        return {k for k in keys if k in young or k in old}

    def add_new(self, keys: list[K]) -> int:
        """Record these keys (values True); return how many distinct ones it did not hold."""
        young, old = self._young, self._old
        new = [k for k in set(keys) if k not in young and k not in old]
        if new:
            self.put_many(dict.fromkeys(new, True))  # type: ignore[arg-type]
        return len(new)

    def put_many(self, items: Mapping[K, V]) -> None:
        """put() for many new keys at once."""
        if len(self._young) + len(items) > self.half:
            self._old, self._young = self._young, {}
        self._young.update(items)

    def pop(self, key: K) -> V | None:
        v = self._young.pop(key, None)
        old = self._old.pop(key, None)
        return v if v is not None else old

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __bool__(self) -> bool:
        return bool(self._young) or bool(self._old)
