"""KV pools with known bytes, a bounded poll, and frames in the TCP transport's wire format."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool


def seed_pool(pool: KVPool, seed: int) -> KVPool:
    """Fill every (layer, buffer) of `pool` with seeded normal values (in place); returns it."""
    g = torch.Generator().manual_seed(seed)
    for layer in pool.tensors:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def seeded_pool(layout: KVLayout, num_pages: int, seed: int) -> KVPool:
    return seed_pool(KVPool(layout, num_pages), seed)


def verdict(dec: Any) -> bool | None:
    """Poll a DecodeHandoff once: True once verified, False once failed or aborted, None before either."""
    dec.poll()
    return dec.ok


def wait_for(pred: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `pred` until it holds; fail the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def frame(header: dict, payload: bytes = b"", payload_len: int | None = None) -> bytes:
    """`u32 header_len | u32 payload_len | header JSON | payload`; `payload_len` may announce more than is sent."""
    hb = json.dumps(header).encode()
    return struct.pack("<II", len(hb), len(payload) if payload_len is None else payload_len) + hb + payload


class WireClient:
    """A hand-driven data-plane sender for tests: connects to a receiver, runs the handshake with `auth`'s key
    (`kvfence.auth.handshake`), then writes frames with their MACs (`send`; `raw` writes bytes as they are) and
    reads the receiver's frames (`read`, MAC checked). Manifests given to `send_manifest` are sealed with the
    same key, as prefill seals them."""

    def __init__(self, address: str, auth: Any) -> None:
        from kvfence.auth import handshake
        from kvfence.transfer.tcp import parse_address

        scheme = address.split("://", 1)[0] + "://"
        self.sock = socket.create_connection(parse_address(address, scheme))
        self.auth = auth
        self.mac = handshake.connect(self.sock, auth.data_key, 5.0)

    def send(self, header: dict, payload: bytes = b"", payload_len: int | None = None) -> None:
        hb = json.dumps(header).encode()
        prefix = struct.pack("<II", len(hb), len(payload) if payload_len is None else payload_len)
        self.sock.sendall(prefix + hb + self.mac.sign(prefix, hb) + payload)

    def send_manifest(self, rid: str, xid: str, manifest: Any) -> None:
        from kvfence.integrity.manifest import seal

        self.send({"t": "manifest", "rid": rid, "xid": xid}, seal(manifest.to_bytes(), self.auth.manifest_key))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> dict:
        """The receiver's next frame header (its payload, if any, is read and dropped)."""
        prefix = self.sock.recv(8, socket.MSG_WAITALL)
        hlen, plen = struct.unpack("<II", prefix)
        hb = self.sock.recv(hlen, socket.MSG_WAITALL)
        tag = self.sock.recv(16, socket.MSG_WAITALL)
        assert self.mac.check(prefix, hb, tag), "the receiver's frame MAC does not verify"
        if plen:
            self.sock.recv(plen, socket.MSG_WAITALL)
        return json.loads(hb)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WireClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
