"""KV pools with known bytes, a bounded poll, and frames in the TCP transport's wire format."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable

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
