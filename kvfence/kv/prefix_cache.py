"""The prefix cache: full KV pages of computed token prefixes, shared by requests of the same tenant.

What it knows: for each cached page, its key, its content digest recorded when it was cached, and how many
requests read it (refcount); an LRU of the cached pages nobody reads, which are the only ones it may evict.
A page's key is a hash chain: key(0) hashes the tenant's `cache_salt` (None and "" are different tenants from
any salted one), key(i) hashes key(i - 1) and the ids of page i's tokens, so a key names the whole token
sequence from the start of the prompt up to the end of that page under that salt, never a page's own tokens
alone (no partial-hash hits). A hit is served only if the page's digest, computed now, equals the recorded one;
a page that fails is taken out of the index (freed once nobody reads it) and counted in `num_corrupt`, and the
match stops there, so the request recomputes from that page on.

Cached pages stay in the `PageAllocator`, owned by `CACHE_OWNER`, so the allocator's conservation check
(free + used + quarantined == total) still covers them; `check()` adds: the pages owned by `CACHE_OWNER` are
exactly the cached ones, every unreferenced one is on the LRU and no referenced one is.

What it does not know: requests or their page tables (the scheduler counts references and says when a request
stops reading), the model, or how a digest is computed (`digest` is given: integrity's page digest of the pool).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import xxhash

from kvfence.kv.allocator import PageAllocator

CACHE_OWNER = "\x00prefix-cache"  # the allocator owner of cached pages; no request id may be this
_KEY_DOMAIN = b"kvfence-prefix-cache-v1"


class PrefixMatch(NamedTuple):
    pages: list[int]  # cached pages of the prefix, in order; the caller now holds one reference to each
    num_corrupt: int  # pages whose digest no longer matched (dropped; the match stopped at the first)
    key: bytes | None  # the chain key of the last page in `pages` (None when there is none), for `insert`


def iter_chain_keys(
    cache_salt: str | None, token_ids: Sequence[int], page_size: int, num_pages: int, first: int = 0,
    prev: bytes | None = None,
) -> Iterator[bytes]:  # fmt: skip
    """Keys of full pages `first .. num_pages - 1` of `token_ids` under `cache_salt` (xxh3-128 hash chain), made
    as they are read. `prev`: the key of page `first - 1` (given exactly when first > 0), so that a request whose
    pages are cached a chunk at a time hashes each page once, not its whole prefix again at every chunk."""
    assert num_pages * page_size <= len(token_ids), (num_pages, page_size, len(token_ids))
    if (prev is None) != (first == 0):  # not an assert: a chain restarted mid-prompt would key other prompts' pages
        raise ValueError(f"a chain from page {first} needs the key of page {first - 1} (prev), and only then")
    if prev is None:
        salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
        prev = xxhash.xxh3_128_digest(_KEY_DOMAIN + len(salt).to_bytes(8, "little") + salt)
    key, page = prev, struct.Struct(f"<{page_size}q")  # little-endian int64 ids; no numpy: the router keys too
    for i in range(first, num_pages):
        key = xxhash.xxh3_128_digest(key + page.pack(*token_ids[i * page_size : (i + 1) * page_size]))
        yield key


def chain_keys(cache_salt: str | None, token_ids: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """Keys of the first `num_pages` full pages of `token_ids` under `cache_salt`."""
    return list(iter_chain_keys(cache_salt, token_ids, page_size, num_pages))


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, digest: Callable[[Sequence[int]], list[int]]) -> None:
        """`digest(pages)`: the content digest of each page, in order (same function when cached and reused)."""
        self.allocator = allocator
        self.page_size = page_size
        self.digest = digest
        self._index: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # page -> key (indexed pages only)
        self._digest_of: dict[int, int] = {}  # page -> digest recorded when it was cached
        self._refs: dict[int, int] = {}  # every page owned by CACHE_OWNER -> requests reading it
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recently used first
        self.num_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hits = 0  # of those, tokens served from the cache (vLLM's prefix_cache_hits)
        self.num_corrupt = 0  # cached pages whose digest no longer matched when reused
        self.num_evicted = 0
        # called with pages just before they go back to the allocator (strict mode poisons them, as it does a
        # request's own pages when they are freed); None: freed as they are
        self.before_free: Callable[[Sequence[int]], None] | None = None

    # -- counters -------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._refs

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    # -- paired verbs ---------------------------------------------------------
    def match(self, cache_salt: str | None, token_ids: Sequence[int], max_pages: int) -> PrefixMatch:
        """The longest cached prefix of `token_ids` (at most `max_pages` pages) whose digests still match;
        takes a reference to each page returned (give them back with `release`)."""
        if max_pages <= 0 or not self._index:
            return PrefixMatch([], 0, None)
        candidates: list[int] = []
        keys: list[bytes] = []
        for key in iter_chain_keys(cache_salt, token_ids, self.page_size, max_pages):  # up to the first miss
            page = self._index.get(key)
            if page is None:
                break
            candidates.append(page)
            keys.append(key)
        if not candidates:
            return PrefixMatch([], 0, None)
        now = self.digest(candidates)
        pages: list[int] = []
        num_corrupt = 0
        for page, d in zip(candidates, now, strict=True):
            if d != self._digest_of[page]:
                self._drop(page)
                num_corrupt = 1
                break
            pages.append(page)
        for page in pages:
            self._acquire(page)
        self.num_corrupt += num_corrupt
        return PrefixMatch(pages, num_corrupt, keys[len(pages) - 1] if pages else None)

    def insert(self, request_id: str, cache_salt: str | None, token_ids: Sequence[int], page_table: Sequence[int],
               first: int, num_full: int, prev: bytes | None) -> bytes | None:  # fmt: skip
        """Cache pages `first .. num_full - 1` of a request: full pages whose tokens are all computed. `prev`: the
        chain key of page `first - 1` (this call's return value the time before, or the match's key; None when
        first is 0). Returns the key of page `num_full - 1`, for the next call.

        A page the request owns moves to `CACHE_OWNER` and the request keeps one reference to it; a page already
        cached (the request matched it) or whose key another page holds stays as it is."""
        if num_full <= first:
            return prev
        keys = list(iter_chain_keys(cache_salt, token_ids, self.page_size, num_full, first, prev))
        owner = self.allocator.owner
        new = [
            (key, page_table[i])
            for i, key in enumerate(keys, start=first)
            if key not in self._index and owner[page_table[i]] == request_id
        ]
        if not new:
            return keys[-1]
        pages = [p for _, p in new]
        self.allocator.transfer(request_id, pages, CACHE_OWNER)
        for (key, page), d in zip(new, self.digest(pages), strict=True):
            self._index[key] = page
            self._key_of[page] = key
            self._digest_of[page] = d
            self._refs[page] = 1
        return keys[-1]

    def release(self, pages: Sequence[int]) -> None:
        """A request stops reading `pages` (its page table; pages that are not cached are skipped)."""
        for page in pages:
            if page not in self._refs:
                continue
            self._refs[page] -= 1
            assert self._refs[page] >= 0, page
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._lru[page] = None
                else:  # dropped while read: nobody can reach it any more
                    self._free([page])

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unreferenced cached pages, least recently used first; returns how many."""
        pages: list[int] = []
        while len(pages) < num_pages and self._lru:
            page, _ = self._lru.popitem(last=False)
            self._unindex(page)
            pages.append(page)
        self._free(pages)
        self.num_evicted += len(pages)
        return len(pages)

    def clear(self) -> int:
        """Evict every unreferenced cached page (referenced ones stay until released); returns how many."""
        return self.evict(len(self._lru))

    # -- internals ------------------------------------------------------------
    def _acquire(self, page: int) -> None:
        self._refs[page] += 1
        self._lru.pop(page, None)

    def _unindex(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._index[key]
        del self._digest_of[page]

    def _drop(self, page: int) -> None:
        """Take a page whose content changed out of the index; it is freed now or when its last reader stops."""
        self._unindex(page)
        if self._refs[page] == 0:
            self._lru.pop(page, None)
            self._free([page])

    def _free(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.before_free is not None:
            self.before_free(pages)
        for page in pages:
            del self._refs[page]
        self.allocator.free_pages(CACHE_OWNER, pages)

    # -- invariants -----------------------------------------------------------
    def check(self) -> None:
        """The allocator's pages of CACHE_OWNER are exactly the cached ones; the LRU is the unreferenced ones."""
        owned = self.allocator.pages_of(CACHE_OWNER)
        assert len(owned) == len(set(owned)) and set(owned) == set(self._refs), (sorted(owned), sorted(self._refs))
        assert set(self._lru) == {p for p, r in self._refs.items() if r == 0}, "LRU is not the unreferenced pages"
        assert all(r >= 0 for r in self._refs.values()), self._refs
        assert set(self._lru) <= set(self._key_of), "an unreferenced page that nobody can reach was not freed"
        assert len(self._index) == len(self._key_of) == len(self._digest_of), "index out of step"
        for key, page in self._index.items():
            assert self._key_of[page] == key, (page, key)
