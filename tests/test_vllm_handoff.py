"""The vLLM connector's handoff core without vLLM: producer and consumer over loopback, on tensors shaped like vLLM's.

`kvfence.integrations.vllm.handoff`, `params` and `control` import nothing of vLLM, so their rules are tested here
in the fast suite: a verified handoff lands the producer's blocks byte for byte, every refusal (unknown, consumed,
expired transfer id; a prompt that is not the router's; a damaged page) fails the load with its reason and a record
sent to the front end, and blocks are handed back on both sides. tests/test_vllm_pd.py runs the same inside vLLM.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
import torch

from kvfence.auth.keys import ClusterKey
from kvfence.integrations.vllm import control
from kvfence.integrations.vllm.handoff import (
    ConsumerHandoff,
    HandoffConfig,
    LoadResults,
    ProducerHandoff,
    VllmBlockPool,
    check_prompt,
    vllm_layout,
)
from kvfence.integrations.vllm.params import ConsumeParams, ParamsError, ProducedParams, ProduceParams, role_of
from kvfence.integrity.digest import token_hash

BS, LAYERS, NUM_BLOCKS = 4, 3, 16


def _pool(seed: int) -> tuple[VllmBlockPool, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(NUM_BLOCKS, 2, BS, 8, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]  # vLLM CPU
    layout = vllm_layout("LlamaForCausalLM", "cpu", tensors[0].shape[1:], torch.bfloat16, BS, LAYERS)
    return VllmBlockPool(layout, tensors), tensors


class Pair:
    def __init__(self, lease_s: float = 30.0, producer_faults: str | None = None) -> None:
        self.p_pool, self.p_tensors = _pool(1)
        self.d_pool, self.d_tensors = _pool(2)
        self.key = ClusterKey.generate()
        config = HandoffConfig(lease_s=lease_s, inject_fault=producer_faults)
        self.producer = ProducerHandoff(self.p_pool, config, self.key)
        self.consumer = ConsumerHandoff(self.d_pool, HandoffConfig(transfer_timeout_s=10.0), self.key)
        self.records: dict[str, dict] = {}
        self.listener = control.ControlServer(self._on_record, control.control_key(self.key))

    def _on_record(self, header: dict, peer: str) -> dict:
        self.records[str(header["xid"])] = header["record"]
        return {"t": "ok"}

    def produce(self, ids: list[int], src: list[int], rid: str = "req") -> str:
        xid = secrets.token_hex(16)
        self.producer.digest("p-" + rid, rid, xid, ids, src)
        self.producer.hold("p-" + rid)
        return xid

    def consume_params(self, ids: list[int], xid: str, rid: str = "req") -> ConsumeParams:
        return ConsumeParams(rid, xid, len(ids), token_hash(ids), self.producer.pull_address, self.listener.address)

    def wait(self, vllm_id: str, timeout_s: float = 10.0) -> LoadResults:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.consumer.poll()
            if vllm_id in out.finished:
                return out
            time.sleep(0.01)
        raise AssertionError(f"load {vllm_id} did not finish")

    def record(self, xid: str, timeout_s: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while xid not in self.records and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.records[xid]

    def released(self, vllm_id: str, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if vllm_id in self.producer.poll():
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()
        self.listener.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_verified_handoff_lands_every_byte(pair: Pair) -> None:
    ids = list(range(10, 20))  # 10 tokens: 3 blocks of 4
    xid = pair.produce(ids, [5, 9, 2])
    pair.consumer.start("d-req", pair.consume_params(ids, xid), [7, 1, 12, 3], None)
    out = pair.wait("d-req")
    assert "d-req" not in out.failed
    for src, dst in ((5, 7), (9, 1), (2, 12)):
        for p_t, d_t in zip(pair.p_tensors, pair.d_tensors, strict=True):
            assert torch.equal(p_t[src].view(torch.int16), d_t[dst].view(torch.int16))
    rec = pair.record(xid)
    assert rec["status"] == "verified" and rec["pages"] == 3 and rec["tokens_expected"] == 10
    assert pair.released("p-req")  # the verdict frees prefill's blocks


def test_consumed_transfer_id_is_refused(pair: Pair) -> None:
    ids = list(range(8))
    xid = pair.produce(ids, [1, 2])
    pair.consumer.start("d1", pair.consume_params(ids, xid), [3, 4], None)
    assert "d1" not in pair.wait("d1").failed
    assert pair.released("p-req")
    assert pair.record(xid)["status"] == "verified"
    pair.records.clear()
    pair.consumer.start("d2", pair.consume_params(ids, xid, "req"), [5, 6], None)
    assert "d2" in pair.wait("d2").failed
    rec = pair.record(xid)
    assert rec["reason"] == "transfer_error" and "consumed" in rec["detail"]


def test_unknown_transfer_id_is_refused(pair: Pair) -> None:
    ids = list(range(8))
    xid = secrets.token_hex(16)
    pair.consumer.start("d", pair.consume_params(ids, xid), [3, 4], None)
    assert "d" in pair.wait("d").failed
    assert "unknown transfer id" in pair.record(xid)["detail"]


def test_lease_expiry_frees_blocks_and_refuses_late_pull() -> None:
    pair = Pair(lease_s=0.2)
    try:
        ids = list(range(8))
        xid = pair.produce(ids, [1, 2])
        assert pair.released("p-req")  # no pull within the lease
        pair.consumer.start("d", pair.consume_params(ids, xid), [3, 4], None)
        assert "d" in pair.wait("d").failed
        assert "lease" in pair.record(xid)["detail"]
    finally:
        pair.close()


def test_prompt_that_is_not_the_routers_is_refused_before_any_pull(pair: Pair) -> None:
    a, b = list(range(8)), list(range(1, 9))
    xid = pair.produce(a, [1, 2])
    params = pair.consume_params(a, xid)
    refused = check_prompt(params, b)
    assert refused is not None and refused.reason is not None and refused.reason.value == "token_hash_mismatch"
    assert check_prompt(params, a) is None
    pair.consumer.start("d", params, [3, 4], refused)
    assert "d" in pair.wait("d").failed
    assert pair.record(xid)["reason"] == "token_hash_mismatch"
    assert pair.producer.stats().held == 1  # never pulled: prefill still holds it, until its lease


@pytest.mark.parametrize(
    "fault,reason",
    [
        ("corrupt_byte@*#1", "digest_mismatch"),
        ("placeholder_handoff", "token_count_mismatch"),
        ("drop_page@*#0", "coverage_gap"),
        ("wrong_layout", "layout_mismatch"),
    ],
)
def test_damaged_handoff_fails_with_its_reason(fault: str, reason: str) -> None:
    pair = Pair(producer_faults=fault)
    try:
        ids = list(range(12))
        xid = pair.produce(ids, [1, 2, 3])
        pair.consumer.start("d", pair.consume_params(ids, xid), [4, 5, 6], None)
        assert "d" in pair.wait("d").failed
        assert pair.record(xid)["reason"] == reason
        assert pair.released("p-req")
    finally:
        pair.close()


def test_aborted_load_is_reported_once_settled(pair: Pair) -> None:
    ids = list(range(8))
    pair.consumer.start("d", pair.consume_params(ids, secrets.token_hex(16)), [3, 4], None)
    pair.consumer.abort("d")
    out = pair.wait("d")
    assert "d" in out.failed


def test_control_channel_refuses_a_wrong_key() -> None:
    key = control.control_key(ClusterKey.generate())
    server = control.ControlServer(lambda h, peer: {"t": "ok", "echo": h.get("x")}, key)
    try:
        assert control.request(server.address, {"t": "ping", "x": 1}, key)["echo"] == 1
        other = control.control_key(ClusterKey.generate())
        assert control.request(server.address, {"t": "ping"}, other)["t"] == "refused"
        assert control.request(server.address, {"t": "ping"}, None)["t"] == "refused"
        assert server.refused_auth == 2
    finally:
        server.close()


def test_pull_without_the_key_moves_nothing(pair: Pair) -> None:
    """A party that knows a transfer id but not the cluster key cannot make prefill send it anywhere."""
    ids = list(range(8))
    xid = pair.produce(ids, [1, 2])
    header = {"t": "pull", "rid": "req", "xid": xid, "to": pair.consumer.data_address}
    assert control.request(pair.producer.pull_address, header, None)["t"] == "refused"
    assert pair.producer.stats().held == 1 and pair.producer.control.refused_auth == 1


def test_data_plane_refuses_another_deployment(pair: Pair) -> None:
    """A sender holding another key cannot land a manifest or a page in decode's slot, even with the right transfer
    id: kvfence's data plane refuses its connection at the handshake."""
    ids = list(range(8))
    stranger = ProducerHandoff(_pool(3)[0], HandoffConfig(), ClusterKey.generate())
    try:
        xid = secrets.token_hex(16)
        slot = pair.consumer.receiver.expect("req", [3, 4], xid)  # what a load registers
        manifest = stranger._build_manifest("req", xid, ids, [1, 2])
        handle = stranger.sender.send(pair.consumer.data_address, manifest, [1, 2])
        assert handle.wait(10) and handle.status.value == "error", handle.status
        assert slot.manifest is None and int(slot.coverage.counts.sum()) == 0
        assert pair.consumer.auth.events.counts(), "the refused handshake is a security event"
    finally:
        stranger.close()


def test_params_are_validated() -> None:
    xid = "ab" * 16
    ok = ConsumeParams("r", xid, 5, "0123456789abcdef", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    assert ConsumeParams.parse(ok.to_params()) == ok
    assert ProduceParams.parse(ProduceParams("r", xid).to_params()).transfer_id == xid
    assert ProducedParams.parse(ProducedParams("r", xid, "tcp://h:1", 3).to_params()).num_tokens == 3
    assert role_of({"do_remote_prefill": True}) is None and role_of(ok.to_params()) == "consume"
    bad = ok.to_params()
    bad["kvfence"]["transfer_id"] = "short"
    with pytest.raises(ParamsError, match="transfer_id"):
        ConsumeParams.parse(bad)
    bad = ok.to_params()
    bad["kvfence"]["tokens_expected"] = True
    with pytest.raises(ParamsError, match="tokens_expected"):
        ConsumeParams.parse(bad)
    with pytest.raises(ParamsError, match="role"):
        ProduceParams.parse(ok.to_params())


def test_block_pool_refuses_what_it_cannot_read_in_place() -> None:
    t = torch.zeros(NUM_BLOCKS, 2, BS, 8, dtype=torch.bfloat16)
    layout = vllm_layout("X", "cpu", t.shape[1:], torch.bfloat16, BS, 1)
    with pytest.raises(ValueError, match="contiguous"):
        VllmBlockPool(layout, [t.transpose(2, 3)])
    with pytest.raises(ValueError, match="layers"):
        VllmBlockPool(layout, [t, t])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["proxy"], "give both --prefill URL and --decode URL"),
        (["proxy", "--launch", "--prefill", "http://127.0.0.1:9"], "drop --prefill/--decode"),
        (["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"], "no cluster key"),
        (["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--insecure-no-auth"],
         "is it a vLLM server"),
    ],
)  # fmt: skip
def test_proxy_configuration_mistakes_are_one_line(argv: list[str], message: str, capsys, monkeypatch) -> None:
    from kvfence.cli import main

    for var in ("KVFENCE_CLUSTER_KEY", "KVFENCE_CLUSTER_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
