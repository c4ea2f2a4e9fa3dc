"""The KV layout: every buffer of every layer that a model keeps per token.

What it knows: for one model architecture, the list of per-token buffers each layer
writes into the KV pool (K and V for MHA/GQA; latent and rope key for MLA; indexer
keys for DSA, ...), their shapes and dtype, and the page size. From that it derives
bytes per page and a stable fingerprint that prefill and decode compare before any
transfer. Digests, canaries and transfers enumerate pages through this description,
so whatever a model keeps is covered by construction.

What it does not know: where the bytes live (that is `kv.pool.KVPool`), who owns a
page (`kv.allocator.PageAllocator`), or how a model computes what it stores.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(_DTYPE_NAMES.values())}")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    for dtype, n in _DTYPE_NAMES.items():
        if n == name:
            return dtype
    raise ValueError(f"unsupported KV dtype {name!r}; supported: {sorted(_DTYPE_NAMES.values())}")


@dataclass(frozen=True)
class KVBufferSpec:
    """One per-token buffer kept by every layer, e.g. ("k", (num_kv_heads, head_dim))."""

    name: str
    token_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.name and self.name.isidentifier(), self.name
        assert len(self.token_shape) >= 1 and all(d > 0 for d in self.token_shape), self.token_shape

    @property
    def numel_per_token(self) -> int:
        n = 1
        for d in self.token_shape:
            n *= d
        return n


@dataclass(frozen=True)
class KVLayout:
    """Per-layer buffers of one architecture, at one page size and dtype.

    Logical order of a page's bytes (used by digests, canaries and transfers):
    for layer in 0..num_layers-1, for buffer in `buffers` order: the page's slice
    of that buffer, [page_size, *token_shape] contiguous.
    """

    architecture: str
    num_layers: int
    buffers: tuple[KVBufferSpec, ...]
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.num_layers > 0, self.num_layers
        assert self.page_size > 0, self.page_size
        assert len(self.buffers) > 0, "a layout with no buffers would verify nothing"
        names = [b.name for b in self.buffers]
        assert len(set(names)) == len(names), f"duplicate buffer names {names}"
        dtype_name(self.dtype)  # raises on unsupported dtypes

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def buffer_bytes_per_page(self, spec: KVBufferSpec) -> int:
        return self.page_size * spec.numel_per_token * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * sum(b.numel_per_token for b in self.buffers) * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def describe(self) -> dict:
        """A JSON-able description; what the fingerprint is computed over."""
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "buffers": [{"name": b.name, "token_shape": list(b.token_shape)} for b in self.buffers],
            "page_size": self.page_size,
            "dtype": dtype_name(self.dtype),
        }

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_description(cls, d: dict) -> KVLayout:
        return cls(
            architecture=d["architecture"],
            num_layers=int(d["num_layers"]),
            buffers=tuple(KVBufferSpec(b["name"], tuple(int(x) for x in b["token_shape"])) for b in d["buffers"]),
            page_size=int(d["page_size"]),
            dtype=dtype_from_name(d["dtype"]),
        )
