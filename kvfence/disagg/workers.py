"""The workers a router serves from: who registered, whether each is up, the load each reports, and the pick.

What it knows: every accepted registration, keyed by worker id. The first one fixes the
deployment's identity (context length, page size, dtype, model fingerprint, layout
fingerprint, vocabulary, KV transfer backend); a later worker that differs in any of them
is refused with a message naming each difference and both workers, because every prefill
must be able to hand KV to every decode and the front end was built for that vocabulary.
Pool sizes may differ. Per worker: when it was last heard from, its last load report
(`WorkerStats`: free pages, running and waiting requests, queued prompt tokens), and the
orders the router sent it that no report covers yet. A report says how many orders
(`orders_seen`) the worker had handled when it was made, so orders after that are added
at the cost the router knows (prompt tokens for prefill, reserved pages for decode): a
burst of requests does not all land on the worker that looked idle 250 ms ago, and
nothing is estimated that the worker can tell.

The routing policy (docs/multihost.md, "Routing"):

* a **prefill** worker whose pool holds the prompt, with the fewest queued prompt tokens less the prompt tokens
  its prefix cache would save: a prompt whose leading full pages (same tokens, same `cache_salt`) last went to a
  worker that keeps a prefix cache goes there again while that worker's extra queue (over the least loaded's) is
  less than what its cache saves; each worker counts the leading pages up to the longest it computed
  (`prefix_keys`, `remember_prefix`; the router's `--no-prefix-affinity` turns this off);
* a **decode** worker whose pool holds prompt + max_tokens, preferring one whose free pages
  hold it now, then the fewest requests (running + waiting + handing off), then the most
  free pages;
* in both, a worker silent for longer than `suspect_after_s` is chosen only when no
  fresher one can take the request (it may be dead and not yet declared so); final ties go
  to the worker routed to least, then by id.

What it does not know: requests' progress (the router's flights), messages or sockets, or
time (callers pass `now`). Not thread-safe on its own: the router calls it under its lock.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvfence.disagg import messages as P
from kvfence.engine.admission import role_capacity
from kvfence.engine.engine_client import Capacity
from kvfence.errors import CapacityConfigError, KvfenceError
from kvfence.kv.prefix_cache import chain_keys
from kvfence.math_utils import cdiv
from kvfence.roles import WORKER_ROLES

ROLES = WORKER_ROLES  # prefill, decode
MAX_DOWN_ENTRIES = 32  # workers declared down that stay listed (metrics, server_info) until replaced

# What every worker of one deployment must agree on: (name, how to read it from a registration).
IDENTITY_FIELDS = (
    "context_length",
    "page_size",
    "dtype",
    "model_fingerprint",
    "layout_fingerprint",
    "vocab_size",
    "transfer_backend",
)


def identity_value(reg: P.Register, name: str) -> Any:
    if name == "transfer_backend":  # the workers still report it under the settings key "transport"
        return reg.settings.get("transport", "tcp")
    return getattr(reg, name)


class Difference(NamedTuple):
    setting: str
    this: Any  # the registering worker's value
    other: Any  # the deployment's value


def differences(reg: P.Register, reference: P.Register) -> list[Difference]:
    """Every identity setting on which `reg` differs from `reference`."""
    out = []
    for name in IDENTITY_FIELDS:
        a, b = identity_value(reg, name), identity_value(reference, name)
        if a != b:
            out.append(Difference(name, a, b))
    return out


def check_match(reg: P.Register, reference: P.Register) -> None:
    """Refuse `reg` unless it matches `reference` on every identity setting; the message names each difference."""
    diffs = differences(reg, reference)
    if diffs:
        detail = "; ".join(f"{d.setting}: {reg.worker_id}={d.this!r} {reference.worker_id}={d.other!r}" for d in diffs)
        raise CapacityConfigError(
            f"{reg.role} worker {reg.worker_id} does not match this deployment (set by {reference.role} worker "
            f"{reference.worker_id}): {detail}; start every worker with the same --model, --context-length, "
            "--page-size, --dtype and --transfer-backend"
        )


def check_registration(reg: P.Register, allow_context_above_pool: bool = False) -> None:
    """A worker of an unknown role, a pool of partial pages, or a context its pool cannot hold is refused (invariant
    6, docs/handoff.md)."""
    if reg.role not in ROLES:
        raise CapacityConfigError(f"worker {reg.worker_id} registered with unknown role {reg.role!r}")
    if reg.page_size <= 0 or reg.pool_tokens <= 0 or reg.pool_tokens % reg.page_size:
        raise CapacityConfigError(f"{reg.role}: pool of {reg.pool_tokens} tokens is not whole pages of {reg.page_size}")
    role_capacity(
        reg.role, reg.context_length, reg.pool_tokens // reg.page_size, reg.page_size, allow_context_above_pool
    )


class Order(NamedTuple):
    """An order the router sent a worker that no load report covers yet."""

    seq: int  # 1-based count of orders sent to this worker since it registered
    sent_at: float
    tokens: int  # prefill: prompt tokens to compute
    pages: int  # decode: pages it will reserve


# The leading pages of a prompt the router keys: every one of the first AFFINITY_PAGES, then every
# AFFINITY_STRIDE-th and the last full page, so a long shared prefix (a system prompt of many thousand tokens) is
# credited to within AFFINITY_STRIDE pages while a 64k-token prompt stores ~320 keys, not 4,000
AFFINITY_PAGES = 64
AFFINITY_STRIDE = 16
AFFINITY_KEYS = 1 << 17  # prefix keys it remembers (~20 MB at most)


class PrefixKey(NamedTuple):
    """One of a prompt's prefix keys (kv.prefix_cache.chain_keys) and the leading pages it names."""

    pages: int
    key: bytes


class Load(NamedTuple):
    """A worker's load as the router routes by it: its last report plus the orders sent since."""

    queued_prompt_tokens: int  # prefill: prompt tokens not yet prefilled
    free_pages: int  # decode: free pages minus what its queue and the orders in transit will reserve
    requests: int  # running + waiting + handing off + in transit


@dataclass
class WorkerEntry:
    reg: P.Register
    registered_at: float
    last_seen: float
    up: bool = True
    down_reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # the last WorkerStats payload
    orders_sent: int = 0
    in_transit: deque[Order] = field(default_factory=deque)
    routed: int = 0  # requests routed here since it registered

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    @property
    def role(self) -> str:
        return self.reg.role

    @property
    def pool_pages(self) -> int:
        return self.reg.pool_tokens // self.reg.page_size

    def load(self) -> Load:
        s, t = self.stats, self.in_transit
        tokens = int(s.get("queued_prompt_tokens", 0)) + sum(o.tokens for o in t)
        free = int(s.get("pages_free", self.pool_pages)) - int(s.get("pages_wanted", 0)) - sum(o.pages for o in t)
        busy = sum(int(s.get(k, 0)) for k in ("num_running", "num_waiting", "handoffs_in_flight"))
        return Load(tokens, free, busy + len(t))


class WorkerTable:
    """The registered workers of one router (see the module docstring for the routing policy)."""

    def __init__(self, suspect_after_s: float = 1.0, transit_timeout_s: float = 10.0) -> None:
        if not (suspect_after_s > 0 and transit_timeout_s > 0):
            raise KvfenceError(
                f"worker table: suspect_after_s {suspect_after_s} and transit_timeout_s {transit_timeout_s} must be > 0"
            )
        self.suspect_after_s = suspect_after_s
        self.transit_timeout_s = transit_timeout_s  # an order no report covers after this long is forgotten
        self.identity: P.Register | None = None  # the first accepted worker: what every other must match
        self.entries: dict[str, WorkerEntry] = {}
        self._max_pool: dict[str, int] = {}  # role -> largest pool of its up workers (kept while none is up)
        # prefix key (kv.prefix_cache.chain_keys of a prompt's leading pages) -> the prefill worker (id and process
        # instance: one restarted in its slot has an empty cache) that last computed it; least recently routed
        # first, at most AFFINITY_KEYS
        self._homes: OrderedDict[bytes, tuple[str, str]] = OrderedDict()

    # -- membership -------------------------------------------------------------------------------------------
    def check(self, reg: P.Register, allow_context_above_pool: bool = False) -> None:
        """Raise CapacityConfigError (naming the differences) unless `reg` may join."""
        check_registration(reg, allow_context_above_pool)
        if self.identity is not None:
            check_match(reg, self.identity)

    def add(self, reg: P.Register, now: float) -> WorkerEntry | None:
        """Accept `reg` (after `check`); returns the entry it replaces when that one was still up."""
        old = self.entries.pop(reg.worker_id, None)
        if self.identity is None:
            self.identity = reg
        self.entries[reg.worker_id] = WorkerEntry(reg, registered_at=now, last_seen=now)
        self._refresh_capacity()
        return old if old is not None and old.up else None

    def mark_down(self, worker_id: str, reason: str) -> WorkerEntry | None:
        """Take a worker out of routing; returns it (None when unknown or already down)."""
        e = self.entries.get(worker_id)
        if e is None or not e.up:
            return None
        e.up, e.down_reason, e.stats = False, reason, {}
        e.in_transit.clear()
        down = [w for w, x in self.entries.items() if not x.up]
        for w in down[:-MAX_DOWN_ENTRIES]:
            del self.entries[w]
        self._refresh_capacity()
        return e

    def get(self, worker_id: str) -> WorkerEntry | None:
        """The up worker `worker_id` (None for unknown or down ones)."""
        e = self.entries.get(worker_id)
        return e if e is not None and e.up else None

    def up(self, role: str | None = None) -> list[WorkerEntry]:
        return [e for e in self.entries.values() if e.up and (role is None or e.role == role)]

    def count(self, role: str) -> int:
        return len(self.up(role))

    # -- what workers tell ------------------------------------------------------------------------------------
    def heard(self, worker_id: str, now: float) -> None:
        e = self.get(worker_id)
        if e is not None:
            e.last_seen = now

    def report(self, worker_id: str, stats: dict[str, Any], now: float) -> None:
        """A load report: replaces the last one; orders it covers leave the in-transit list."""
        e = self.get(worker_id)
        if e is None:
            return
        e.stats = dict(stats)
        seen = stats.get("orders_seen")
        t = e.in_transit
        while t and ((seen is not None and t[0].seq <= int(seen)) or now - t[0].sent_at > self.transit_timeout_s):
            t.popleft()

    # -- routing ----------------------------------------------------------------------------------------------
    def _suspect(self, e: WorkerEntry, now: float) -> bool:
        return now - e.last_seen > self.suspect_after_s

    def pages_for(self, num_tokens: int) -> int:
        assert self.identity is not None
        return cdiv(num_tokens, self.identity.page_size)

    def pick_prefill(
        self, prompt_tokens: int, now: float, exclude: tuple[str, ...] = (), keys: Sequence[PrefixKey] = ()
    ) -> WorkerEntry | None:
        """The prefill worker a prompt of `prompt_tokens` goes to (None when no up worker's pool holds it); never one
        of `exclude`. `keys`: the prompt's `prefix_keys`. The fewest queued prompt tokens less those the worker's
        prefix cache should serve (`cached_tokens`), so a worker that computed the prompt's leading pages is taken
        while its extra queue over the least loaded worker's is below what its cache saves; where several workers
        hold some of the pages (one computed more of them than another), each counts its own."""
        fits = [e for e in self.up("prefill") if e.reg.pool_tokens >= prompt_tokens and e.worker_id not in exclude]
        homes = self._homes_of(keys)

        def key(e: WorkerEntry) -> tuple[Any, ...]:
            suspect, queued = self._suspect(e, now), e.load().queued_prompt_tokens
            saved = 0 if suspect else self._cached(e, homes)
            return (suspect, queued - saved, queued, e.routed, e.worker_id)  # a tie goes to the shorter queue

        return min(fits, key=key, default=None)

    def cached_tokens(self, e: WorkerEntry, keys: Sequence[PrefixKey]) -> int:
        """The prompt tokens `e`'s prefix cache should serve (the leading pages of `keys` up to the longest one last
        routed to it), or 0."""
        return self._cached(e, self._homes_of(keys))

    def _cached(self, e: WorkerEntry, homes: dict[tuple[str, str], int]) -> int:
        """cached_tokens, given `_homes_of(keys)` (looked up once per pick, not once per worker)."""
        if not e.stats.get("prefix_caching"):
            return 0
        assert self.identity is not None
        return homes.get((e.worker_id, e.reg.instance), 0) * self.identity.page_size

    def prefix_keys(self, cache_salt: str | None, token_ids: Sequence[int]) -> list[PrefixKey]:
        """The keys of a prompt's full pages that a prefix cache could serve (all but its last token's): the same
        keys the workers' caches use, each with the leading pages it names; every page up to AFFINITY_PAGES, then
        every AFFINITY_STRIDE-th and the last."""
        assert self.identity is not None
        page = self.identity.page_size
        n = (len(token_ids) - 1) // page
        try:
            keys = chain_keys(cache_salt, token_ids, page, n) if n > 0 else []
        except struct.error:  # an id outside int64 (no vocabulary to check it against): no worker caches it
            return []
        return [
            PrefixKey(i + 1, key)
            for i, key in enumerate(keys)
            if i < AFFINITY_PAGES or (i + 1) % AFFINITY_STRIDE == 0 or i == n - 1
        ]

    def remember_prefix(self, keys: Sequence[PrefixKey], e: WorkerEntry) -> None:
        """`e` computes the pages these keys name, and caches them if it keeps a prefix cache."""
        if not e.stats.get("prefix_caching"):
            return
        for _, key in keys:
            self._homes[key] = (e.worker_id, e.reg.instance)
            self._homes.move_to_end(key)
        while len(self._homes) > AFFINITY_KEYS:
            self._homes.popitem(last=False)

    def _homes_of(self, keys: Sequence[PrefixKey]) -> dict[tuple[str, str], int]:
        """Each worker (id, instance) that last computed one of `keys` -> how many leading pages its longest such key
        covers (a page's key names its whole prefix, so the worker computed those pages too)."""
        homes: dict[tuple[str, str], int] = {}
        for pages, key in reversed(keys):
            home = self._homes.get(key)
            if home is not None and home not in homes:
                homes[home] = pages
        return homes

    def pick_decode(self, need_tokens: int, now: float, exclude: tuple[str, ...] = ()) -> WorkerEntry | None:
        """The decode worker a request of `need_tokens` (prompt + max_tokens) goes to (None: no pool holds it); never
        one of `exclude`."""
        need = self.pages_for(need_tokens)

        def key(e: WorkerEntry) -> tuple[Any, ...]:
            load = e.load()
            fits_now = load.free_pages >= need
            return (self._suspect(e, now), not fits_now, load.requests, -load.free_pages, e.routed, e.worker_id)

        fits = (e for e in self.up("decode") if e.pool_pages >= need and e.worker_id not in exclude)
        return min(fits, key=key, default=None)

    def order(self, e: WorkerEntry, now: float, tokens: int = 0, pages: int = 0) -> None:
        """The router sent `e` an `Order` of this cost."""
        e.orders_sent += 1
        e.routed += 1
        e.in_transit.append(Order(e.orders_sent, now, tokens, pages))

    # -- what the front end may admit -------------------------------------------------------------------------
    def _refresh_capacity(self) -> None:
        for role in ROLES:
            pools = [e.reg.pool_tokens for e in self.up(role)]
            if pools:
                self._max_pool[role] = max(pools)

    def capacity(self) -> Capacity | None:
        """Context length and, per role, the largest pool an up worker has (None before any worker of each)."""
        if self.identity is None or any(r not in self._max_pool for r in ROLES):
            return None
        return Capacity(
            context_length=self.identity.context_length,
            max_total_tokens={r: self._max_pool[r] for r in ROLES},
            page_size=self.identity.page_size,
        )

    # -- numbers ----------------------------------------------------------------------------------------------
    def describe(self, now: float) -> dict[str, dict[str, Any]]:
        """Worker id -> what /server_info and /metrics show: role, up, pool, reported stats, routing load."""
        out: dict[str, dict[str, Any]] = {}
        for wid, e in self.entries.items():
            d: dict[str, Any] = {
                "role": e.role,
                "up": e.up,
                "max_total_tokens": e.reg.pool_tokens,
                "routed": e.routed,
                "silent_s": round(now - e.last_seen, 3),
            }
            if not e.up:
                d["down_reason"] = e.down_reason
            else:
                load = e.load()
                d.update(e.stats)
                d.update(
                    in_transit=len(e.in_transit),
                    load_queued_prompt_tokens=load.queued_prompt_tokens,
                    load_free_pages=load.free_pages,
                    load_requests=load.requests,
                )
            out[wid] = d
        return out
