"""The vLLM connector's control messages: each kind round-trips through its codec, and a request that is not a
well-formed `Pull` is refused by prefill with its reason (over the real, keyed control channel) and counted."""

from __future__ import annotations

import pytest
import torch

from kvfence.auth.keys import ClusterKey
from kvfence.integrations.vllm import control
from kvfence.integrations.vllm.control_messages import (
    Hello,
    MessageError,
    Ok,
    Pull,
    Record,
    Refused,
    hello_from,
    reply_from,
    request_from,
    to_header,
)
from kvfence.integrations.vllm.handoff import HandoffConfig, ProducerHandoff, VllmBlockPool, vllm_layout

MESSAGES = [
    (Pull("req", "a" * 32, "tcp://127.0.0.1:9"), request_from),
    (Record("a" * 32, "vllm-1", {"status": "verified", "pages": 3}), request_from),
    (Ok(), reply_from),
    (Ok(3), reply_from),
    (Refused("prefill never held it"), reply_from),
    (Hello("0" * 32), hello_from),
]


@pytest.mark.parametrize(("msg", "decode"), MESSAGES)
def test_each_message_round_trips_through_its_codec(msg, decode) -> None:
    header = to_header(msg)
    assert header["t"] == msg.kind
    assert decode(header) == msg


def test_a_header_that_is_not_a_request_names_what_is_wrong() -> None:
    with pytest.raises(MessageError, match="a request of an unknown kind: 'ok'"):
        request_from({"t": "ok"})  # a reply where a request belongs
    with pytest.raises(MessageError, match="missing required field `to`"):
        request_from({"t": "pull", "rid": "r", "xid": "x"})
    with pytest.raises(MessageError, match="Expected `str`, got `int`"):
        request_from({"t": "pull", "rid": "r", "xid": "x", "to": 9})
    with pytest.raises(MessageError, match="unknown field `extra`"):
        reply_from({"t": "ok", "extra": 1})


@pytest.fixture
def producer():
    tensors = [torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16)]  # one layer of 4 vLLM CPU blocks
    pool = VllmBlockPool(vllm_layout("LlamaForCausalLM", "cpu", tensors[0].shape[1:], torch.bfloat16, 4, 1), tensors)
    key = ClusterKey.generate()
    p = ProducerHandoff(pool, HandoffConfig(), key)
    yield p, control.control_key(key)
    p.close()


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ({"t": "pull", "rid": "req"}, "malformed request: Object missing required field `xid`"),
        ({"t": "record", "xid": "x", "vllm_id": "v", "record": {}}, "a 'record' request is not served here"),
        ({"t": "push", "rid": "req", "xid": "x"}, "a request of an unknown kind: 'push'"),
    ],
)
def test_prefill_refuses_a_request_that_is_not_a_pull_with_its_reason(producer, header, reason: str) -> None:
    p, key = producer
    reply = control.request(p.pull_address, header, key)
    assert reply == {"t": "refused", "reason": reason}
    assert p.stats().pulls_refused == 1
