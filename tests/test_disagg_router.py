"""Router start-up rules and the control-plane channels, without a model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from kvfence.auth.curve import CurveKeys
from kvfence.auth.keys import ClusterKey
from kvfence.commands.worker_main import parse_faults
from kvfence.disagg import messages as P
from kvfence.disagg.registration import check_pair
from kvfence.disagg.router import Router, RouterConfig
from kvfence.disagg.workers import check_registration
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError, KvfenceError
from kvfence.integrity.digest import token_hash
from tests.helpers.clock import ManualClock, advance_until_dead


def reg(role: str, **over: object) -> P.Register:
    base = dict(
        role=role,
        worker_id=f"{role}-0",
        model_name="tiny",
        model_fingerprint="m" * 16,
        context_length=256,
        pool_tokens=512,
        page_size=16,
        dtype="float32",
        layout_fingerprint="l" * 16,
        layout={"architecture": "LlamaForCausalLM"},
        handoff_address="tcp://127.0.0.1:1" if role == "decode" else "",
    )
    base.update(over)
    return P.Register(**base)  # type: ignore[arg-type]


def test_messages_round_trip_through_msgpack() -> None:
    msgs = [
        reg("decode"),
        P.Order("r1", [1, 2, 3], "f" * 32, {"max_tokens": 4}, tokens_expected=3, token_hash="abcd"),
        P.Tokens("r1", [7], text=None, logprobs=[[7, float("-inf"), []]]),  # -inf survives (JSON has no -inf)
        P.Tokens("r1", [7, 8], text="hi", finished=True, finish_reason="length", integrity={"status": "verified"}),
        P.Abort("r1", "client gone"),
        P.Shutdown(),
    ]
    for m in msgs:
        assert P.decode(P.encode(m)) == m
    with pytest.raises(P.WireError, match="control message"):
        P.decode(msgspec.msgpack.encode({"kind": "nope"}))


def test_sampling_params_survive_the_wire() -> None:
    sp = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("xy",), stop_token_ids=(4,))
    assert (
        P.params_from_wire(
            P.decode(P.encode(P.Order("r", [1], "f" * 32, P.params_to_wire(sp), decode_address="tcp://d:1"))).params
        )
        == sp
    )


@pytest.mark.parametrize(
    ("field", "p_value", "d_value"),
    [
        ("context_length", 256, 512),
        ("page_size", 16, 32),
        ("dtype", "float32", "bfloat16"),
        ("layout_fingerprint", "a" * 16, "b" * 16),
        ("model_fingerprint", "c" * 16, "d" * 16),
        ("vocab_size", 2048, 4096),
    ],
)
def test_pair_with_different_settings_is_refused_naming_both_values(
    field: str, p_value: object, d_value: object
) -> None:
    with pytest.raises(CapacityConfigError) as e:
        check_pair(reg("prefill", **{field: p_value}), reg("decode", **{field: d_value}))
    msg = str(e.value)
    assert f"{field}: decode-0={d_value!r} prefill-0={p_value!r}" in msg, msg


def test_matching_pair_is_accepted() -> None:
    check_pair(reg("prefill"), reg("decode", pool_tokens=4096))  # pools may differ


def test_role_whose_context_exceeds_its_pool_is_refused() -> None:
    with pytest.raises(CapacityConfigError, match=r"context length 1024 .* 512 tokens"):
        check_registration(reg("decode", context_length=1024, pool_tokens=512))
    check_registration(reg("decode", context_length=512, pool_tokens=512))


def test_router_refuses_a_mismatched_worker_tells_it_why_and_keeps_waiting() -> None:
    hub = P.QueueHub()
    pc, dc, good = hub.connect("prefill-0"), hub.connect("decode-0"), hub.connect("decode-1")
    pc.send(reg("prefill", page_size=16))
    dc.send(reg("decode", page_size=32))
    router = Router(hub, RouterConfig(register_timeout_s=5))
    good.send(reg("decode", worker_id="decode-1"))  # a matching decode after the refused one: served
    router.wait_for_workers()
    reply = dc.recv(timeout=1)
    assert isinstance(reply, P.RegisterReply) and not reply.accepted
    assert "page_size: decode-0=32 prefill-0=16" in reply.reason, reply.reason
    for ch in (pc, good):
        reply = ch.recv(timeout=1)
        assert isinstance(reply, P.RegisterReply) and reply.accepted
    assert [e.worker_id for e in router.workers.up("decode")] == ["decode-1"]


def test_router_gives_up_naming_the_refusals_when_no_worker_of_a_role_matches() -> None:
    hub = P.QueueHub()
    hub.connect("prefill-0").send(reg("prefill", model_fingerprint="a" * 16))
    hub.connect("decode-0").send(reg("decode", model_fingerprint="b" * 16))
    with pytest.raises(CapacityConfigError, match=r"registered within 0.5s \(refused: decode-0: .*model_finger"):
        Router(hub, RouterConfig(register_timeout_s=0.5)).wait_for_workers()


def test_router_accepts_a_pair_and_reports_capacity_per_role() -> None:
    hub = P.QueueHub()
    pc, dc = hub.connect("prefill-0"), hub.connect("decode-0")
    pc.send(reg("prefill", pool_tokens=256))
    dc.send(reg("decode", pool_tokens=1024))
    router = Router(hub, RouterConfig(register_timeout_s=5))
    router.wait_for_workers()
    cap = router.capacity()
    assert cap.context_length == 256 and cap.page_size == 16
    assert cap.max_total_tokens == {"prefill": 256, "decode": 1024}
    assert isinstance(pc.recv(timeout=1), P.RegisterReply) and isinstance(dc.recv(timeout=1), P.RegisterReply)
    info = router.server_info()
    assert info["roles"]["decode"]["max_total_tokens"] == 1024 and info["mode"] == "disaggregated"
    assert info["workers"]["decode-0"]["handoff_address"] == "tcp://127.0.0.1:1"


def test_router_times_out_when_a_role_never_registers() -> None:
    hub = P.QueueHub()
    hub.connect("prefill-0").send(reg("prefill"))
    with pytest.raises(CapacityConfigError, match="no decode worker registered"):
        Router(hub, RouterConfig(register_timeout_s=0.3)).wait_for_workers()


# -- many workers: routing by reported load, health, re-registration (fake workers on queues) ----------------


class FakeWorker:
    """A registered worker that reports the load it is given and keeps every message the router sends it."""

    def __init__(self, hub: P.QueueHub, registration: P.Register) -> None:
        self.id = registration.worker_id
        self.registration = registration
        self.channel = hub.connect(self.id, replace=True)
        self.load: dict[str, Any] = {}
        self.orders = 0
        self.frozen = False  # True: its reports go on saying the orders it had seen when this was set
        self.inbox: list[P.Message] = []
        self.silent = threading.Event()  # set: it stops answering (hung or dead); see `silence`
        self._hushed = threading.Event()  # its thread saw `silent`: nothing more will be sent
        self._stop = threading.Event()
        self.channel.send(registration)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            msg = self.channel.recv(timeout=0.01)
            if self.silent.is_set():
                self._hushed.set()  # a send of an iteration that began before `silent` has finished by now
                continue
            if msg is not None:
                self.inbox.append(msg)
                self.orders += isinstance(msg, P.Order) and not self.frozen
            if time.monotonic() - last > 0.05:
                last = time.monotonic()
                self.channel.send(P.WorkerStats(self.registration.role, {**self.load, "orders_seen": self.orders}))

    def report(self, router: Router, **load: Any) -> None:
        """Publish `load` and wait until the router has it, with every order so far covered."""
        self.load = load
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            w = router.stats()["workers"].get(self.id, {})
            if all(w.get(k) == v for k, v in load.items()) and w.get("in_transit") == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"{self.id}: the router never saw {load}")

    def silence(self) -> None:
        """Stop answering (hung or dead); returns once nothing more will come from this worker."""
        self.silent.set()
        assert self._hushed.wait(5), f"{self.id} did not go quiet"

    def got(self, kind: type[P.Message]) -> list[Any]:
        return [m for m in list(self.inbox) if isinstance(m, kind)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def eventually(cond: Callable[[], Any], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def idle(pages: int) -> dict[str, int]:
    return {"pages_total": pages, "pages_free": pages, "pages_used": 0, "num_running": 0, "num_waiting": 0}


class Fleet:
    """A router serving fake workers; `submit` starts a request (`decode_of`/`prefill_of`: the pair it went to).

    The router runs on a `ManualClock`: no worker is ever judged silent (nor an order in transit
    forgotten) because a loaded machine starved its thread, only when a test silences it and
    moves the clock (`silence_until_dead`).
    """

    def __init__(self, workers: list[P.Register], **config: Any) -> None:
        self.hub = P.QueueHub()
        self.workers = {r.worker_id: FakeWorker(self.hub, r) for r in workers}
        roles = [r.role for r in workers]
        config = {"register_timeout_s": 5, "worker_timeout_s": 0.6, "heartbeat_interval_s": 0.05, **config}
        config.setdefault("wait_prefill_workers", roles.count("prefill"))
        config.setdefault("wait_decode_workers", roles.count("decode"))
        self.clock = ManualClock()
        self.router = Router(self.hub, RouterConfig(**config), clock=self.clock)
        self.router.wait_for_workers()
        self.router.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.results: dict[str, Any] = {}

    def submit(
        self, rid: str, prompt_len: int = 20, max_tokens: int = 10, prompt: list[int] | None = None, **params: Any
    ) -> None:
        async def run() -> list[Any]:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
            return [c async for c in self.router.generate(rid, prompt or [5] * prompt_len, sp)]

        self.results[rid] = asyncio.run_coroutine_threadsafe(run(), self.loop)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.router._flights.get(rid) is not None or self.results[rid].done():
                return
            time.sleep(0.002)
        raise AssertionError(f"{rid} was never admitted")

    def decode_of(self, rid: str) -> str:
        flight = self.router._flights.get(rid)
        assert flight is not None, f"{rid} is no longer in flight: {self.results[rid]}"
        return flight.decode_id

    def silence_until_dead(self, wid: str) -> float:
        """`wid` stops answering; the router's clock moves (the others still heard) until it is declared dead.
        Returns how long it was silent on that clock."""
        self.workers[wid].silence()
        return advance_until_dead(self.router, self.clock, wid, step=0.125)

    def orders(self, wire_id: str) -> dict[str, P.Order]:
        """Every order for `wire_id`, by the worker that got it."""
        return {w.id: m for w in self.workers.values() for m in w.got(P.Order) if m.request_id == wire_id}

    def prefill_of(self, rid: str) -> str:
        """The prefill worker `rid`'s order went to (once it got it)."""
        eventually(lambda: any(w.startswith("prefill") for w in self.orders(rid)))
        return next(w for w in self.orders(rid) if w.startswith("prefill"))

    def close(self) -> None:
        self.router.close()
        for w in self.workers.values():
            w.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fleet_of() -> Iterator[Callable[..., Fleet]]:
    fleets: list[Fleet] = []

    def make(workers: list[P.Register], **config: Any) -> Fleet:
        fleets.append(Fleet(workers, **config))
        return fleets[-1]

    yield make
    for f in fleets:
        f.close()


def two_by_two(**over: Any) -> list[P.Register]:
    return [
        reg("prefill", worker_id="prefill-0"),
        reg("prefill", worker_id="prefill-1"),
        reg("decode", worker_id="decode-0", **over),
        reg("decode", worker_id="decode-1", **over),
    ]


def test_decode_is_picked_by_reported_free_pages_then_running_requests(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(two_by_two())
    d0, d1 = fleet.workers["decode-0"], fleet.workers["decode-1"]
    d0.report(fleet.router, **{**idle(32), "pages_free": 1})  # 1 free page: cannot hold 30 tokens now
    d1.report(fleet.router, **{**idle(32), "num_running": 6, "pages_free": 20})
    fleet.submit("a", prompt_len=20, max_tokens=10)
    assert fleet.decode_of("a") == "decode-1"  # the one whose free pages hold it, however busy
    d0.report(fleet.router, **{**idle(32), "num_running": 1})
    d1.report(fleet.router, **{**idle(32), "num_running": 4})
    fleet.submit("b")
    assert fleet.decode_of("b") == "decode-0"  # both can hold it: the one with fewer requests


def test_a_burst_before_any_new_report_is_spread_by_the_orders_in_transit(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(two_by_two())
    fleet.workers["decode-0"].report(fleet.router, **idle(32))
    fleet.workers["decode-1"].report(fleet.router, **{**idle(32), "num_running": 2})
    for d in ("decode-0", "decode-1"):
        fleet.workers[d].frozen = True  # its reports cover no new order: only the router's own count tells
    picked = []
    for i in range(6):
        fleet.submit(f"r{i}")
        picked.append(fleet.decode_of(f"r{i}"))
    # decode-0 looked idle, decode-1 had 2 running: decode-0 takes two, then they alternate
    assert picked == ["decode-0", "decode-0", "decode-1", "decode-0", "decode-1", "decode-0"], picked


def test_prefill_is_picked_by_reported_queued_prompt_tokens(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(two_by_two())
    fleet.workers["prefill-0"].report(fleet.router, **idle(32), queued_prompt_tokens=400)
    fleet.workers["prefill-1"].report(fleet.router, **idle(32), queued_prompt_tokens=30)
    fleet.submit("a", prompt_len=20)
    assert fleet.prefill_of("a") == "prefill-1"
    fleet.workers["prefill-1"].report(fleet.router, **idle(32), queued_prompt_tokens=900)
    fleet.submit("b", prompt_len=20)
    assert fleet.prefill_of("b") == "prefill-0"


def test_both_orders_go_out_at_once_each_with_only_what_its_worker_needs(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of([reg("prefill"), reg("decode"), reg("decode", worker_id="decode-1", handoff_address="tcp://d1:1")])
    fleet.submit("a", prompt_len=20)
    eventually(lambda: len(fleet.orders("a")) == 2)
    orders = fleet.orders("a")
    decode = fleet.decode_of("a")
    pre, dec = orders["prefill-0"], orders[decode]
    address = fleet.workers[decode].registration.handoff_address
    assert pre.decode_address == address and pre.tokens_expected == 0 and pre.token_hash == ""  # prefill's word
    assert dec.tokens_expected == 20 and dec.token_hash == token_hash([5] * 20) and dec.decode_address == ""
    assert pre.transfer_id == dec.transfer_id and len(bytes.fromhex(dec.transfer_id)) == 16  # one capability
    fleet.submit("b", prompt_len=20)
    eventually(lambda: len(fleet.orders("b")) == 2)
    assert fleet.orders("b")["prefill-0"].transfer_id != pre.transfer_id  # fresh per request


def test_mixed_pools_send_a_large_request_to_the_large_decode_and_refuse_one_no_pool_holds(
    fleet_of: Callable[..., Fleet],
) -> None:
    from kvfence.errors import ContextLengthExceededError

    workers = [
        reg("prefill", context_length=4096, pool_tokens=4096),
        reg("decode", worker_id="decode-0", context_length=4096, pool_tokens=512),
        reg("decode", worker_id="decode-1", context_length=4096, pool_tokens=2048),
    ]
    fleet = fleet_of(workers, allow_context_above_pool=True)
    fleet.workers["decode-0"].report(fleet.router, **idle(32))
    fleet.workers["decode-1"].report(fleet.router, **{**idle(128), "num_running": 50})
    fleet.submit("small", prompt_len=100, max_tokens=100)
    assert fleet.decode_of("small") == "decode-0"  # fits both; the idle one
    fleet.submit("large", prompt_len=900, max_tokens=100)
    assert fleet.decode_of("large") == "decode-1"  # only the large pool holds 1000 tokens, busy as it is
    assert fleet.router.capacity().max_total_tokens == {"prefill": 4096, "decode": 2048}

    async def too_large() -> None:
        async for _ in fleet.router.generate("huge", [5] * 2000, SamplingParams(max_tokens=100)):
            pass

    with pytest.raises(ContextLengthExceededError, match="2100 tokens .* decode KV pool \\(2048 tokens\\)"):
        asyncio.run(too_large())
    assert not any(m.request_id == "huge" for w in fleet.workers.values() for m in w.got(P.Order))


def test_a_prompt_goes_back_to_the_prefill_worker_that_cached_its_prefix_while_that_saves_more_than_it_waits(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(two_by_two())
    caching = {"prefix_caching": True}
    for w in fleet.workers.values():
        w.report(fleet.router, **idle(32), **(caching if w.id.startswith("prefill") else {}))
    shared = list(range(100, 164))  # 4 full pages of 16: a cache serves 64 tokens of a longer prompt
    fleet.submit("a", prompt=[*shared, 1], max_tokens=2)
    home = fleet.prefill_of("a")
    other = next(w for w in ("prefill-0", "prefill-1") if w != home)
    fleet.workers[other].report(fleet.router, **idle(32), **caching)
    fleet.workers[home].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=40)  # 40 more than other
    fleet.submit("b", prompt=[*shared, 2, 3], max_tokens=2)
    assert fleet.prefill_of("b") == home  # waits for 40 queued tokens, saves 64
    fleet.submit("c", prompt=[*shared, 4], max_tokens=2, cache_salt="another tenant")  # cached under another key
    assert fleet.prefill_of("c") == other
    fleet.workers[home].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=64)
    fleet.workers[other].report(fleet.router, **idle(32), **caching)
    fleet.submit("d", prompt=[*shared, 5], max_tokens=2)
    assert fleet.prefill_of("d") == other  # 64 more queued tokens: no saving, load decides
    fleet.workers[other].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=500)
    fleet.workers[home].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=10)  # d made `other` home...
    fleet.submit("e", prompt=[*shared, 6], max_tokens=2)
    assert fleet.prefill_of("e") == home  # ...but 490 more queued tokens there are worth more than 64
    fleet.workers[home].report(fleet.router, **idle(32), **caching)  # e made `home` the home again
    fleet.workers[other].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=30)
    fleet.workers[home].close()
    fleet.workers[home] = FakeWorker(fleet.hub, reg("prefill", worker_id=home, instance="restarted"))
    fleet.workers[home].report(fleet.router, **idle(32), **caching, queued_prompt_tokens=40)
    fleet.submit("f", prompt=[*shared, 7], max_tokens=2)
    assert fleet.prefill_of("f") == other  # restarted in its slot: its cache is empty, so load decides


def test_each_prefill_worker_is_credited_with_the_leading_pages_up_to_its_own_longest_key() -> None:
    from kvfence.disagg.workers import WorkerTable

    table = WorkerTable(suspect_after_s=1.0)
    for w in ("prefill-a", "prefill-b", "prefill-c"):
        table.add(reg("prefill", worker_id=w), now=0.0)
    queued = {"prefill-a": 100, "prefill-b": 40, "prefill-c": 0}
    for w, q in queued.items():
        table.report(w, {"prefix_caching": True, "queued_prompt_tokens": q}, now=0.0)
    a, b, c = (table.entries[w] for w in queued)
    keys = table.prefix_keys(None, list(range(100, 229)))  # 8 full pages of 16
    assert len(keys) == 8
    table.remember_prefix(keys, a)  # a computed all 8 pages...
    table.remember_prefix(keys[:4], b)  # ...then a prompt sharing the first 4 went to b
    assert [table.cached_tokens(e, keys) for e in (a, b, c)] == [128, 64, 0]
    assert table.pick_prefill(129, 0.5, keys=keys) is a  # 100 - 128 < 40 - 64 < 0
    assert table.pick_prefill(129, 0.5, exclude=("prefill-a",), keys=keys) is b  # a retry away from a: b's 4 pages
    table.heard("prefill-b", 2.0)
    table.heard("prefill-c", 2.0)
    assert table.pick_prefill(129, 2.0, keys=keys) is b  # a is suspect: its cache counts for nothing
    table.report("prefill-b", {"prefix_caching": True, "queued_prompt_tokens": 70}, now=2.0)
    assert table.pick_prefill(129, 2.0, keys=keys) is c  # 70 - 64 > 0: load decides
    assert table.pick_prefill(129, 2.0) is c  # no keys: load alone


def test_a_long_shared_prefix_is_credited_past_the_first_64_pages() -> None:
    from kvfence.disagg.workers import WorkerTable

    table = WorkerTable()
    for w in ("prefill-a", "prefill-b"):
        table.add(reg("prefill", worker_id=w, context_length=4096, pool_tokens=4096), now=0.0)
    table.report("prefill-a", {"prefix_caching": True, "queued_prompt_tokens": 1200}, now=0.0)
    table.report("prefill-b", {"prefix_caching": True, "queued_prompt_tokens": 0}, now=0.0)
    a = table.entries["prefill-a"]
    shared = list(range(1000, 1000 + 100 * 16))  # a 1,600-token system prompt: 100 pages of 16
    first = [*shared, *range(5000, 5000 + 25 * 16), 1]  # 125 full pages
    keys = table.prefix_keys(None, first)
    assert [k.pages for k in keys] == [*range(1, 65), 80, 96, 112, 125]  # each page to 64, then every 16th, the last
    table.remember_prefix(keys, a)
    assert table.cached_tokens(a, keys) == 125 * 16  # the same prompt again: all of it
    second = table.prefix_keys(None, [*shared, *range(7000, 7000 + 10 * 16), 2])
    assert table.cached_tokens(a, second) == 96 * 16  # the shared 100 pages, down to the 16-page stride
    assert table.pick_prefill(1761, 0.0, keys=second) is a  # 1,200 more queued there saves 1,536 (64 pages: 1,024)


def test_without_prefix_affinity_or_a_cache_on_the_worker_prompts_go_by_load(fleet_of: Callable[..., Fleet]) -> None:
    for affinity, caching in ((False, True), (True, False)):
        fleet = fleet_of(two_by_two(), prefix_affinity=affinity)
        for w in fleet.workers.values():
            w.report(fleet.router, **idle(32), **({"prefix_caching": caching} if w.id.startswith("prefill") else {}))
        fleet.submit("a", prompt=list(range(100, 165)), max_tokens=2)
        home = fleet.prefill_of("a")
        other = next(w for w in ("prefill-0", "prefill-1") if w != home)
        fleet.workers[home].report(fleet.router, **idle(32), prefix_caching=caching, queued_prompt_tokens=40)
        fleet.workers[other].report(fleet.router, **idle(32), prefix_caching=caching)
        fleet.submit("b", prompt=list(range(100, 165)), max_tokens=2)
        assert fleet.prefill_of("b") == other, (affinity, caching)


def test_prefix_cache_counters_sum_over_prefill_workers_and_keep_a_dead_workers_counts(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(two_by_two())
    for i, wid in enumerate(("prefill-0", "prefill-1")):
        cache = {"queries": 100 * (i + 1), "hits": 10 * (i + 1), "corrupt_pages": i, "pages": 4 * (i + 1)}
        fleet.workers[wid].report(fleet.router, **idle(32), prefix_cache=cache)
    assert fleet.router.stats()["prefix_cache"] == {"queries": 300, "hits": 30, "corrupt_pages": 1, "pages": 12}
    fleet.silence_until_dead("prefill-1")
    # its counts stay in the sums (a Prometheus counter must not go back); its pages are gone with it
    assert fleet.router.stats()["prefix_cache"] == {"queries": 300, "hits": 30, "corrupt_pages": 1, "pages": 4}


def test_a_silent_worker_is_declared_dead_a_request_that_streamed_a_token_fails_and_new_ones_go_to_the_others(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of(two_by_two())
    for w in fleet.workers.values():
        w.load = idle(32)
    fleet.submit("a")
    victim = fleet.decode_of("a")
    prefill = fleet.prefill_of("a")
    fleet.workers[prefill].channel.send(P.Tokens("a", [7], text="x"))  # prefill's first token: the client has it
    eventually(lambda: fleet.router._flights["a"].delivered == 1)
    silent_for = fleet.silence_until_dead(victim)  # hung or killed: nothing more from it
    assert 0.6 < silent_for <= 0.6 + 1.0  # after the worker timeout, not before (plus a check period)
    chunks = fleet.results["a"].result(timeout=5)
    last = chunks[-1]
    assert last.finish_reason == "error" and last.extra["code"] == "worker_lost", last
    assert f"decode worker {victim} lost" in last.error and prefill in last.error, last.error
    eventually(lambda: any(m.request_id == "a" for m in fleet.workers[prefill].got(P.Abort)))  # the peer frees
    assert fleet.router.stats()["workers"][victim]["up"] is False
    for i in range(3):
        fleet.submit(f"after{i}")
        assert fleet.decode_of(f"after{i}") != victim
    assert fleet.router.stats()["worker_deaths"] == {"decode": 1}
    assert not any("#retry" in m.request_id for w in fleet.workers.values() for m in w.got(P.Order))  # not retried
    assert last.integrity["retried_after"] is None


def test_a_request_whose_worker_dies_before_any_token_is_retried_once_on_another_pair(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of([*two_by_two(), reg("decode", worker_id="decode-2")])
    for w in fleet.workers.values():
        w.load = idle(32)
    fleet.submit("a")
    first, prefill = fleet.decode_of("a"), fleet.prefill_of("a")
    eventually(lambda: first in fleet.orders("a"))  # the router picked it; its order may still be on the wire
    xid = fleet.orders("a")[first].transfer_id
    fleet.silence_until_dead(first)
    eventually(lambda: len(fleet.orders("a#retry1")) == 2)  # a new wire id: nothing of the first attempt counts
    again = fleet.orders("a#retry1")
    second = fleet.decode_of("a")
    assert second != first and second in again and again[second].transfer_id != xid  # a fresh capability
    eventually(lambda: any(m.request_id == "a" for m in fleet.workers[prefill].got(P.Abort)))  # old prefill drops it
    fleet.workers[first].channel.send(P.Tokens("a", [9], text="late"))  # the first attempt's news: ignored
    assert fleet.router.stats()["retries"] == {"decode": 1}
    fleet.silence_until_dead(second)  # once retried, a request is never retried again
    last = fleet.results["a"].result(timeout=5)[-1]
    assert last.finish_reason == "error" and last.extra["code"] == "worker_lost" and second in last.error
    assert last.token_ids == [] and all(c.token_ids == [] for c in fleet.results["a"].result())
    assert f"decode worker {first}" in last.integrity["retried_after"]
    assert not fleet.orders("a#retry2")


def test_a_second_process_under_a_live_workers_id_is_refused(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of([reg("prefill", instance="p1"), reg("decode", instance="d1")])
    fleet.workers["decode-0"].report(fleet.router, **idle(32))
    twin = fleet.hub.connect("decode-0", replace=True)  # a second process started with --worker-id decode-0
    twin.send(reg("decode", instance="d2"))
    reply = twin.recv(timeout=5)
    assert (
        isinstance(reply, P.RegisterReply)
        and not reply.accepted
        and "belongs to another live process (instance d1" in reply.reason
    )
    assert fleet.router.stats()["workers"]["decode-0"]["up"] is True  # the live worker keeps its requests
    twin.close()


def test_a_worker_the_router_does_not_know_is_told_to_register_and_then_takes_traffic(
    fleet_of: Callable[..., Fleet],
) -> None:
    fleet = fleet_of([reg("prefill"), reg("decode", worker_id="decode-0")])
    for w in fleet.workers.values():
        w.load = idle(32)
    stray = fleet.hub.connect("decode-9")
    stray.send(P.WorkerStats("decode", idle(32)))  # e.g. registered with the router before a restart
    reply = stray.recv(timeout=2)
    assert isinstance(reply, P.RegisterReply) and not reply.accepted and reply.reason.startswith("re-register")
    new = FakeWorker(fleet.hub, reg("decode", worker_id="decode-9"))
    fleet.workers["decode-9"] = new
    new.report(fleet.router, **idle(64))
    fleet.workers["decode-0"].report(fleet.router, **{**idle(32), "num_running": 3})
    fleet.submit("x")
    assert fleet.decode_of("x") == "decode-9"


def test_the_same_worker_registering_again_ends_what_it_held_before(fleet_of: Callable[..., Fleet]) -> None:
    fleet = fleet_of(two_by_two())
    for w in fleet.workers.values():
        w.load = idle(32)
    fleet.submit("a")
    wid = fleet.decode_of("a")
    prefill = fleet.prefill_of("a")
    fleet.workers[prefill].channel.send(P.Tokens("a", [7], text="x"))  # streamed: it cannot be retried
    eventually(lambda: fleet.router._flights["a"].delivered == 1)
    fleet.workers[wid].close()
    fleet.workers[wid] = FakeWorker(fleet.hub, reg("decode", worker_id=wid))  # restarted in its slot
    last = fleet.results["a"].result(timeout=5)[-1]
    assert last.finish_reason == "error" and "registered again" in last.error
    eventually(lambda: fleet.workers[wid].got(P.RegisterReply))
    assert fleet.workers[wid].got(P.RegisterReply)[0].accepted  # the new incarnation was accepted
    assert fleet.router.stats()["workers"][wid]["up"] is True


def test_no_worker_of_a_role_up_gives_503(fleet_of: Callable[..., Fleet]) -> None:
    from kvfence.errors import ServiceUnavailableError
    from kvfence.server.http import to_api_error

    fleet = fleet_of([reg("prefill"), reg("decode")])
    fleet.silence_until_dead("decode-0")
    assert fleet.router.healthy() == {"prefill": True, "decode": False}
    with pytest.raises(ServiceUnavailableError) as e:
        fleet.router.check_health()
    err = to_api_error(e.value)
    assert err.status == 503 and err.code == "no_healthy_worker"
    assert "no healthy decode worker (decode-0: decode worker decode-0 lost" in err.message


def test_zmq_hub_and_channel_exchange_messages_both_ways() -> None:
    keys = CurveKeys.from_cluster_key(ClusterKey.generate())
    hub = P.ZmqHub("127.0.0.1", 0, curve=keys)
    ch = P.ZmqChannel(hub.address, "decode-7", keys)
    try:
        ch.send(reg("decode", worker_id="decode-7"))
        got = None
        for _ in range(50):
            got = hub.recv(timeout=0.1)
            if got is not None:
                break
        assert got is not None and got[0] == "decode-7" and isinstance(got[1], P.Register)
        # a send from another thread wakes the receiving thread at once
        done = threading.Event()

        def pump() -> None:
            while not done.is_set():
                hub.recv(timeout=5.0)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        hub.send("decode-7", P.Abort("r9", "test"))
        msg = ch.recv(timeout=2.0)
        assert msg == P.Abort("r9", "test")
        done.set()
        hub.send("decode-7", P.Shutdown())  # wake the pump so it sees `done`
        t.join(timeout=5)
        assert not t.is_alive()
    finally:
        ch.close()
        hub.close()


@pytest.mark.parametrize("kind", ["zmq", "queue"])
def test_a_wake_from_another_thread_ends_a_waiting_recv_with_no_message(kind: str) -> None:
    keys = CurveKeys.from_cluster_key(ClusterKey.generate())
    hub: Any = P.ZmqHub("127.0.0.1", 0, curve=keys) if kind == "zmq" else P.QueueHub()
    ch = P.ZmqChannel(hub.address, "w", keys) if kind == "zmq" else hub.connect("w")
    try:
        timer = threading.Timer(0.2, ch.wake)
        timer.start()
        t0 = time.monotonic()
        assert ch.recv(timeout=10.0) is None
        assert time.monotonic() - t0 < 5.0  # woken, not timed out
        ch.send(P.Shutdown())  # the channel still works after a wake
        assert hub.recv(timeout=5.0)[1] == P.Shutdown()
    finally:
        ch.close()
        hub.close()


def test_inject_fault_flag_targets_a_request_and_a_page() -> None:
    f = parse_faults("drop_page@req-3#2,corrupt_byte")
    assert f is not None and f.enabled == ["corrupt_byte", "drop_page"]
    p = f.point("drop_page", "req-3")
    assert p is not None and p.page == 2
    assert f.point("drop_page", "other") is None and f.point("corrupt_byte", "other") is not None
    assert parse_faults(None) is None
    with pytest.raises(KvfenceError, match="unknown fault"):
        parse_faults("bogus")


def test_metrics_show_each_workers_load_and_health(fleet_of: Callable[..., Fleet]) -> None:
    from kvfence.server.metrics import Metrics

    fleet = fleet_of(two_by_two())
    fleet.workers["decode-1"].report(fleet.router, **{**idle(32), "pages_free": 20, "num_running": 3})
    fleet.workers["prefill-0"].report(fleet.router, **idle(32), queued_prompt_tokens=77)
    text = Metrics(fleet.router.stats).render().decode()
    assert 'kvfence_worker_kv_pages_free{role="decode",worker="decode-1"} 20.0' in text
    assert 'kvfence_worker_running_requests{role="decode",worker="decode-1"} 3.0' in text
    assert 'kvfence_worker_queued_prompt_tokens{role="prefill",worker="prefill-0"} 77.0' in text
    assert 'kvfence_worker_up{role="decode",worker="decode-0"} 1.0' in text
    fleet.silence_until_dead("decode-0")
    text = Metrics(fleet.router.stats).render().decode()
    assert 'kvfence_worker_up{role="decode",worker="decode-0"} 0.0' in text
    assert 'kvfence_worker_deaths_total{role="decode"} 1.0' in text
    assert "kvfence_control_messages_dropped_total 0.0" in text  # every message reached its worker's link
    assert 'worker="decode-0"} 32.0' not in text  # a dead worker's last load is not shown as current
