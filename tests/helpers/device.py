"""The device the tests' device pools live on: `KVFENCE_TEST_DEVICE` (default "cpu", so CI runs every device path
on CPU tensors; scripts/gpu_check.py sets "cuda"). A device pool is never host-visible, whatever its device:
integrity and transfer code take the paths a GPU pool takes (torch digests, host staging)."""

from __future__ import annotations

import os

import torch

from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool

TEST_DEVICE = torch.device(os.environ.get("KVFENCE_TEST_DEVICE", "cpu"))


def device_pool(layout: KVLayout, num_pages: int) -> KVPool:
    """A pool on TEST_DEVICE that integrity and transfer code must treat as device memory."""
    return KVPool(layout, num_pages, device=TEST_DEVICE, host_visible=False)
