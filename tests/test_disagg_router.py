"""Router start-up rules and the control-plane channels, without a model."""

from __future__ import annotations

import threading

import pytest

from kvfence.disagg import protocol as P
from kvfence.disagg.router import Router, RouterConfig, check_pair, check_registration, params_from_dict, params_to_dict
from kvfence.disagg.worker_main import parse_faults
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import CapacityConfigError, KvfenceError


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


def test_messages_round_trip_through_json() -> None:
    msgs = [
        reg("decode"),
        P.DecodePrepare("r1", [1, 2, 3], 3, "abcd", {"max_tokens": 4}, 5.0),
        P.Tokens("r1", [7, 8], text="hi", finished=True, finish_reason="length", integrity={"status": "verified"}),
        P.Abort("r1", "client gone"),
        P.Shutdown(),
    ]
    for m in msgs:
        assert P.decode(P.encode(m)) == m
    with pytest.raises(ValueError, match="unknown control message"):
        P.decode(b'{"kind": "nope"}')


def test_sampling_params_survive_the_wire() -> None:
    sp = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("xy",), stop_token_ids=(4,))
    assert params_from_dict(P.decode(P.encode(P.PrefillOrder("r", [1], params_to_dict(sp), "a", {}, 1.0))).params) == sp


@pytest.mark.parametrize(
    ("field", "p_value", "d_value"),
    [
        ("context_length", 256, 512),
        ("page_size", 16, 32),
        ("dtype", "float32", "bfloat16"),
        ("layout_fingerprint", "a" * 16, "b" * 16),
        ("model_fingerprint", "c" * 16, "d" * 16),
    ],
)
def test_pair_with_different_settings_is_refused_naming_both_values(
    field: str, p_value: object, d_value: object
) -> None:
    with pytest.raises(CapacityConfigError) as e:
        check_pair(reg("prefill", **{field: p_value}), reg("decode", **{field: d_value}))
    msg = str(e.value)
    assert field in msg and repr(p_value) in msg and repr(d_value) in msg


def test_matching_pair_is_accepted() -> None:
    check_pair(reg("prefill"), reg("decode", pool_tokens=4096))  # pools may differ


def test_role_whose_context_exceeds_its_pool_is_refused() -> None:
    with pytest.raises(CapacityConfigError, match=r"context length 1024 .* 512 tokens"):
        check_registration(reg("decode", context_length=1024, pool_tokens=512))
    check_registration(reg("decode", context_length=512, pool_tokens=512))


def test_router_refuses_a_mismatched_pair_and_tells_both_workers() -> None:
    hub = P.QueueHub()
    pc, dc = hub.connect("prefill-0"), hub.connect("decode-0")
    pc.send(reg("prefill", page_size=16))
    dc.send(reg("decode", page_size=32))
    router = Router(hub, RouterConfig(register_timeout_s=5))
    with pytest.raises(CapacityConfigError, match="page_size: prefill=16 decode=32"):
        router.wait_for_workers()
    for ch in (pc, dc):
        reply = ch.recv(timeout=1)
        assert isinstance(reply, P.RegisterReply) and not reply.accepted and "page_size" in reply.reason


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


def test_router_times_out_when_a_role_never_registers() -> None:
    hub = P.QueueHub()
    hub.connect("prefill-0").send(reg("prefill"))
    with pytest.raises(CapacityConfigError, match="no decode worker registered"):
        Router(hub, RouterConfig(register_timeout_s=0.3)).wait_for_workers()


def test_zmq_hub_and_channel_exchange_messages_both_ways() -> None:
    hub = P.ZmqHub("127.0.0.1", 0)
    ch = P.ZmqChannel(hub.address, "decode-7")
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


def test_inject_fault_flag_targets_a_request_and_a_page() -> None:
    f = parse_faults("drop_page@req-3#2,corrupt_byte")
    assert f is not None and f.enabled == ["corrupt_byte", "drop_page"]
    p = f.point("drop_page", "req-3")
    assert p is not None and p.page == 2
    assert f.point("drop_page", "other") is None and f.point("corrupt_byte", "other") is not None
    assert parse_faults(None) is None
    with pytest.raises(KvfenceError, match="unknown fault"):
        parse_faults("bogus")
