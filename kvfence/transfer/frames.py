"""The data plane's frames: what a KV sender and receiver say to each other, typed, and their one codec.

What it knows: every frame header of a handoff (`transfer.base` draws the sequence), each a small frozen
`msgspec.Struct` whose class is its kind: the tag `t` on the wire, mirroring the control plane's messages
(`disagg.messages`). Frames come in two directions, and each side decodes only what may come its way:

    sender -> receiver   ToReceiver = Manifest | Pages | Done | Abort | Aborted | Fenced
    receiver -> sender   ToSender   = Ready | ChunkAck | Verdict | Abort | Error | Hello | Dest

(`Hello` and `Dest` are the Mooncake transport's, `transfer.mooncake`). A header is JSON on the wire
(`encode`); `decode_to_receiver` / `decode_to_sender` turn the bytes into one typed frame or raise `FrameError`
naming what is wrong: not JSON, not an object, a kind unknown for that direction, a field missing, unknown or of
the wrong type, a `pages` frame whose `idx` and `nb` differ in length. A transport decodes each header once, at
the seam where its bytes arrive (after their MAC is checked, `transfer.tcp`), and the cores dispatch on the
class, never on a string.

What it does not know: payloads (a frame's payload travels after its header, raw), MACs and sockets
(`auth.handshake`, `transfer.tcp`), or what a frame does to a transfer (`transfer.base`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvfence.errors import KvfenceError


class FrameError(KvfenceError, ValueError):
    """A frame header that does not decode into a frame of its direction (malformed, or of an unknown kind)."""


class Frame(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    """Every data-plane frame header; its class's tag is its kind `t` on the wire."""

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class TransferFrame(Frame, frozen=True):
    """A frame about one transfer: the request and the router's transfer id (its capability)."""

    rid: str
    xid: str


# -- sender -> receiver -----------------------------------------------------------------------------------


class Manifest(TransferFrame, frozen=True, tag="manifest"):
    """The transfer's sealed manifest (its payload, `integrity.manifest.seal`)."""


class Pages(TransferFrame, frozen=True, tag="pages"):
    """Chunk `seq`: the pages of logical indices `idx`, `nb[k]` bytes each, back to back in the payload (or, over
    Mooncake, a notice that they were written)."""

    seq: int
    idx: list[int]
    nb: list[int]

    def __post_init__(self) -> None:
        if len(self.idx) != len(self.nb):  # a ValueError here is a ValidationError when decoding
            raise ValueError(f"pages frame names {len(self.idx)} pages but {len(self.nb)} sizes")


class Done(TransferFrame, frozen=True, tag="done"):
    """The last frame of a complete transfer: `pages` pages were sent."""

    pages: int


class Aborted(TransferFrame, frozen=True, tag="aborted"):
    """The last frame after decode asked to abort."""


class Fenced(TransferFrame, frozen=True, tag="fenced"):
    """On any connection: the transfer's writer is gone (a one-sided sender whose last frame was lost)."""


# -- either way -------------------------------------------------------------------------------------------


class Abort(TransferFrame, frozen=True, tag="abort"):
    """Sender -> receiver: the last frame of a transfer prefill gave up; receiver -> sender: decode gave up."""

    reason: str


# -- receiver -> sender -----------------------------------------------------------------------------------


class Ready(TransferFrame, frozen=True, tag="ready"):
    """The manifest is accepted: send the pages."""


class ChunkAck(TransferFrame, frozen=True, tag="chunk_ack"):
    """`n` bytes of chunk `seq` landed (flow control)."""

    seq: int
    n: int


class Verdict(TransferFrame, frozen=True, tag="verdict"):
    """Decode verified (`ok`) or rejected the pages."""

    ok: bool
    reason: str


class Error(TransferFrame, frozen=True, tag="error"):
    """Unknown request, bad manifest, ...: the transfer failed on decode's side."""

    reason: str


class Hello(Frame, frozen=True, tag="hello"):
    """Mooncake, the receiver's first frame after the handshake: its engine's session id."""

    session: str


class Dest(TransferFrame, frozen=True, tag="dest"):
    """Mooncake: where this transfer may write, once decode accepted its manifest: `num_pages` pages, each
    (layer, buffer) slice starting at `bases[k] = (address, bytes a page)`, all in `region = (address, bytes)`."""

    num_pages: int
    bases: list[tuple[int, int]]
    region: tuple[int, int]


ToReceiver = Manifest | Pages | Done | Abort | Aborted | Fenced
ToSender = Ready | ChunkAck | Verdict | Abort | Error | Hello | Dest

_ENCODER = msgspec.json.Encoder()
_TO_RECEIVER = msgspec.json.Decoder(ToReceiver)
_TO_SENDER = msgspec.json.Decoder(ToSender)


def encode(frame: Frame) -> bytes:
    """The header's bytes on the wire: compact JSON, the kind `t` first, the fields in declaration order."""
    return _ENCODER.encode(frame)


def decode_to_receiver(data: bytes | bytearray | memoryview) -> ToReceiver:
    """The sender's frame `data` encodes; anything else raises `FrameError`."""
    frame: ToReceiver = _decode(_TO_RECEIVER, data, "sender's")
    return frame


def decode_to_sender(data: bytes | bytearray | memoryview) -> ToSender:
    """The receiver's frame `data` encodes; anything else raises `FrameError`."""
    frame: ToSender = _decode(_TO_SENDER, data, "receiver's")
    return frame


def _decode(decoder: msgspec.json.Decoder[Any], data: bytes | bytearray | memoryview, whose: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _refused(e, whose) from None


def _refused(error: msgspec.MsgspecError, whose: str) -> FrameError:
    """Why a header did not decode, in words."""
    if not isinstance(error, msgspec.ValidationError):  # (a ValidationError is a DecodeError too)
        return FrameError(f"{whose} frame header is not JSON: {error}")
    text = str(error)
    if text.startswith("Invalid value") and text.endswith("at `$.t`"):
        return FrameError(f"{whose} frame of an unknown kind: {text}")
    return FrameError(f"malformed {whose} frame header: {text}")
