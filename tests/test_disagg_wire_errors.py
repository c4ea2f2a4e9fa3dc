"""Wire and config input is refused with explicit errors (never `assert`, which `python -O` removes)."""

from __future__ import annotations

import json

import pytest

from kvfence.disagg import messages as P
from kvfence.disagg.decode import DecodeConfig
from kvfence.disagg.handoff import HandoffConfig
from kvfence.disagg.prefill import PrefillConfig
from kvfence.disagg.router import RouterConfig
from kvfence.engine.sampling_params import SamplingParams
from kvfence.errors import KvfenceError
from kvfence.integrity.manifest import HandoffManifest, ManifestError
from kvfence.integrity.record import IntegrityRecord
from kvfence.transfer.base import TransferConfig


def _body(msg: P.Message, **changes: object) -> bytes:
    d = json.loads(P.encode(msg))
    d.update(changes)
    return json.dumps(d).encode()


ABORT = P.Abort("r1", "because")


def test_a_control_message_that_is_not_json_is_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="not JSON"):
        P.decode(b"\xff{")


def test_a_control_message_that_is_not_an_object_is_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="expected a JSON object, got list"):
        P.decode(b"[1, 2]")


def test_a_missing_field_is_named() -> None:
    d = json.loads(P.encode(ABORT))
    del d["reason"]
    with pytest.raises(P.WireError, match=r"abort: missing field\(s\) \['reason'\]"):
        P.decode(json.dumps(d).encode())


def test_an_unknown_field_is_named() -> None:
    with pytest.raises(P.WireError, match="abort: unknown field 'extra'"):
        P.decode(_body(ABORT, extra=1))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("num_pages", "3", "int"),
        ("num_pages", True, "int"),
        ("handoff_address", 5, "str"),
        ("transfer_info", [], "dict"),
    ],
)
def test_a_field_of_the_wrong_json_type_is_named(field: str, value: object, expected: str) -> None:
    msg = P.DecodeReserved("r1", "tcp://h:1", 3)
    with pytest.raises(P.WireError, match=f"decode_reserved.{field}: expected {expected}"):
        P.decode(_body(msg, **{field: value}))


def test_optional_and_float_fields_accept_what_the_encoder_writes() -> None:
    # an int deadline is a float
    msg = P.PrefillOrder("r", [1, 2], "f" * 32, P.params_to_wire(SamplingParams()), "", {}, 60)
    assert P.decode(P.encode(msg)) == msg
    tokens = P.Tokens("r", [3], finish_reason=None, integrity=None, logprobs=None)
    assert P.decode(P.encode(tokens)) == tokens


def test_sampling_params_that_do_not_validate_are_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="sampling params: temperature"):
        P.params_from_wire({**P.params_to_wire(SamplingParams()), "temperature": -1.0})
    with pytest.raises(P.WireError, match="expected a JSON object"):
        P.params_from_wire([])  # type: ignore[arg-type]


def test_an_integrity_record_from_the_wire_is_checked() -> None:
    rec = IntegrityRecord("r", "rejected", "digest_mismatch", "page 3", 10, 10, 1)
    assert IntegrityRecord.from_dict(rec.to_dict()) == rec
    with pytest.raises(ValueError, match="unknown fields \\['bogus'\\]"):
        IntegrityRecord.from_dict({**rec.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="status 'fine'"):
        IntegrityRecord.from_dict({**rec.to_dict(), "status": "fine"})
    with pytest.raises(ValueError, match="does not go with reason"):
        IntegrityRecord.from_dict({**rec.to_dict(), "status": "verified"})


def test_a_manifest_with_inconsistent_counts_is_a_manifest_error() -> None:
    m = HandoffManifest("r", "x", 20, "h", "fp", {}, 16, 2, (1, 2), (3, 4))
    d = json.loads(m.to_bytes())
    d["num_pages"] = 3
    with pytest.raises(ManifestError, match="2 page digests and 2 canaries for 3 pages"):
        HandoffManifest.from_bytes(json.dumps(d).encode())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RouterConfig(handoff_deadline_s=0), "RouterConfig.handoff_deadline_s must be a number > 0"),
        (lambda: RouterConfig(worker_timeout_s=0.5, heartbeat_interval_s=0.5), "worker_timeout_s"),
        (lambda: RouterConfig(wait_decode_workers=0), "at least one worker of each role"),
        (lambda: DecodeConfig(transport="rdma"), "DecodeConfig.transport must be one of tcp, mooncake, local"),
        (lambda: DecodeConfig(io_timeout_s=-1), "DecodeConfig.io_timeout_s"),
        (lambda: PrefillConfig(deadline_s=0), "PrefillConfig.deadline_s"),
        (lambda: HandoffConfig(verdict_timeout_s=0), "HandoffConfig.verdict_timeout_s"),
        (lambda: TransferConfig(max_transfer_pages=0), "max_transfer_pages must be > 0"),
    ],
)
def test_bad_config_values_raise_a_named_error(make: object, match: str) -> None:
    with pytest.raises(KvfenceError, match=match):
        make()  # type: ignore[operator]
