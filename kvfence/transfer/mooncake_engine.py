"""A small typed layer over the Mooncake Transfer Engine: one endpoint, registered memory, one-sided page writes.

What it knows: how to find out whether Mooncake can run here (and say exactly why not), how to start an engine in
peer-to-peer handshake mode ("P2PHANDSHAKE": no etcd or metadata server; a peer is named by "host:rpc_port"),
how to register CPU tensors, and how to turn a list of (src_addr, dst_addr, nbytes) ranges into as few Mooncake
batch entries as possible (adjacent ranges are merged, since small entries are slow over TCP) and into batches
below the engine's per-peer lane limit (a batch above ~2,000 entries is refused with "TCP lane queue-full" and
can leave that peer's lane unusable for a while, so it must never be sent). A failed batch becomes a
`MooncakeTransferError` that says whether the peer was reachable and how many bytes had already landed.

What it does not know: which pages belong to which request, manifests, digests, or how the two sides exchange
session ids and buffer addresses (that is the transport built on top, kvfence/transfer/mooncake.py). It moves
bytes one way (local -> peer) and checks nothing about their content.

Measured between two processes on the 2-core CPU machines (docs/mooncake.md): about 0.9-1.4 GB/s for large
entries, 0.7-0.8 GB/s for 64 KiB entries, 0.17-0.3 GB/s for 16 KiB entries -- so merging adjacent pages matters.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvfence.errors import KvfenceError
from kvfence.kv.pool import KVPool

# The engine's per-peer TCP lane queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, 1024 by default in 0.3.x) plus its
# admission queue accept about 2,048 entries at once; half the queue leaves room for a second writer on the same
# peer. Callers can lower it; raising it above the queue is refused.
_LANE_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_DEFAULT_LANE_QUEUE = 1024

# Debian packages that provide the shared libraries the non-CUDA wheel links against.
_DEBIAN_PACKAGE_OF_LIB = {
    "libibverbs.so.1": "libibverbs1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
_PIP_HINT = "pip install mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine on CUDA hosts)"
_APT_HINT = "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
# Protocols this wrapper was tried with. The engine accepts any name and quietly uses TCP for names it does not
# know, and for "rdma" on a host without RDMA devices.
PROTOCOLS = ("tcp", "rdma")


class MooncakeTransferError(KvfenceError):
    """A batch the engine refused or failed. Bytes of the failed batch may have partly landed on the peer."""

    def __init__(self, message: str, target: str, rc: int, bytes_done: int, peer_reachable: bool) -> None:
        super().__init__(message)
        self.target = target
        self.rc = rc
        self.bytes_done = bytes_done  # bytes of the batches that completed before the failing one
        self.peer_reachable = peer_reachable


class MooncakeStatus(NamedTuple):
    ok: bool
    reason: str


@dataclass(frozen=True)
class Region:
    """A range of memory registered with an engine: [addr, addr + nbytes)."""

    addr: int
    nbytes: int

    def __post_init__(self) -> None:
        assert self.addr > 0 and self.nbytes > 0, (self.addr, self.nbytes)

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


@dataclass(frozen=True)
class Peer:
    """Where to write: a peer's session id ("host:rpc_port") and, when known, the regions it registered.

    With regions, every destination range is checked against them before anything is sent, and no merged entry
    crosses from one region into the next. Without them the engine alone checks (and only says "-1").
    """

    session_id: str
    regions: tuple[Region, ...] = ()


class WriteResult(NamedTuple):
    ranges: int  # ranges the caller asked for
    entries: int  # Mooncake batch entries after merging adjacent ranges
    batches: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class BufferBase(NamedTuple):
    """One (layer, buffer) tensor of a KV pool: its first byte and the bytes one page of it takes."""

    addr: int
    page_nbytes: int


# ---------------------------------------------------------------------------------------------------- availability


def explain_import_error(exc: BaseException) -> str:
    """A sentence saying why `mooncake.engine` did not import, with the command that fixes it."""
    msg = str(exc)
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        if exc.name == "mooncake":
            return f"the Mooncake Python package is not installed ({_PIP_HINT})"
        return f"the installed 'mooncake' package has no transfer engine ({exc.name} missing); {_PIP_HINT}"
    libs = re.findall(r"(lib[\w.+-]+?\.so(?:\.\d+)*)", msg)
    if libs:
        lib = os.path.basename(libs[0])
        pkg = _DEBIAN_PACKAGE_OF_LIB.get(lib)
        fix = f"apt-get install -y {pkg}" if pkg else _APT_HINT
        return f"Mooncake's engine cannot load the system library {lib} ({msg.strip()}); {fix}"
    return f"Mooncake's engine failed to import: {type(exc).__name__}: {msg.strip()}"


def _import_engine() -> Any:
    """Import `mooncake.engine` lazily, quietening the engine's INFO/WARNING log unless the user set a level."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        raise KvfenceError(explain_import_error(exc)) from exc


def mooncake_version() -> str | None:
    for dist in _DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def mooncake_gpu_memory() -> bool | None:
    """Whether the installed Mooncake build handles GPU memory (`mooncake.engine.SUPPORT_CUDA`: the CUDA wheel
    `mooncake-transfer-engine`; the non-CUDA wheel says False and takes every address for host memory); None when
    Mooncake does not import. kvfence registers host memory only either way (`transfer.mooncake`)."""
    if package_missing_reason() is not None:
        return None
    try:
        return bool(getattr(_import_engine(), "SUPPORT_CUDA", False))
    except KvfenceError:
        return None


def package_missing_reason() -> str | None:
    """Why Mooncake cannot run when its package is not installed at all (found without importing it), else None."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    return None if spec is not None else f"the Mooncake Python package is not installed ({_PIP_HINT})"


@functools.cache
def mooncake_available(hostname: str = "127.0.0.1", protocol: str = "tcp") -> MooncakeStatus:
    """(ok, reason): whether an engine can be imported, started and used here, and if not exactly why.

    Starts one throwaway engine and writes 64 bytes to itself through its own session id (initialise alone
    succeeds even for an unknown protocol or an unresolvable host). About a second; cached per process.
    """
    missing = package_missing_reason()
    if missing is not None:
        return MooncakeStatus(False, missing)
    try:
        ep = MooncakeEndpoint(hostname, protocol)
    except KvfenceError as exc:
        return MooncakeStatus(False, str(exc))
    ep.close()
    return MooncakeStatus(True, f"{mooncake_version() or 'mooncake'}: {protocol} engine works on {hostname}")


def lane_queue_limit() -> int:
    """The engine's per-peer queue size: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or its default."""
    raw = os.environ.get(_LANE_QUEUE_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else _DEFAULT_LANE_QUEUE


def default_max_batch() -> int:
    return max(1, lane_queue_limit() // 2)


# ---------------------------------------------------------------------------------------------------- range planning


def _region_index(regions: Sequence[Region], starts: Sequence[int], addr: int, nbytes: int) -> int | None:
    """Index of the region holding [addr, addr + nbytes), or None."""
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and regions[i].addr <= addr and addr + nbytes <= regions[i].end:
        return i
    return None


def plan_entries(
    ranges: Iterable[tuple[int, int, int]],
    src_regions: Sequence[Region] = (),
    dst_regions: Sequence[Region] = (),
    max_entry_bytes: int | None = None,
) -> list[tuple[int, int, int]]:
    """Check (src, dst, nbytes) ranges and merge adjacent ones; returns entries sorted by destination.

    Refuses (KvfenceError) empty ranges, overlapping destinations, and ranges outside the given regions (an
    empty region list means "unchecked"). Two ranges merge when both their sources and their destinations are
    back to back and each side stays inside one region. Entries longer than `max_entry_bytes` are split.
    """
    src_regions = sorted(src_regions, key=lambda r: r.addr)
    dst_regions = sorted(dst_regions, key=lambda r: r.addr)
    src_starts = [r.addr for r in src_regions]
    dst_starts = [r.addr for r in dst_regions]

    checked: list[tuple[int, int, int, int, int]] = []  # (dst, src, nbytes, src_region, dst_region)
    for src, dst, n in ranges:
        if n <= 0:
            raise KvfenceError(f"transfer range of {n} bytes (src {src:#x} -> dst {dst:#x}); lengths must be > 0")
        si = _region_index(src_regions, src_starts, src, n) if src_regions else -1
        if si is None:
            raise KvfenceError(f"source range {src:#x}+{n} is not inside memory registered with this endpoint")
        di = _region_index(dst_regions, dst_starts, dst, n) if dst_regions else -1
        if di is None:
            raise KvfenceError(f"destination range {dst:#x}+{n} is not inside any region the peer registered")
        checked.append((dst, src, n, si, di))
    checked.sort()

    merged: list[list[int]] = []  # [dst, src, nbytes, src_region, dst_region]
    for dst, src, n, si, di in checked:
        if merged:
            pd, ps, pn, psi, pdi = merged[-1]
            if dst < pd + pn:
                raise KvfenceError(f"destination ranges overlap at {dst:#x} (previous ends at {pd + pn:#x})")
            if dst == pd + pn and src == ps + pn and si == psi and di == pdi:
                merged[-1][2] += n
                continue
        merged.append([dst, src, n, si, di])

    entries: list[tuple[int, int, int]] = []
    for dst, src, n, _, _ in merged:
        step = n if max_entry_bytes is None else max_entry_bytes
        for off in range(0, n, step):
            entries.append((src + off, dst + off, min(step, n - off)))
    return entries


def split_batches(
    entries: Sequence[tuple[int, int, int]], max_batch: int, max_batch_bytes: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Cut entries into batches of at most `max_batch` entries and (when given) `max_batch_bytes` bytes."""
    assert max_batch > 0, max_batch
    batches: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    cur_bytes = 0
    for e in entries:
        if cur and (len(cur) == max_batch or (max_batch_bytes is not None and cur_bytes + e[2] > max_batch_bytes)):
            batches.append(cur)
            cur, cur_bytes = [], 0
        cur.append(e)
        cur_bytes += e[2]
    if cur:
        batches.append(cur)
    return batches


def pool_buffer_bases(pool: KVPool) -> list[BufferBase]:
    """Every (layer, buffer) tensor of a CPU pool in the layout's logical order, as (first byte, bytes per page)."""
    bases = []
    for layer in range(pool.layout.num_layers):
        for spec in pool.layout.buffers:
            t = pool.tensors[layer][spec.name]  # [num_pages, page_size, *token_shape]
            assert t.is_contiguous(), (layer, spec.name)
            bases.append(BufferBase(t.data_ptr(), t[0].numel() * t.element_size()))
    return bases


def page_ranges(
    src: Sequence[BufferBase], dst: Sequence[BufferBase], src_pages: Sequence[int], dst_pages: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(src, dst, nbytes) for copying src_pages[i] to dst_pages[i] in every buffer; both sides must share a layout."""
    if len(src) != len(dst) or any(s.page_nbytes != d.page_nbytes for s, d in zip(src, dst, strict=True)):
        raise KvfenceError("source and destination pools have different buffers; compare layout fingerprints first")
    if len(src_pages) != len(dst_pages):
        raise KvfenceError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    return [
        (s.addr + sp * s.page_nbytes, d.addr + dp * d.page_nbytes, s.page_nbytes)
        for s, d in zip(src, dst, strict=True)
        for sp, dp in zip(src_pages, dst_pages, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------- the endpoint


class MooncakeEndpoint:
    """One Mooncake engine in P2P-handshake mode: registers local memory and writes it into peers' memory.

    A peer that only receives needs nothing but an endpoint, its registered regions and its `session_id`, which
    the writer gets over the control channel. Calls block; the engine releases the GIL while bytes move.
    """

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", self_check: bool = True
    ) -> None:
        if protocol not in PROTOCOLS:
            raise KvfenceError(f"Mooncake protocol {protocol!r} is not supported here; choose one of {PROTOCOLS}")
        engine_mod = _import_engine()
        self.hostname = hostname
        self.protocol = protocol
        self._engine = engine_mod.TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise KvfenceError(f"Mooncake engine failed to initialise on {hostname} ({protocol!r}, rc {rc})")
        self.rpc_port: int = self._engine.get_rpc_port()
        assert self.rpc_port > 0, self.rpc_port
        self._regions: list[Region] = []  # sorted by addr
        self._keepalive: dict[int, torch.Tensor] = {}  # addr -> tensor, so registered memory outlives its caller
        self._closed = False
        if self_check:
            try:
                self._self_check()
            except KvfenceError:
                self.close()
                raise

    def _self_check(self) -> None:
        """Write 64 bytes to ourselves through our own session id: proves the hostname and transport work."""
        a = torch.arange(64, dtype=torch.uint8)
        b = torch.zeros(64, dtype=torch.uint8)
        ra, rb = self.register(a), self.register(b)
        try:
            rc = self._engine.transfer_sync_write(self.session_id, a.data_ptr(), b.data_ptr(), 64)
            if rc != 0 or not torch.equal(a, b):
                raise KvfenceError(
                    f"Mooncake engine started but cannot write to itself at {self.session_id} (rc {rc}): "
                    f"is {self.hostname!r} an address of this host that peers can reach?"
                )
        finally:
            self.unregister(ra)
            self.unregister(rb)

    @property
    def session_id(self) -> str:
        """The name peers use to reach this endpoint ("host:rpc_port")."""
        return f"{self.hostname}:{self.rpc_port}"

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    def peer(self) -> Peer:
        """This endpoint as a writer's target, with the regions it registered."""
        return Peer(self.session_id, self.regions)

    # -- memory ------------------------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous CPU tensor's bytes; the endpoint keeps the tensor alive until `unregister`."""
        if tensor.device.type != "cpu":
            raise KvfenceError(f"this Mooncake build registers CPU memory only; got a tensor on {tensor.device}")
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise KvfenceError("only contiguous, non-empty tensors can be registered")
        region = Region(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        self._register_range(region)
        self._keepalive[region.addr] = tensor
        return region

    def register_pool(self, pool: KVPool) -> list[Region]:
        """Register every (layer, buffer) tensor of a CPU KV pool, in logical order."""
        regions = []
        for layer in range(pool.layout.num_layers):
            for spec in pool.layout.buffers:
                regions.append(self.register(pool.tensors[layer][spec.name]))
        return regions

    def _register_range(self, region: Region) -> None:
        self._check_open()
        i = bisect.bisect_left([r.addr for r in self._regions], region.addr)
        neighbours = self._regions[max(0, i - 1) : i + 1]
        if any(r.addr < region.end and region.addr < r.end for r in neighbours):
            raise KvfenceError(f"memory {region.addr:#x}+{region.nbytes} overlaps a region already registered")
        rc = self._engine.register_memory(region.addr, region.nbytes)
        if rc != 0:
            raise KvfenceError(f"Mooncake refused to register {region.nbytes} bytes at {region.addr:#x} (rc {rc})")
        self._regions.insert(i, region)

    def unregister(self, region: Region) -> None:
        self._check_open()
        if region not in self._regions:
            raise KvfenceError(f"region {region.addr:#x}+{region.nbytes} is not registered with this endpoint")
        rc = self._engine.unregister_memory(region.addr)
        if rc != 0:
            raise KvfenceError(f"Mooncake refused to unregister {region.addr:#x} (rc {rc})")
        self._regions.remove(region)
        self._keepalive.pop(region.addr, None)

    # -- transfers ---------------------------------------------------------------------------------------------

    def probe(self, target: str | Peer) -> bool:
        """Whether the peer's handshake port answers."""
        self._check_open()
        session = target.session_id if isinstance(target, Peer) else target
        return self._engine.send_probe(session) == 0

    def write_pages(
        self,
        target: str | Peer,
        ranges: Iterable[tuple[int, int, int]],
        max_batch: int | None = None,
        max_batch_bytes: int | None = None,
    ) -> WriteResult:
        """Write local (src_addr, dst_addr, nbytes) ranges into the peer, synchronously.

        Adjacent ranges are merged, then sent in batches of at most `max_batch` entries (default: half the lane
        queue) and `max_batch_bytes` bytes. Sources must lie in memory registered here; destinations in the
        peer's regions when `target` is a `Peer` that lists them. Raises MooncakeTransferError on the first
        failed batch; earlier batches have landed, the failed one may have partly landed.
        """
        self._check_open()
        limit = lane_queue_limit()
        max_batch = default_max_batch() if max_batch is None else max_batch
        if not 0 < max_batch <= limit:
            raise KvfenceError(
                f"max_batch={max_batch} must be in 1..{limit}: the engine's per-peer lane queue "
                f"({_LANE_QUEUE_ENV}) holds {limit} entries and refuses larger batches with 'TCP lane queue-full'"
            )
        if max_batch_bytes is not None and max_batch_bytes <= 0:
            raise KvfenceError(f"max_batch_bytes must be positive, got {max_batch_bytes}")
        peer = target if isinstance(target, Peer) else Peer(target)
        ranges = list(ranges)
        entries = plan_entries(ranges, self._regions, peer.regions, max_entry_bytes=max_batch_bytes)
        batches = split_batches(entries, max_batch, max_batch_bytes)

        t0 = time.perf_counter()
        done = 0
        for bi, batch in enumerate(batches):
            srcs = [e[0] for e in batch]
            dsts = [e[1] for e in batch]
            lens = [e[2] for e in batch]
            rc = self._engine.batch_transfer_sync_write(peer.session_id, srcs, dsts, lens)
            if rc != 0:
                raise self._failure(peer, rc, bi, len(batches), len(batch), sum(lens), done)
            done += sum(lens)
        return WriteResult(len(ranges), len(entries), len(batches), done, time.perf_counter() - t0)

    def _failure(
        self, peer: Peer, rc: int, index: int, nbatches: int, nentries: int, nbytes: int, done: int
    ) -> MooncakeTransferError:
        reachable = self._engine.send_probe(peer.session_id) == 0
        where = f"batch {index + 1}/{nbatches} ({nentries} entries, {nbytes} bytes) to {peer.session_id}"
        if not reachable:
            why = (
                "the peer does not answer its handshake port: is the receiving process alive, and is "
                "'host:rpc_port' its session id?"
            )
        else:
            why = (
                "the peer answers, so the engine refused the batch: a destination outside the memory the peer "
                "registered, or the per-peer lane queue was full (after that the lane can stay unusable for "
                "seconds; a new endpoint recovers)"
            )
        msg = (
            f"Mooncake write failed (rc {rc}) on {where}: {why}. {done} bytes of earlier batches landed; the "
            "failed batch may have partly landed, so treat every destination page of this transfer as possibly "
            "overwritten."
        )
        return MooncakeTransferError(msg, peer.session_id, rc, done, reachable)

    # -- lifetime ----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KvfenceError("this Mooncake endpoint is closed")

    def close(self) -> None:
        """Unregister everything and drop the engine (its threads and ports go with it)."""
        if self._closed:
            return
        for region in list(self._regions):
            self._engine.unregister_memory(region.addr)
        self._regions.clear()
        self._keepalive.clear()
        self._engine = None
        self._closed = True

    def __enter__(self) -> MooncakeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
