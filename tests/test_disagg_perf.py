"""Control-plane costs of disaggregated serving: batched token frames, per-role torch threads, decode's waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.auth.curve import CurveKeys
from kvfence.auth.keys import ClusterKey
from kvfence.commands.worker_main import torch_threads_for
from kvfence.disagg import messages as P
from kvfence.disagg.handoff import DecodeState
from tests.helpers.auth import plane_auth

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module


def _tokens(rid: str, n: int, finished: bool = False) -> P.Tokens:
    return P.Tokens(rid, list(range(n)), text="x" * n, finished=finished, num_output_tokens=n)


def test_batch_round_trips_in_order() -> None:
    msgs = [_tokens("a", 1), _tokens("b", 2, finished=True), P.RequestFailed("c", "decode", "digest_mismatch")]
    back = P.decode(P.encode(P.Batch(msgs)))
    assert isinstance(back, P.Batch) and back.messages == msgs


def test_batch_of_one_is_the_message_itself_and_of_none_is_nothing() -> None:
    one = _tokens("a", 3)
    assert P.batch([one]) is one
    assert P.batch([]) is None
    assert isinstance(P.batch([one, one]), P.Batch)
    with pytest.raises(P.WireError, match=r"Invalid value 'batch' - at `\$.messages\[0\].kind`"):
        P.decode(P.encode(P.Batch([P.Batch([one])])))  # type: ignore[list-item]  # batches do not nest


def test_queue_hub_hands_out_a_batch_one_message_at_a_time() -> None:
    hub = P.QueueHub()
    ch = hub.connect("decode-0")
    ch.send(P.Batch([_tokens("a", 1), _tokens("b", 2), _tokens("c", 3)]))
    ch.send(_tokens("d", 4))
    got = [hub.recv(timeout=1) for _ in range(4)]
    assert [(w, m.request_id, len(m.token_ids)) for w, m in got] == [  # type: ignore[union-attr]
        ("decode-0", "a", 1),
        ("decode-0", "b", 2),
        ("decode-0", "c", 3),
        ("decode-0", "d", 4),
    ]
    assert hub.recv(timeout=0) is None


def test_zmq_hub_unpacks_a_batch_sent_as_one_frame() -> None:
    keys = CurveKeys.from_cluster_key(ClusterKey.generate())
    hub = P.ZmqHub("127.0.0.1", 0, curve=keys)
    ch = P.ZmqChannel(hub.address, "decode-3", keys)
    try:
        ch.send(P.Batch([_tokens("a", 1), _tokens("b", 2, finished=True)]))
        got = []
        for _ in range(50):
            item = hub.recv(timeout=0.1)
            if item is not None:
                got.append(item)
            if len(got) == 2:
                break
        assert [(w, m.request_id, m.finished) for w, m in got] == [("decode-3", "a", False), ("decode-3", "b", True)]  # type: ignore[union-attr]
        assert hub.recv(timeout=0) is None
    finally:
        ch.close()
        hub.close()


def test_the_hubs_receiving_thread_can_send_any_number_of_messages_between_two_receives() -> None:
    # The router's receiving thread itself sends a burst when a worker with many requests dies (two or three
    # messages per request); the wake pipe it would then write to has no reader but itself.
    import threading

    hub = P.ZmqHub("127.0.0.1", 0)
    sent = []

    def burst() -> None:
        for i in range(5_000):
            hub.send("decode-0", P.Abort(f"r{i}", "worker lost"))
            sent.append(i)

    try:
        t = threading.Thread(target=burst, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive() and len(sent) == 5_000, f"send blocked after {len(sent)} messages"
    finally:
        hub.close()


def test_a_worker_that_stops_reading_costs_its_own_messages_not_the_hubs_receiving_thread() -> None:
    keys = CurveKeys.from_cluster_key(ClusterKey.generate())
    hub = P.ZmqHub("127.0.0.1", 0, curve=keys)
    stuck = P.ZmqChannel(hub.address, "decode-0", keys)  # registers its id, then never reads again
    other = P.ZmqChannel(hub.address, "prefill-0", keys)
    try:
        stuck.send(P.Abort("hello", "x"))
        assert hub.recv(timeout=5) == ("decode-0", P.Abort("hello", "x"))
        for i in range(20_000):  # far past both ends' 1,000-message queues and the kernel's socket buffers
            hub.send("decode-0", P.Abort(f"r{i}", "x" * 1024))
            if i % 100 == 0:
                hub.recv(timeout=0)  # the receiving thread flushes what `send` queued
        hub.recv(timeout=0)
        assert hub.dropped_sends > 0
        other.send(P.Abort("still", "routing"))
        got = None
        for _ in range(50):
            if (got := hub.recv(timeout=0.1)) is not None:
                break
        assert got == ("prefill-0", P.Abort("still", "routing"))
    finally:
        stuck.close()
        other.close()
        hub.close()


@pytest.mark.parametrize(("cpus", "worker", "router"), [(1, 1, 1), (2, 1, 1), (4, 1, 1), (5, 2, 1), (16, 7, 1)])
def test_default_torch_threads_share_the_cores_between_roles(cpus: int, worker: int, router: int) -> None:
    assert torch_threads_for("prefill", cpus) == worker
    assert torch_threads_for("decode", cpus) == worker
    assert torch_threads_for("router", cpus) == router


def test_decode_waits_instead_of_spinning_while_a_handoff_is_in_flight(tiny_llama_dir: Path) -> None:
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig
    from kvfence.disagg.decode import DecodeConfig, DecodeWorker
    from kvfence.disagg.worker import WorkerIdentity
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.sampling_params import SamplingParams
    from kvfence.integrity.digest import token_hash
    from kvfence.transfer.local import LocalFabric, LocalReceiver

    engine = LLMEngine(
        EngineConfig(
            ModelConfig(str(tiny_llama_dir)), CacheConfig(page_size=16, max_total_tokens=512), context_length=256
        )
    )
    worker = DecodeWorker(
        engine,
        WorkerIdentity("decode-0", "tiny", "fp", {}),
        DecodeConfig(transport="local", deadline_s=30),
        receiver=LocalReceiver(LocalFabric(), "decode-0", engine.pool, auth=AUTH),
        auth=AUTH,
    )
    sent: list[P.Message] = []
    worker.attach(sent.append)
    assert not worker.busy and worker.poll_interval_s is None  # idle: the loop's own idle wait
    prompt = list(range(10, 50))
    sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    params = P.params_to_wire(sp)
    worker.handle(P.Order("r1", prompt, "f" * 32, params, tokens_expected=len(prompt), token_hash=token_hash(prompt)))
    assert worker.requests["r1"].state is DecodeState.RESERVED and not sent  # reserved: nothing to tell the router
    assert worker.step() is False  # nothing to compute until the KV lands
    assert not worker.busy and worker.poll_interval_s == 0.001  # a short wait, not a spin
    worker.handle(P.Abort("r1", "test"))
    assert worker.poll_interval_s is None
    worker.close()
