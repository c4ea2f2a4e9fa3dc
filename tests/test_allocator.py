"""PageAllocator: one behaviour per unit test, then random operation sequences against a simple model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.kv.allocator import PageAllocator, PageRef


def test_fresh_allocator_has_every_page_free() -> None:
    a = PageAllocator(8)
    a.check()
    assert (a.num_free, a.num_used, a.num_quarantined) == (8, 0, 0)


def test_allocate_gives_distinct_pages_owned_by_the_request() -> None:
    a = PageAllocator(8)
    pages = a.allocate("r1", 3)
    assert len(set(pages)) == 3
    assert all(a.owner[p] == "r1" for p in pages)
    assert a.pages_of("r1") == pages
    assert (a.num_free, a.num_used) == (5, 3)
    a.check()


def test_allocate_appends_to_existing_pages_in_order() -> None:
    a = PageAllocator(8)
    first = a.allocate("r1", 2)
    second = a.allocate("r1", 1)
    assert a.pages_of("r1") == first + second


def test_can_allocate_bounds() -> None:
    a = PageAllocator(4)
    assert a.can_allocate(0) and a.can_allocate(4)
    assert not a.can_allocate(5) and not a.can_allocate(-1)
    a.allocate("r1", 3)
    assert a.can_allocate(1) and not a.can_allocate(2)


def test_allocate_beyond_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(4)
    a.allocate("r1", 3)
    with pytest.raises(MemoryError, match="cannot allocate 2 pages: 1 free of 4"):
        a.allocate("r2", 2)
    assert a.pages_of("r2") == [] and a.num_free == 1
    a.check()


def test_free_returns_all_pages_of_the_request_only() -> None:
    a = PageAllocator(8)
    p1 = a.allocate("r1", 3)
    p2 = a.allocate("r2", 2)
    assert a.free("r1") == p1
    assert a.pages_of("r1") == [] and a.pages_of("r2") == p2
    assert all(a.owner[p] is None for p in p1)
    assert a.num_free == 6
    a.check()


def test_free_of_unknown_request_is_a_no_op() -> None:
    a = PageAllocator(4)
    assert a.free("nobody") == []
    assert a.num_free == 4


def test_free_tail_keeps_the_first_pages() -> None:
    a = PageAllocator(8)
    pages = a.allocate("r1", 5)
    assert a.free_tail("r1", 2) == pages[2:]
    assert a.pages_of("r1") == pages[:2]
    assert a.num_free == 6
    a.check()


def test_free_tail_to_zero_forgets_the_request() -> None:
    a = PageAllocator(4)
    pages = a.allocate("r1", 2)
    assert a.free_tail("r1", 0) == pages
    assert a.pages_of("r1") == [] and a.num_used == 0
    a.check()


def test_free_tail_with_keep_beyond_owned_asserts() -> None:
    a = PageAllocator(4)
    a.allocate("r1", 2)
    with pytest.raises(AssertionError):
        a.free_tail("r1", 3)


def test_quarantined_pages_are_not_reusable_until_released() -> None:
    a = PageAllocator(4)
    pages = a.allocate("r1", 3)
    assert a.quarantine("r1") == pages
    assert (a.num_free, a.num_used, a.num_quarantined) == (1, 0, 3)
    assert not a.can_allocate(2)
    a.check()
    assert sorted(a.release_quarantine("r1")) == sorted(pages)
    assert (a.num_free, a.num_quarantined) == (4, 0)
    a.check()


def test_release_quarantine_only_touches_that_request() -> None:
    a = PageAllocator(6)
    a.allocate("r1", 2)
    p2 = a.allocate("r2", 2)
    a.quarantine("r1")
    a.quarantine("r2")
    a.release_quarantine("r1")
    assert a.num_quarantined == 2 and a.num_free == 4
    assert sorted(a.release_quarantine("r2")) == sorted(p2)
    a.check()


def test_freed_pages_are_reused_last_first_in_first_out() -> None:
    a = PageAllocator(4)
    p = a.allocate("r1", 2)
    a.free("r1")
    # two never-used pages come before the two just freed
    nxt = a.allocate("r2", 4)
    assert nxt[2:] == p


def test_epoch_grows_on_every_allocation_and_stale_refs_are_detected() -> None:
    a = PageAllocator(1)
    (page,) = a.allocate("r1", 1)
    ref = a.refs_of("r1")[0]
    assert ref == PageRef(page, a.epoch[page]) and a.is_current("r1", ref)
    a.free("r1")
    assert not a.is_current("r1", ref)
    a.allocate("r1", 1)  # same owner, same page, later epoch: the old ref is still stale
    assert a.epoch[page] == ref.epoch + 1
    assert not a.is_current("r1", ref)


def test_allocating_zero_pages_leaves_no_trace() -> None:
    a = PageAllocator(4)
    assert a.allocate("r1", 0) == []
    assert a.pages_of("r1") == [] and a.num_used == 0
    assert "r1" not in a._owned  # no empty bookkeeping entry left behind for the id
    a.check()


def test_freeing_a_page_twice_or_one_owned_by_another_is_refused() -> None:
    a = PageAllocator(4)
    mine, theirs = a.allocate("r1", 2), a.allocate("r2", 1)
    with pytest.raises(AssertionError):
        a.free_pages("r1", [mine[0], mine[0]])
    with pytest.raises(AssertionError):
        a.transfer("r1", theirs, "cache")
    assert a.pages_of("r1") == mine and a.pages_of("r2") == theirs  # refused before anything moved
    a.check()


def test_check_detects_a_page_owned_and_free() -> None:
    a = PageAllocator(4)
    pages = a.allocate("r1", 1)
    a._free.append(pages[0])  # corrupt on purpose
    a._free_set.add(pages[0])
    with pytest.raises(AssertionError):
        a.check()


# --- property test: random operation sequences vs a plain model -------------------------------------------

_IDS = ["a", "b", "c", "d"]
_CACHE = "cache"  # an owner that only receives pages (as the prefix cache does) and frees some of them
_op = st.one_of(
    st.tuples(st.just("allocate"), st.sampled_from(_IDS), st.integers(0, 6)),
    st.tuples(st.just("free"), st.sampled_from(_IDS), st.just(0)),
    st.tuples(st.just("free_tail"), st.sampled_from(_IDS), st.integers(0, 6)),
    st.tuples(st.just("quarantine"), st.sampled_from(_IDS), st.just(0)),
    st.tuples(st.just("release"), st.sampled_from(_IDS), st.just(0)),
    st.tuples(st.just("abort"), st.sampled_from(_IDS), st.just(0)),  # abort = free owned + release quarantine
    st.tuples(st.just("transfer"), st.sampled_from(_IDS), st.integers(0, 6)),  # some pages to the cache owner
    st.tuples(st.just("free_pages"), st.just(_CACHE), st.integers(0, 6)),  # some of the cache owner's freed
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 12), ops=st.lists(_op, max_size=60))
def test_random_sequences_keep_conservation_and_match_model(num_pages: int, ops: list[tuple[str, str, int]]) -> None:
    a = PageAllocator(num_pages)
    owned: dict[str, list[int]] = {}
    quarantined: dict[str, set[int]] = {}
    free = set(range(num_pages))
    for op, rid, n in ops:
        if op == "allocate":
            if n <= len(free):
                pages = a.allocate(rid, n)
                assert len(pages) == n and set(pages) <= free
                free -= set(pages)
                owned.setdefault(rid, []).extend(pages)
            else:
                assert not a.can_allocate(n)
                with pytest.raises(MemoryError):
                    a.allocate(rid, n)
        elif op == "free":
            got = a.free(rid)
            assert got == owned.pop(rid, [])
            free |= set(got)
        elif op == "free_tail":
            mine = owned.get(rid, [])
            keep = min(n, len(mine))
            got = a.free_tail(rid, keep)
            assert got == mine[keep:]
            del mine[keep:]
            free |= set(got)
        elif op == "quarantine":
            got = a.quarantine(rid)
            assert got == owned.pop(rid, [])
            quarantined.setdefault(rid, set()).update(got)
        elif op == "release":
            got = a.release_quarantine(rid)
            assert set(got) == quarantined.pop(rid, set())
            free |= set(got)
        elif op == "transfer":  # every other page, from the second, at most n: not a prefix or a suffix
            moving = owned.get(rid, [])[1::2][:n]
            a.transfer(rid, moving, _CACHE)
            owned[rid] = [p for p in owned.get(rid, []) if p not in moving]
            owned.setdefault(_CACHE, []).extend(moving)
        elif op == "free_pages":
            gone = owned.get(_CACHE, [])[::-2][:n]  # from the end, every other one
            a.free_pages(_CACHE, gone)
            owned[_CACHE] = [p for p in owned.get(_CACHE, []) if p not in gone]
            free |= set(gone)
        else:  # abort
            got = a.free(rid) + a.release_quarantine(rid)
            expect = owned.pop(rid, []) + sorted(quarantined.pop(rid, set()))
            assert sorted(got) == sorted(expect)
            free |= set(got)
        owned = {k: v for k, v in owned.items() if v}
        a.check()
        assert a.num_free == len(free)
        assert a.num_used == sum(len(v) for v in owned.values())
        assert a.num_quarantined == sum(len(v) for v in quarantined.values())
        for r in [*_IDS, _CACHE]:
            assert a.pages_of(r) == owned.get(r, [])  # in the order they came
        for p in range(num_pages):
            expect_owner = next((r for r, v in owned.items() if p in v), None)
            assert a.owner[p] == expect_owner
