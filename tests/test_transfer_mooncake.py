"""Mooncake engine wrapper: range planning (always), and real two-process writes (when Mooncake can run here).

The receiving side is a separate Python process that owns a KVPool registered with its own MooncakeEndpoint;
it answers line-based JSON commands on stdin/stdout (dump pages, refill with a sentinel). The sending side is this
process. Tests that need the engine skip with `mooncake_available()`'s reason when it cannot start.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvfence.errors import KvfenceError
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.mooncake_engine import (
    BufferBase,
    MooncakeEndpoint,
    MooncakeTransferError,
    Peer,
    Region,
    default_max_batch,
    explain_import_error,
    lane_queue_limit,
    mooncake_available,
    page_ranges,
    plan_entries,
    pool_buffer_bases,
    split_batches,
)

SENTINEL = -7.0  # the receiver's pool is filled with this before each test

# 2 layers x (k, v), 1-token pages of 2x4 float32: 32 bytes per buffer per page, 128 bytes per page.
LAYOUT = KVLayout(
    architecture="TestArch",
    num_layers=2,
    buffers=(KVBufferSpec("k", (2, 4)), KVBufferSpec("v", (2, 4))),
    page_size=1,
    dtype=torch.float32,
)
NUM_PAGES = 1200  # enough pages for a transfer of > 2 x the lane queue in un-mergeable entries

RECEIVER = r"""
import base64, json, sys
from kvfence.kv.layout import KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.mooncake_engine import MooncakeEndpoint, pool_buffer_bases

layout = KVLayout.from_description(json.loads(sys.argv[1]))
pool = KVPool(layout, int(sys.argv[2]))
sentinel = float(sys.argv[3])
for layer in pool.tensors:
    for t in layer.values():
        t.fill_(sentinel)
ep = MooncakeEndpoint("127.0.0.1")
regions = ep.register_pool(pool)
print(json.dumps({"session": ep.session_id, "bases": pool_buffer_bases(pool),
                  "regions": [[r.addr, r.nbytes] for r in regions]}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "dump":
        pages = [base64.b64encode(pool.read_page(p)).decode() for p in range(pool.num_pages)]
        print(json.dumps({"pages": pages}), flush=True)
    elif cmd == "reset":
        for layer in pool.tensors:
            for t in layer.values():
                t.fill_(sentinel)
        print(json.dumps({"ok": True}), flush=True)
    elif cmd == "quit":
        break
ep.close()
"""


# ---------------------------------------------------------------------------------------------------- planning


def test_plan_merges_back_to_back_ranges_and_keeps_gaps() -> None:
    ranges = [(1000, 5000, 10), (1010, 5010, 10), (1020, 5040, 10), (2000, 6000, 5)]
    assert plan_entries(ranges) == [(1000, 5000, 20), (1020, 5040, 10), (2000, 6000, 5)]


def test_plan_does_not_merge_when_only_one_side_is_adjacent() -> None:
    # destinations back to back, sources in the opposite order: two entries, sorted by destination
    assert plan_entries([(1990, 5010, 10), (2000, 5000, 10)]) == [(2000, 5000, 10), (1990, 5010, 10)]


def test_plan_refuses_overlapping_destinations() -> None:
    with pytest.raises(KvfenceError, match="overlap"):
        plan_entries([(1000, 5000, 10), (3000, 5005, 10)])


def test_plan_refuses_empty_range() -> None:
    with pytest.raises(KvfenceError, match="must be > 0"):
        plan_entries([(1000, 5000, 0)])


def test_plan_checks_regions_and_does_not_merge_across_them() -> None:
    src = [Region(1000, 100)]
    dst = [Region(5000, 10), Region(5010, 10)]  # two regions back to back
    assert plan_entries([(1000, 5000, 10), (1010, 5010, 10)], src, dst) == [(1000, 5000, 10), (1010, 5010, 10)]
    with pytest.raises(KvfenceError, match="not inside any region the peer registered"):
        plan_entries([(1000, 5015, 10)], src, dst)  # straddles the end of the second region
    with pytest.raises(KvfenceError, match="not inside memory registered with this endpoint"):
        plan_entries([(1095, 5000, 10)], src, dst)


def test_plan_splits_entries_above_max_entry_bytes() -> None:
    assert plan_entries([(1000, 5000, 25)], max_entry_bytes=10) == [(1000, 5000, 10), (1010, 5010, 10), (1020, 5020, 5)]


def test_split_batches_bounds_entries_and_bytes() -> None:
    entries = [(i * 100, 10_000 + i * 100, 10) for i in range(25)]
    by_count = split_batches(entries, max_batch=10)
    assert [len(b) for b in by_count] == [10, 10, 5]
    by_bytes = split_batches(entries, max_batch=10, max_batch_bytes=40)
    assert [len(b) for b in by_bytes] == [4] * 6 + [1]
    assert [e for b in by_bytes for e in b] == entries


def test_page_ranges_cover_every_buffer_of_each_page() -> None:
    src = [BufferBase(1000, 32), BufferBase(9000, 32)]
    dst = [BufferBase(50_000, 32), BufferBase(90_000, 32)]
    got = page_ranges(src, dst, src_pages=[0, 3], dst_pages=[5, 1])
    assert got == [(1000, 50_160, 32), (1096, 50_032, 32), (9000, 90_160, 32), (9096, 90_032, 32)]
    with pytest.raises(KvfenceError, match="different buffers"):
        page_ranges(src, [BufferBase(50_000, 64), BufferBase(90_000, 32)], [0], [0])


def test_pool_buffer_bases_match_the_pool_tensors() -> None:
    pool = KVPool(LAYOUT, 3)
    bases = pool_buffer_bases(pool)
    assert len(bases) == 4
    assert bases[1] == BufferBase(pool.tensors[0]["v"].data_ptr(), 32)
    assert bases[3].addr == pool.tensors[1]["v"].data_ptr()


def test_explain_import_error_names_the_fix() -> None:
    missing_pkg = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in explain_import_error(missing_pkg)
    missing_lib = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    msg = explain_import_error(missing_lib)
    assert "libibverbs.so.1" in msg and "apt-get install -y libibverbs1" in msg
    nl = ImportError("/lib/x86_64-linux-gnu/libnl-route-3.so.200: file too short")
    assert "apt-get install -y libnl-route-3-200" in explain_import_error(nl)


def test_missing_package_is_reported_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ok, reason = mooncake_available.__wrapped__("127.0.0.1", "tcp")  # bypass the per-process cache
    assert not ok and "pip install mooncake-transfer-engine-non-cuda" in reason


def test_default_batch_stays_under_the_lane_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", raising=False)
    assert lane_queue_limit() == 1024 and default_max_batch() == 512
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "200")
    assert default_max_batch() == 100


# ---------------------------------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def mooncake() -> None:
    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(f"Mooncake unavailable: {reason}")


class ReceiverProcess:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, json.dumps(LAYOUT.describe()), str(NUM_PAGES), str(SENTINEL)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        hello = self._read()
        self.session: str = hello["session"]
        self.bases = [BufferBase(a, n) for a, n in hello["bases"]]
        self.peer = Peer(self.session, tuple(Region(a, n) for a, n in hello["regions"]))

    def _read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"receiver process exited (rc {self.proc.poll()})"
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def pages(self) -> list[bytes]:
        return [base64.b64decode(p) for p in self.ask("dump")["pages"]]

    def close(self) -> None:
        try:
            self.ask("quit")
        except (AssertionError, OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def receiver(mooncake: None) -> Iterator[ReceiverProcess]:
    r = ReceiverProcess()
    yield r
    r.close()


@pytest.fixture(scope="module")
def sender(mooncake: None) -> Iterator[tuple[MooncakeEndpoint, KVPool]]:
    torch.manual_seed(0)
    pool = KVPool(LAYOUT, NUM_PAGES)
    for layer in pool.tensors:
        for t in layer.values():
            t.copy_(torch.randn_like(t))
    ep = MooncakeEndpoint("127.0.0.1")
    ep.register_pool(pool)
    yield ep, pool
    ep.close()


@pytest.fixture
def fresh(receiver: ReceiverProcess) -> ReceiverProcess:
    assert receiver.ask("reset")["ok"]
    return receiver


def _sentinel_page() -> bytes:
    return torch.full((LAYOUT.bytes_per_page // 4,), SENTINEL, dtype=torch.float32).numpy().tobytes()


def test_pages_land_byte_exact_in_another_process(
    sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess
) -> None:
    ep, pool = sender
    src_pages, dst_pages = [1, 2, 3, 7], [4, 5, 6, 0]  # 1..3 -> 4..6 is one run per buffer; 7 -> 0 another
    ranges = page_ranges(pool_buffer_bases(pool), fresh.bases, src_pages, dst_pages)
    result = ep.write_pages(fresh.peer, ranges)
    assert result.ranges == 16 and result.entries == 8 and result.batches == 1
    assert result.nbytes == 4 * LAYOUT.bytes_per_page

    got = fresh.pages()
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert got[d] == pool.read_page(s), f"page {s} -> {d} differs"
    untouched = set(range(NUM_PAGES)) - set(dst_pages)
    assert all(got[p] == _sentinel_page() for p in untouched)


def test_transfer_above_the_lane_limit_is_chunked(
    sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess
) -> None:
    ep, pool = sender
    n = 1100
    src_pages = list(range(n))
    dst_pages = list(reversed(range(n)))  # reversed: no two ranges merge, 4 buffers x 1100 = 4400 entries
    ranges = page_ranges(pool_buffer_bases(pool), fresh.bases, src_pages, dst_pages)
    result = ep.write_pages(fresh.peer, ranges)
    assert result.entries == 4 * n > 2 * lane_queue_limit()
    assert result.batches == math.ceil(4 * n / default_max_batch())

    got = fresh.pages()
    assert all(got[d] == pool.read_page(s) for s, d in zip(src_pages, dst_pages, strict=True))
    assert all(got[p] == _sentinel_page() for p in range(n, NUM_PAGES))


def test_engine_itself_refuses_an_unchunked_batch_above_the_lane_limit(
    sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess
) -> None:
    """Why chunking exists: one raw batch of 4,400 entries is refused by Mooncake ("TCP lane queue-full")."""
    _, pool = sender
    ranges = page_ranges(pool_buffer_bases(pool), fresh.bases, list(range(1100)), list(reversed(range(1100))))
    with MooncakeEndpoint("127.0.0.1") as throwaway:  # a refused batch can leave this lane stuck; keep it apart
        throwaway.register_pool(pool)
        rc = throwaway._engine.batch_transfer_sync_write(
            fresh.session, [r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges]
        )
    assert rc != 0, "Mooncake accepted 4,400 entries in one batch: the lane limit changed, update docs/mooncake.md"


def test_batch_size_above_the_lane_queue_is_refused_before_sending(
    sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess
) -> None:
    ep, pool = sender
    ranges = page_ranges(pool_buffer_bases(pool), fresh.bases, [0], [0])
    with pytest.raises(KvfenceError, match="lane queue"):
        ep.write_pages(fresh.peer, ranges, max_batch=lane_queue_limit() + 1)
    assert fresh.pages()[0] == _sentinel_page()


def test_wrong_target_fails_with_a_clear_error(sender: tuple[MooncakeEndpoint, KVPool]) -> None:
    ep, pool = sender
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    base = pool_buffer_bases(pool)[0]
    with pytest.raises(MooncakeTransferError, match="does not answer its handshake port") as info:
        ep.write_pages(dead, [(base.addr, base.addr, base.page_nbytes)])
    assert info.value.peer_reachable is False and info.value.bytes_done == 0 and info.value.target == dead


def test_destination_outside_peer_memory(sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess) -> None:
    ep, pool = sender
    src = pool_buffer_bases(pool)[0].addr
    beyond = max(r.end for r in fresh.peer.regions) - 8  # 32 bytes from 8 bytes before the end of its last region
    # With the peer's regions known, the range is refused before anything is sent.
    with pytest.raises(KvfenceError, match="not inside any region the peer registered"):
        ep.write_pages(fresh.peer, [(src, beyond, 32)])
    # Without them the engine refuses it; the peer answers, so the error says the batch itself was refused.
    with MooncakeEndpoint("127.0.0.1") as throwaway:
        throwaway.register_pool(pool)
        with pytest.raises(MooncakeTransferError, match="the peer answers") as info:
            throwaway.write_pages(fresh.session, [(src, beyond, 32)])
    assert info.value.peer_reachable is True
    assert all(p == _sentinel_page() for p in fresh.pages())


def test_unusable_hostname_is_reported_at_start(mooncake: None) -> None:
    ok, reason = mooncake_available("no-such-host.invalid")
    assert not ok and "cannot write to itself" in reason and "no-such-host.invalid" in reason


def test_unregistered_source_is_refused(sender: tuple[MooncakeEndpoint, KVPool], fresh: ReceiverProcess) -> None:
    ep, _ = sender
    stray = torch.ones(64, dtype=torch.uint8)
    with pytest.raises(KvfenceError, match="not inside memory registered with this endpoint"):
        ep.write_pages(fresh.peer, [(stray.data_ptr(), fresh.bases[0].addr, 32)])
