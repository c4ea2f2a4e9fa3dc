"""The request lifecycles' transition tables: every legal path walks, anything else is refused."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

import pytest

from kvfence.disagg.flight import FLIGHT_TRANSITIONS, FlightState
from kvfence.disagg.handoff import DECODE_TRANSITIONS, PREFILL_TRANSITIONS, DecodeState, PrefillState
from kvfence.disagg.lifecycle import IllegalTransition, Lifecycle, check_table

TABLES: dict[str, tuple[Mapping[Enum, frozenset[Enum]], Enum]] = {
    "flight": (FLIGHT_TRANSITIONS, FlightState.PREFILLING),  # type: ignore[dict-item]
    "decode request": (DECODE_TRANSITIONS, DecodeState.QUEUED),  # type: ignore[dict-item]
    "prefill request": (PREFILL_TRANSITIONS, PrefillState.COMPUTING),  # type: ignore[dict-item]
}


def paths(table: Mapping[Enum, frozenset[Enum]], start: Enum, seen: tuple[Enum, ...] = ()) -> list[list[Enum]]:
    """Every path from `start` to a final state that enters no state twice (a flight's retry goes back to
    PREFILLING: that edge is walked, not looped)."""
    if not table[start]:
        return [[start]]
    seen = (*seen, start)
    out: list[list[Enum]] = []
    for nxt in sorted(table[start], key=lambda s: s.value):
        if nxt in seen:
            continue
        out += [[start, *rest] for rest in paths(table, nxt, seen)]
    return out


def edges(table: Mapping[Enum, frozenset[Enum]]) -> set[tuple[Enum, Enum]]:
    return {(a, b) for a, nexts in table.items() for b in nexts}


@pytest.mark.parametrize("name", TABLES)
def test_table_names_every_state_and_only_its_own(name: str) -> None:
    table, _ = TABLES[name]
    check_table(table)  # raises on a missing state or a target outside the table


@pytest.mark.parametrize("name", TABLES)
def test_every_legal_path_walks_to_a_final_state(name: str) -> None:
    table, start = TABLES[name]
    all_paths = paths(table, start)
    assert all_paths
    for path in all_paths:
        lc = Lifecycle(name, start, table, clock=lambda: 0.0)
        for state in path[1:]:
            assert lc.can(state)
            lc.advance(state)
        assert lc.final and [s for s, _ in lc.history] == path
    reached = {s for p in all_paths for s in p}
    assert reached == set(table), f"unreachable: {set(table) - reached}"
    walked = {(a, b) for p in all_paths for a, b in zip(p, p[1:], strict=False)}
    back = edges(table) - walked  # edges back to a state already on the path: only a flight's retry
    assert all(b is FlightState.PREFILLING for _, b in back), back


@pytest.mark.parametrize("name", TABLES)
def test_every_transition_outside_the_table_is_refused(name: str) -> None:
    table, start = TABLES[name]
    for path in paths(table, start):
        for i, state in enumerate(path):
            for bad in set(table) - table[state]:
                lc = Lifecycle(name, start, table, clock=lambda: 0.0)
                for s in path[1 : i + 1]:
                    lc.advance(s)
                with pytest.raises(IllegalTransition, match=f"{name}: {state.value} -> {bad.value} is not allowed"):
                    lc.advance(bad)
                assert lc.state is state  # a refused step changes nothing


def test_the_router_flight_lifecycle() -> None:
    f = FlightState
    assert paths(FLIGHT_TRANSITIONS, f.PREFILLING) == [  # type: ignore[arg-type]
        [f.PREFILLING, f.DECODING, f.FAILING, f.FINISHED],
        [f.PREFILLING, f.DECODING, f.FINISHED],
        [f.PREFILLING, f.FAILING, f.FINISHED],
        [f.PREFILLING, f.FINISHED],
    ]
    lc = Lifecycle("flight r", f.PREFILLING, FLIGHT_TRANSITIONS, clock=lambda: 0.0)
    for state in (f.DECODING, f.PREFILLING, f.PREFILLING, f.FAILING):  # retried after its first token came
        lc.advance(state)
    with pytest.raises(IllegalTransition):  # a flight the router failed is never retried
        lc.advance(f.PREFILLING)


def test_a_finished_decode_request_never_comes_back() -> None:
    lc = Lifecycle("decode request r", DecodeState.QUEUED, DECODE_TRANSITIONS)
    lc.advance(DecodeState.FINISHED)
    with pytest.raises(IllegalTransition, match=r"allowed from finished: none \(final state\)"):
        lc.advance(DecodeState.RUNNING)


def test_check_table_refuses_a_table_missing_a_state() -> None:
    partial = {k: v for k, v in PREFILL_TRANSITIONS.items() if k is not PrefillState.AWAITING_VERDICT}
    with pytest.raises(IllegalTransition, match="misses"):
        check_table(partial)  # type: ignore[arg-type]


def test_a_flight_finished_by_the_event_loop_is_not_failed_again_by_the_receiver() -> None:
    import asyncio

    from kvfence.disagg import messages as P
    from kvfence.disagg.flight import Flight
    from kvfence.disagg.router import Router
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.integrity.record import IntegrityRecord

    router = Router(P.QueueHub())
    loop = asyncio.new_event_loop()
    try:
        flight = Flight("r", [1, 2], SamplingParams(), 2, "h", "f" * 32, loop, asyncio.Queue())
        record = IntegrityRecord("r", "failed", "aborted", "client gone", 2, 0, 0, role="router")
        router._finish(flight, record)
        router._fail_flight(flight, "router", "handoff deadline")  # the receiver thread, a moment too late
        assert flight.state is FlightState.FINISHED and flight.record == record
        assert router.integrity_counts == {"failed": 1}
        loop.run_until_complete(asyncio.sleep(0))
        assert flight.queue.empty()  # no second ending queued for the client
    finally:
        loop.close()
