"""The prompt token hash: the one definition the router computes and decode checks.

What it knows: xxh3_64 over the prompt's ids as little-endian int64, as 16 hex digits, from a list of ints (packed
with `struct`), a numpy array or a torch tensor, without importing torch or numpy itself (an array or a tensor can
only come from a process that has them), so the router, which hashes its own tokenization, stays free of both.
Anything `struct` cannot pack as int64 (floats, nested lists, ids out of range) takes numpy's conversion, as it
always did. What it does not know: page digests (`kvfence.integrity.digest`) or what a mismatch means
(`kvfence.integrity.verify`).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import numpy as np
    import torch


def token_hash(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """The prompt token hash: xxh3_64 over the ids as little-endian int64, as 16 hex digits.

    Defined once here; the router computes it from its own tokenization and decode compares
    it with the manifest's, so prefill cannot vouch for its own prompt.
    """
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(token_ids, torch_module.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, (list, tuple)) and all(type(t) is int for t in token_ids):
        try:
            return xxhash.xxh3_64_hexdigest(struct.pack(f"<{len(token_ids)}q", *token_ids))
        except struct.error:  # out of int64's range: numpy's error, as before
            pass
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8"))
    assert arr.ndim == 1, f"token ids must be 1-D, got shape {arr.shape}"
    return xxhash.xxh3_64_hexdigest(arr.tobytes())
