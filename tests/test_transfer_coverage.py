"""Property: whatever order, duplicates or gaps page frames arrive in, verification passes exactly when every
allocated page landed once, and then decode's pages hold exactly prefill's bytes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import build_manifest
from kvfence.integrity.verify import Expectation, Reason, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import ReceiverCore, SlotStatus, fill_from_bytes
from kvfence.transfer.frames import Done, Manifest
from tests.helpers.auth import cap, plane_auth, sealed

AUTH = plane_auth()  # one cluster key for every sender and receiver of this module

LAYOUT = KVLayout("LlamaForCausalLM", 2, (KVBufferSpec("k", (1, 4)), KVBufferSpec("v", (1, 4))), 2, torch.float32)
N = 12


class _Link:
    def send(self, header, payload=()) -> None:
        pass


def _pools() -> tuple[KVPool, KVPool]:
    src, dst = KVPool(LAYOUT, N), KVPool(LAYOUT, N)
    g = torch.Generator().manual_seed(0)
    for pool, scale in ((src, 1.0), (dst, -1.0)):  # dst starts with other bytes: a previous request's
        for layer in pool.tensors:
            for t in layer.values():
                t.copy_(scale * torch.randn(t.shape, generator=g))
    return src, dst


SRC, _ = _pools()


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 2 * 6),
    data=st.data(),
)
def test_verification_passes_iff_every_page_landed_exactly_once(num_tokens: int, data: st.DataObject) -> None:
    _, dst = _pools()
    num_pages = -(-num_tokens // LAYOUT.page_size)
    src_pages = data.draw(st.permutations(range(N)))[:num_pages]
    dst_pages = data.draw(st.permutations(range(N)))[:num_pages]
    sends = data.draw(st.permutations(range(num_pages)))  # any arrival order
    mutation = data.draw(st.sampled_from(["none", "drop", "duplicate", "outside"]))
    if mutation == "drop":
        sends = sends[1:]
    elif mutation == "duplicate":
        sends = [*sends, data.draw(st.sampled_from(sends))]
    elif mutation == "outside":
        sends = [*sends, num_pages]  # an index beyond decode's allocation
    ids = list(range(num_tokens))
    m = build_manifest("r", cap("r"), ids, SRC, src_pages)
    core = ReceiverCore(dst, AUTH)
    slot = core.expect("r", dst_pages, cap("r"))
    link = _Link()  # every frame of a transfer comes on the connection its manifest came on
    core.on_frame(link, Manifest("r", cap("r")), sealed(m, AUTH))
    payload = {i: SRC.read_page(p) for i, p in enumerate(src_pages)}
    payload[num_pages] = SRC.read_page(src_pages[0])
    for i in sends:
        core.receive_page("r", cap("r"), i, LAYOUT.bytes_per_page, fill_from_bytes(payload[i]))
    core.on_frame(link, Done("r", cap("r"), len(sends)))
    assert slot.status == SlotStatus.COMPLETE and slot.settled

    res = verify_handoff(
        m, Expectation("r", num_tokens, token_hash(ids), cap("r")), LAYOUT, dst_pages, slot.coverage, dst
    )
    assert res.ok == (mutation == "none"), (sends, res)
    if res.ok:
        assert all(dst.read_page(d) == SRC.read_page(s) for s, d in zip(src_pages, dst_pages, strict=True))
    else:
        assert res.reason == Reason.COVERAGE_GAP
