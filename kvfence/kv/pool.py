"""The paged KV pool: the tensors that hold every layer's per-token buffers.

What it knows: one tensor per (layer, buffer) of a `KVLayout`, shaped
[num_pages, page_size, *token_shape], so one page of one buffer is a contiguous
slice. It gives the attention code a flat per-slot view (slot = page * page_size +
offset) and gives integrity/transfer code the raw bytes of a page in the layout's
logical order, to read, write and poison. It says whether those bytes may be read and
written in place through host memoryviews (`host_visible`: a CPU pool) or must go through
torch ops and host staging (a device pool; integrity.device_digest, transfer.staging).

What it does not know: which request owns a page (that is the allocator), nor
whether a page's content is valid. It never allocates; it only stores.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvfence.hugepages import huge_zeros
from kvfence.kv.layout import KVLayout


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer; on the CPU in transparent huge pages where Linux grants them (a decode step reads pages
    scattered over the whole pool: fewer TLB misses). The same bytes and resident size either way."""
    if device.type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVPool:
    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", host_visible: bool | None = None
    ) -> None:
        """`host_visible`: whether integrity and transfer code may touch the pages through host memoryviews in
        place; default: the pool is on the CPU. False on a CPU pool makes it take every device path (digests by
        torch ops, transfers through host staging), which is how CI runs those paths without a GPU."""
        assert num_pages > 0, num_pages
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.host_visible = self.device.type == "cpu" if host_visible is None else bool(host_visible)
        assert not (self.host_visible and self.device.type != "cpu"), "only a CPU pool's bytes are host-visible"
        # tensors[layer][buffer_name]: [num_pages, page_size, *token_shape]
        self.tensors: list[dict[str, torch.Tensor]] = [
            {
                spec.name: _zeros((num_pages, layout.page_size, *spec.token_shape), layout.dtype, self.device)
                for spec in layout.buffers
            }
            for _ in range(layout.num_layers)
        ]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page

    def flat(self, layer: int, name: str) -> torch.Tensor:
        """[num_slots, *token_shape] view of one layer's buffer, indexed by slot."""
        t = self.tensors[layer][name]
        return t.view(self.num_slots, *t.shape[2:])

    def layer_buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """Flat views of every buffer of one layer, by name."""
        return {spec.name: self.flat(layer, spec.name) for spec in self.layout.buffers}

    def page_views(self, page: int) -> list[torch.Tensor]:
        """Contiguous views of one page, in the layout's logical order (layer, buffer)."""
        assert 0 <= page < self.num_pages, (page, self.num_pages)
        return [
            self.tensors[layer][spec.name][page]
            for layer in range(self.layout.num_layers)
            for spec in self.layout.buffers
        ]

    def page_memoryviews(self, page: int) -> list[memoryview]:
        """Raw bytes of one page (host-visible pools only), logical order, zero-copy."""
        assert self.host_visible, "raw byte views need a host-visible pool; device pools go through host staging"
        return [v.view(torch.uint8).numpy().data.cast("B") for v in self.page_views(page)]

    def read_page(self, page: int) -> bytes:
        """A copy of one page's bytes in logical order."""
        return b"".join(v.contiguous().view(torch.uint8).cpu().numpy().tobytes() for v in self.page_views(page))

    def write_page(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page with `bytes_per_page` bytes given in logical order."""
        expected = self.layout.bytes_per_page
        if len(data) != expected:
            raise ValueError(f"page payload is {len(data)} bytes, layout needs {expected}")
        self.write_page_prefix(page, data)

    def write_page_prefix(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite the first len(data) bytes of one page (logical order); the rest of the page keeps its bytes."""
        if len(data) > self.layout.bytes_per_page:
            raise ValueError(f"{len(data)} bytes do not fit a page of {self.layout.bytes_per_page}")
        src = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        offset = 0
        for view in self.page_views(page):
            n = min(view.numel() * view.element_size(), len(data) - offset)
            if n <= 0:
                break
            view.view(torch.uint8).view(-1)[:n].copy_(src[offset : offset + n])
            offset += n

    def slice_offsets(self) -> list[tuple[int, str, int, int]]:
        """(layer, buffer, byte offset in a page's logical order, bytes) of every slice of a page."""
        out, off = [], 0
        for layer in range(self.layout.num_layers):
            for spec in self.layout.buffers:
                nb = self.layout.buffer_bytes_per_page(spec)
                out.append((layer, spec.name, off, nb))
                off += nb
        return out

    def page_rows(self, layer: int, name: str) -> torch.Tensor:
        """[num_pages, slice_bytes] uint8 view of one (layer, buffer): row p is page p's slice, on the pool's device."""
        return self.tensors[layer][name].view(torch.uint8).view(self.num_pages, -1)

    def gather_pages(self, pages: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy `pages` ([P] long, on the pool's device) into `out` ([>= P, bytes_per_page] uint8, same device),
        page-major, each row in the layout's logical order (the wire order of a page); returns out[:P]."""
        n = pages.numel()  # [P]
        rows = out[:n]  # [P, bytes_per_page]
        for layer, name, off, nb in self.slice_offsets():
            rows[:, off : off + nb].copy_(self.page_rows(layer, name).index_select(0, pages))  # [P, nb]
        return rows

    def scatter_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """The inverse of `gather_pages`: row i of `data` ([P, bytes_per_page] uint8, pool's device) into page
        pages[i] ([P] long, pool's device)."""
        for layer, name, off, nb in self.slice_offsets():
            self.page_rows(layer, name).index_copy_(0, pages, data[:, off : off + nb])

    def poison(self, pages: Iterable[int]) -> None:
        """Fill pages with NaN (float dtypes) so any stale read shows up in the logits."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        if idx.numel() == 0:
            return
        for layer in self.tensors:
            for t in layer.values():
                t.index_fill_(0, idx, float("nan"))
