"""Wire and config input is refused with explicit errors (never `assert`, which `python -O` removes)."""

from __future__ import annotations

import json

import msgspec
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
    d = msgspec.msgpack.decode(P.encode(msg))
    d.update(changes)
    return msgspec.msgpack.encode(d)


ABORT = P.Abort("r1", "because")
ORDER = P.Order("r", [1, 2], "f" * 32, P.params_to_wire(SamplingParams()), tokens_expected=2, token_hash="h")


def test_a_control_message_that_is_not_msgpack_is_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="control message"):
        P.decode(b"\xc1")  # a byte MessagePack never uses


def test_a_control_message_that_is_not_a_map_is_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="Expected `object`, got `array`"):
        P.decode(msgspec.msgpack.encode([1, 2]))


def test_an_unknown_kind_is_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="Invalid value 'decode_prepare'"):
        P.decode(_body(ABORT, kind="decode_prepare"))  # a kind of the old protocol


def test_a_missing_field_is_named() -> None:
    d = msgspec.msgpack.decode(P.encode(ABORT))
    del d["reason"]
    with pytest.raises(P.WireError, match="missing required field `reason`"):
        P.decode(msgspec.msgpack.encode(d))


def test_an_unknown_field_is_named() -> None:
    with pytest.raises(P.WireError, match="unknown field `extra`"):
        P.decode(_body(ABORT, extra=1))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tokens_expected", "3", "`int`, got `str` - at `$.tokens_expected`"),
        ("tokens_expected", True, "`int`, got `bool` - at `$.tokens_expected`"),
        ("prompt_token_ids", [1, "2"], "`int`, got `str` - at `$.prompt_token_ids[1]`"),
        ("decode_address", 5, "`str`, got `int` - at `$.decode_address`"),
        ("params", [], "`object`, got `array` - at `$.params`"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_its_path(field: str, value: object, expected: str) -> None:
    with pytest.raises(P.WireError) as e:
        P.decode(_body(ORDER, **{field: value}))
    assert expected in str(e.value), str(e.value)


def test_optional_fields_and_minus_infinity_survive_the_wire() -> None:
    assert P.decode(P.encode(ORDER)) == ORDER
    tokens = P.Tokens("r", [3], text=None, finish_reason=None, integrity=None, logprobs=[[3, float("-inf"), []]])
    assert P.decode(P.encode(tokens)) == tokens


def test_sampling_params_that_do_not_validate_are_a_wire_error() -> None:
    with pytest.raises(P.WireError, match="sampling params: temperature"):
        P.params_from_wire({**P.params_to_wire(SamplingParams()), "temperature": -1.0})
    with pytest.raises(P.WireError, match="expected a map"):
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
