"""kvfence's verified handoff over vLLM's KV blocks: the one module that uses kvfence's manifest and transport here.

What it knows:

* `VllmBlockPool`: a `KVPool` over the cache tensors vLLM registered with the connector, without a copy. vLLM's
  block b of a layer is `tensor[b]`, contiguous; a kvfence page is one block of every layer, in the layer order
  vLLM lists them, so digests, canaries and the TCP transport read and write vLLM's blocks in place. The layout
  (`vllm_layout`) names the architecture, vLLM's attention backend and the physical shape of a block, so two
  instances whose blocks hold different bytes for the same tokens never verify against each other.
* `ProducerHandoff` (prefill): after the forward that completes a prompt, digests and canaries of its blocks go
  into a manifest (`integrity.manifest.build_manifest`) held under the front end's transfer id; vLLM keeps the
  blocks (the connector asked it to delay their release) until this object says they may go: after decode's
  verdict, a failed send, or the lease (`lease_s`) with no pull. A pull (`control.py`) for a transfer id starts the
  kvfence TCP send (`transfer.tcp.TcpSender`) to the decode address it names, once; a transfer id that was
  consumed, expired or never held is refused, saying which.
* `ConsumerHandoff` (decode): a `transfer.tcp.TcpReceiver` on decode's blocks. A load registers the blocks vLLM
  allocated as the request's page table (logical page -> block), asks prefill to push, and when the sender says
  done runs every check of `integrity.verify.verify_handoff` against the front end's expectation (token count and
  hash) and this instance's layout. The request may be scheduled only after that; any failure fails it, and its
  blocks are handed back only once no write of the transfer can land in them (the receive slot is settled). Every
  load ends with one `IntegrityRecord`, logged and sent to the front end's record address.

Authentication (docs/handoff.md, "Trust model"): both sides hold the deployment's cluster key. The TCP sender and
receiver run kvfence's authenticated data plane (`auth.plane.PlaneAuth`: a challenge-response on connect, a MAC on
every frame, the manifest sealed with the manifest key), decode's slot accepts only the transfer id the front end
issued, and the pull and record messages are MAC'd with a key derived from the same cluster key (`control.py`).
Records show a transfer's reference (`transfer.base.transfer_ref`), never its id.

What it does not know: vLLM (the connector translates its hooks into these calls), the front end, or which
requests are whose.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from kvfence.auth.keys import ClusterKey
from kvfence.auth.plane import PlaneAuth
from kvfence.faults import FaultInjector
from kvfence.integrations.vllm import control
from kvfence.integrations.vllm.control_messages import (
    MessageError,
    Ok,
    Pull,
    Record,
    Refused,
    reply_from,
    request_from,
    to_header,
)
from kvfence.integrations.vllm.params import ConsumeParams
from kvfence.integrity.digest import token_hash
from kvfence.integrity.manifest import HandoffManifest, build_manifest, pages_for_tokens
from kvfence.integrity.record import IntegrityRecord
from kvfence.integrity.verify import Expectation, Reason, VerifyResult, verify_handoff
from kvfence.kv.layout import KVBufferSpec, KVLayout
from kvfence.kv.pool import KVPool
from kvfence.transfer.base import SendHandle, SendStatus, SlotStatus, TransferConfig, transfer_ref
from kvfence.transfer.tcp import TcpReceiver, TcpSender

logger = logging.getLogger(__name__)
integrity_logger = logging.getLogger("kvfence.integrity")

_TOMBSTONES = 4096  # released transfer ids remembered, so a late pull learns why it is refused


@dataclass(frozen=True)
class HandoffConfig:
    """The connector's settings (`kv_connector_extra_config`), with their defaults."""

    host: str = "127.0.0.1"  # the address the control and data listeners bind and announce
    control_port: int = 0  # prefill: the pull channel (0: any free port)
    data_port: int = 0  # decode: kvfence's TCP receiver (0: any free port)
    lease_s: float = 30.0  # prefill: how long finished blocks wait for decode's pull
    verdict_timeout_s: float = 10.0  # prefill: after the last frame, how long decode's verdict may take
    transfer_timeout_s: float = 30.0  # decode: from the pull to the sender's last frame
    quarantine_timeout_s: float = 30.0  # decode: a failed load's blocks wait this long for its writer, then it is cut
    pull_wait_s: float = 5.0  # prefill: a pull that arrives before vLLM finished the request waits this long
    io_timeout_s: float = 10.0
    max_transfer_pages: int = 64
    cluster_key_file: str | None = None  # else $KVFENCE_CLUSTER_KEY_FILE or $KVFENCE_CLUSTER_KEY (auth.keys)
    insecure_no_auth: bool = False  # run the same protocol with the all-zero key: anyone can speak it (tests only)
    inject_fault: str | None = None  # tests only: kvfence's --inject-fault spec (faults.py)

    def __post_init__(self) -> None:
        for name in ("lease_s", "verdict_timeout_s", "transfer_timeout_s", "quarantine_timeout_s", "io_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv_connector_extra_config.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.control_port < 65536 or not 0 <= self.data_port < 65536:
            raise ValueError(f"ports must be in [0, 65535], got {self.control_port}, {self.data_port}")
        if self.max_transfer_pages <= 0:
            raise ValueError(f"kv_connector_extra_config.max_transfer_pages must be > 0, got {self.max_transfer_pages}")

    @classmethod
    def from_extra(cls, extra: dict | None) -> HandoffConfig:
        """From `kv_connector_extra_config`; an unknown key or a bad value is a ValueError naming it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        try:
            return cls(**extra)
        except TypeError as e:
            raise ValueError(f"kv_connector_extra_config: {e}") from None


def vllm_layout(
    architecture: str, backend: str, block_shape: Sequence[int], dtype: torch.dtype, block_size: int, num_layers: int
) -> KVLayout:
    """The kvfence layout of vLLM's blocks: one buffer per layer holding a whole block ([block_size tokens] x the
    elements each token keeps there), its physical shape named in the architecture, so the fingerprint differs
    whenever the bytes of a block are laid out differently."""
    numel = 1
    for d in block_shape:
        numel *= int(d)
    if numel % block_size:
        raise ValueError(f"a vLLM block of shape {list(block_shape)} does not split into {block_size} tokens")
    shape = "x".join(str(int(d)) for d in block_shape)
    return KVLayout(
        architecture=f"vllm/{architecture}/{backend}/block[{shape}]",
        num_layers=num_layers,
        buffers=(KVBufferSpec("kv", (numel // block_size,)),),
        page_size=block_size,
        dtype=dtype,
    )


class VllmBlockPool(KVPool):
    """A `KVPool` whose pages are vLLM's blocks: `tensors[layer]["kv"]` is vLLM's cache tensor of that layer
    ([num_blocks, *block_shape], block b contiguous), shared, never copied; nothing here allocates KV memory."""

    def __init__(self, layout: KVLayout, layers: Sequence[torch.Tensor]) -> None:  # noqa: D107 (no super(): no alloc)
        if len(layers) != layout.num_layers:
            raise ValueError(f"{len(layers)} cache tensors for a layout of {layout.num_layers} layers")
        num_blocks = int(layers[0].shape[0])
        for t in layers:
            if t.device.type != "cpu":
                raise ValueError(f"kvfence's vLLM connector reads CPU KV caches; this one is on {t.device}")
            if t.dtype != layout.dtype or int(t.shape[0]) != num_blocks:
                raise ValueError(f"cache tensors differ: {t.dtype} {tuple(t.shape)} vs {layout.dtype} [{num_blocks}]")
            if not t[0].is_contiguous() or t.stride(0) * t.element_size() < layout.bytes_per_page // layout.num_layers:
                raise ValueError(f"a block of the cache tensor {tuple(t.shape)} strides {t.stride()} is not contiguous")
        self.layout = layout
        self.num_pages = num_blocks
        self.device = torch.device("cpu")
        self.host_visible = True  # vLLM's CPU blocks: read and written through host views
        self.tensors = [{"kv": t} for t in layers]  # each [num_blocks, *block_shape]


# -- producer (prefill) -------------------------------------------------------------------------------------------


class HeldState(str, Enum):
    DIGESTED = "digested"  # manifest built after the forward; vLLM has not finished the request yet
    HELD = "held"  # vLLM finished the request and keeps its blocks for us, under the lease
    SENDING = "sending"  # a pull started the send; blocks read until the sender is done and decode answered


@dataclass
class _Held:
    vllm_id: str
    manifest: HandoffManifest
    pages: list[int]
    state: HeldState = HeldState.DIGESTED
    lease_deadline: float = 0.0
    handle: SendHandle | None = None
    verdict_deadline: float | None = None
    severed: bool = False


class ProducerStats(NamedTuple):
    held: int  # transfers holding blocks now
    digested: int
    sent_verified: int
    sent_rejected: int
    send_failed: int
    lease_expired: int
    pulls_refused: int


class ProducerHandoff:
    """Prefill's side: held transfers by transfer id, the pull channel, the TCP sender."""

    def __init__(self, pool: KVPool, config: HandoffConfig, key: ClusterKey) -> None:
        self.pool, self.config, self.key = pool, config, key
        self.auth = PlaneAuth(key)
        self.faults = FaultInjector.from_flag(config.inject_fault)
        self._by_vllm: dict[str, _Held] = {}
        self._by_xid: dict[str, _Held] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # transfer id -> why it is gone
        self._release_now: set[str] = set()  # vLLM ids whose blocks may go at the next poll
        self._cond = threading.Condition()
        self.counts = {"digested": 0, "verified": 0, "rejected": 0, "send_failed": 0, "lease_expired": 0, "refused": 0}
        self.sender = self._new_sender()
        self.control = control.ControlServer(self._on_control, self._control_key(), config.host, config.control_port)

    # -- the transport and the manifest ----------------------------------------------------------------------------
    def _control_key(self) -> bytes:
        return control.control_key(self.key)

    def _new_sender(self) -> TcpSender:
        tc = TransferConfig(
            max_transfer_pages=self.config.max_transfer_pages,
            send_timeout_s=self.config.transfer_timeout_s,
            io_timeout_s=self.config.io_timeout_s,
        )
        return TcpSender(self.pool, tc, self.faults, auth=self.auth)

    def _build_manifest(self, request_id: str, transfer_id: str, token_ids: Sequence[int], pages: Sequence[int]):
        return build_manifest(request_id, transfer_id, list(token_ids), self.pool, pages, self.faults)

    @property
    def pull_address(self) -> str:
        return self.control.address

    # -- called on vLLM's worker thread ----------------------------------------------------------------------------
    def digest(self, vllm_id: str, request_id: str, transfer_id: str, token_ids: Sequence[int], pages: Sequence[int]):
        """The forward that completed the prompt of `vllm_id` has run: build its manifest over `pages` (its blocks,
        logical order) now, before anything else may write them."""
        need = pages_for_tokens(len(token_ids), self.pool.layout.page_size)
        manifest = self._build_manifest(request_id, transfer_id, token_ids, list(pages)[:need])
        with self._cond:
            self.counts["digested"] += 1
            old = self._by_vllm.pop(vllm_id, None)  # a preempted request computed again: the old digests are void
            if old is not None and self._by_xid.get(old.manifest.transfer_id) is old:
                del self._by_xid[old.manifest.transfer_id]
            held = _Held(vllm_id, manifest, list(pages)[: manifest.num_pages])
            self._by_vllm[vllm_id] = held
            if transfer_id in self._by_xid or transfer_id in self._tombstones:
                logger.warning("kvfence: transfer id of request %s is already in use; it will not be sent", request_id)
            else:
                self._by_xid[transfer_id] = held
            self._cond.notify_all()

    def hold(self, vllm_id: str) -> None:
        """vLLM finished `vllm_id` and keeps its blocks until `poll` returns it; the lease starts now."""
        with self._cond:
            held = self._by_vllm.get(vllm_id)
            if held is None or held.state != HeldState.DIGESTED:
                self._release_now.add(vllm_id)  # nothing to send: hand the blocks back at once
                return
            held.state = HeldState.HELD
            logger.debug("held %s", vllm_id)
            held.lease_deadline = time.monotonic() + self.config.lease_s
            self._cond.notify_all()

    def drop(self, vllm_id: str) -> None:
        """vLLM freed the blocks of `vllm_id` without holding them (aborted, preempted): forget its manifest."""
        with self._cond:
            held = self._by_vllm.get(vllm_id)
            if held is None or held.state != HeldState.DIGESTED:
                return
            del self._by_vllm[vllm_id]
            if self._by_xid.get(held.manifest.transfer_id) is held:
                del self._by_xid[held.manifest.transfer_id]
                self._tombstone(held.manifest.transfer_id, "its request was aborted or preempted on prefill")
            self._cond.notify_all()

    def poll(self) -> set[str]:
        """vLLM ids whose blocks may be freed now (verdict in, send over, or lease expired with no pull)."""
        now = time.monotonic()
        done: set[str] = set()
        with self._cond:
            done |= self._release_now
            self._release_now = set()
            for vllm_id, held in list(self._by_vllm.items()):
                why = self._release_reason(held, now)
                if why is not None:
                    del self._by_vllm[vllm_id]
                    if self._by_xid.get(held.manifest.transfer_id) is held:
                        del self._by_xid[held.manifest.transfer_id]
                    self._tombstone(held.manifest.transfer_id, why)
                    done.add(vllm_id)
        return done

    def _release_reason(self, held: _Held, now: float) -> str | None:
        if held.state == HeldState.HELD and now >= held.lease_deadline:
            self.counts["lease_expired"] += 1
            return f"its lease of {self.config.lease_s:g} s expired before decode asked for it; the blocks were freed"
        h = held.handle
        if held.state != HeldState.SENDING or h is None:
            return None
        if not h.sender_done or not h.finished:
            if held.verdict_deadline is None and h.sender_done:
                held.verdict_deadline = now + self.config.verdict_timeout_s
            if held.verdict_deadline is not None and now >= held.verdict_deadline and not held.severed:
                held.severed = True
                h.sever()  # decode never answered: cut the link; its reader reports the end, then we free
            return None
        if h.status == SendStatus.VERIFIED:
            self.counts["verified"] += 1
            return "it was consumed: decode verified it and the blocks were freed (a transfer id is good once)"
        if h.status == SendStatus.REJECTED:
            self.counts["rejected"] += 1
            return f"decode rejected it ({h.reason}); the blocks were freed"
        self.counts["send_failed"] += 1
        return f"its send ended without a verdict ({h.status.value}: {h.reason}); the blocks were freed"

    def _tombstone(self, xid: str, why: str) -> None:
        self._tombstones[xid] = why
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def stats(self) -> ProducerStats:
        with self._cond:
            states = [h.state for h in self._by_vllm.values()]
        c = self.counts
        return ProducerStats(
            held=sum(s != HeldState.DIGESTED for s in states),
            digested=c["digested"],
            sent_verified=c["verified"],
            sent_rejected=c["rejected"],
            send_failed=c["send_failed"],
            lease_expired=c["lease_expired"],
            pulls_refused=c["refused"],
        )

    # -- the pull channel (its own threads) -------------------------------------------------------------------------
    def _on_control(self, header: control.Header, peer: str) -> control.Header:
        try:
            pull = request_from(header)
        except MessageError as e:
            return self._refuse(str(e))
        if not isinstance(pull, Pull):
            return self._refuse(f"a {pull.kind!r} request is not served here")
        rid, xid, to = pull.rid, pull.xid, pull.to
        try:
            to_host, _ = control.parse_tcp_address(to)
        except (control.ControlError, ValueError):
            return self._refuse(f"bad decode address {to[:80]!r}")
        if not self.key.secure and to_host != peer:  # without a real key: push only back to the host that asked
            return self._refuse(f"decode address {to_host} is not the host that asked ({peer})")
        deadline = time.monotonic() + self.config.pull_wait_s
        logger.debug("pull received %s", rid)
        with self._cond:
            held = self._by_xid.get(xid)
            # the front end asks decode only after prefill's response, which vLLM may send just before this worker
            # learns that the request finished: wait for that, briefly
            while held is not None and held.state == HeldState.DIGESTED and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                held = self._by_xid.get(xid)
            if held is None:
                why = self._tombstones.get(xid, "prefill never held it (unknown transfer id)")
                return self._refuse(f"transfer {xid[:8]}... is not available: {why}")
            if held.manifest.request_id != rid:
                return self._refuse(f"transfer {xid[:8]}... belongs to another request than {rid[:80]!r}")
            if held.state != HeldState.HELD:
                what = "is being sent already" if held.state == HeldState.SENDING else "was not finished by vLLM"
                return self._refuse(f"transfer {xid[:8]}... {what}")
            held.state = HeldState.SENDING
            manifest, pages = held.manifest, held.pages
        handle = self.sender.send(to, manifest, pages)
        with self._cond:
            held.handle = handle
        return to_header(Ok(manifest.num_pages))

    def _refuse(self, reason: str) -> control.Header:
        with self._cond:
            self.counts["refused"] += 1
        logger.warning("kvfence: refused a pull: %s", reason)
        return to_header(Refused(reason))

    def close(self) -> None:
        """Stop serving pulls, cut every send (their threads exit), close the sender."""
        self.control.close()
        with self._cond:
            handles = [h.handle for h in self._by_vllm.values() if h.handle is not None]
        for h in handles:
            h.abort("prefill is shutting down")
            h.sever()
        self.sender.close()


# -- consumer (decode) ----------------------------------------------------------------------------------------------


@dataclass
class _Load:
    vllm_id: str
    request_id: str
    params: ConsumeParams | None
    pages: list[int]
    started: float
    result: VerifyResult | None = None
    pull_error: str | None = None
    pulled_at: float | None = None
    aborted: bool = False
    slot_open: bool = False
    quarantine_deadline: float | None = None
    concluded: bool = False  # its result was told, counted and recorded
    record: IntegrityRecord | None = None
    record_to: str | None = None  # the front end's record address
    timings: dict[str, float] = field(default_factory=dict)


class LoadResults(NamedTuple):
    finished: set[str]  # vLLM ids whose load ended (verified or not) and whose blocks are safe to use or free
    failed: set[str]  # those of them that failed: vLLM must fail the request


class ConsumerHandoff:
    """Decode's side: the TCP receiver over vLLM's blocks, one load per request, records to the front end."""

    def __init__(self, pool: KVPool, config: HandoffConfig, key: ClusterKey) -> None:
        self.pool, self.config, self.key = pool, config, key
        self.auth = PlaneAuth(key)
        self.faults = FaultInjector.from_flag(config.inject_fault)
        self.layout = pool.layout
        self.receiver = self._new_receiver()
        self._loads: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self.counts: dict[str, float] = {"verified": 0, "failed": 0, "verify_s": 0.0, "bytes": 0}
        self.failed_by_reason: dict[str, int] = {}
        self.records_undelivered = 0

    # -- the transport ---------------------------------------------------------------------------------------------
    def _new_receiver(self) -> TcpReceiver:
        c = self.config
        return TcpReceiver(
            self.pool, c.host, c.data_port, self.faults, one_sided=False, io_timeout_s=c.io_timeout_s, auth=self.auth
        )

    def _control_key(self) -> bytes:
        return control.control_key(self.key)

    @property
    def data_address(self) -> str:
        return self.receiver.address

    # -- called on vLLM's worker thread ----------------------------------------------------------------------------
    def start(self, vllm_id: str, params: ConsumeParams | None, pages: Sequence[int], refused: VerifyResult | None,
              record_to: str | None = None) -> None:  # fmt: skip
        """Begin the load of `vllm_id` into `pages` (the blocks vLLM allocated, logical order). `refused` fails it
        at once (params that did not parse, a prompt that is not the router's); else prefill is asked to push."""
        rid = params.request_id if params is not None else vllm_id
        load = _Load(vllm_id, rid, params, list(pages), time.monotonic())
        load.record_to = record_to if params is None else params.record_to
        with self._lock:
            if vllm_id in self._loads:
                raise ValueError(f"vLLM request {vllm_id} is loading already")
            self._loads[vllm_id] = load
            busy = params is not None and any(
                x.params is not None and x.slot_open and x.request_id == rid for x in self._loads.values()
            )
        if refused is not None:
            load.result = refused
            return
        assert params is not None
        need = pages_for_tokens(params.tokens_expected, self.layout.page_size)
        if busy:
            load.result = _fail(Reason.TRANSFER_ERROR, f"request id {rid!r} is loading already on this decode instance")
            return
        if len(pages) < need:
            why = f"{params.tokens_expected} tokens need {need} blocks; vLLM gave {len(pages)}"
            load.result = _fail(Reason.PAGE_COUNT_MISMATCH, why)
            return
        load.pages = list(pages)[:need]
        logger.debug("load start %s", rid)
        self.receiver.expect(rid, load.pages, params.transfer_id)
        load.slot_open = True
        t = threading.Thread(target=self._pull, args=(load,), name=f"kvfence-pull-{rid}", daemon=True)
        self._spawn(t)

    def abort(self, vllm_id: str) -> None:
        """vLLM finished `vllm_id` while it was loading (client gone): stop the transfer; `poll` reports it once its
        blocks can no longer be written."""
        with self._lock:
            load = self._loads.get(vllm_id)
        if load is not None:
            load.aborted = True

    def poll(self) -> LoadResults:
        finished: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        with self._lock:
            loads = list(self._loads.values())
        for load in loads:
            if load.result is None:
                load.result = self._check(load, now)
            if load.result is not None and not load.concluded:
                load.concluded = True
                self._conclude(load, now)
            if load.result is None or not self._settled(load, now):
                continue
            with self._lock:
                del self._loads[load.vllm_id]
            if load.slot_open:
                self.receiver.forget(load.request_id)
            finished.add(load.vllm_id)
            if not load.result.ok:
                failed.add(load.vllm_id)
        return LoadResults(finished, failed)

    def _check(self, load: _Load, now: float) -> VerifyResult | None:
        """The load's result if it is decided now, else None (still waiting for prefill)."""
        params = load.params
        assert params is not None
        if load.aborted:
            return _fail(Reason.ABORTED, "vLLM finished the request (client gone or aborted) while its KV was loading")
        if load.pull_error is not None:
            return _fail(Reason.TRANSFER_ERROR, load.pull_error)
        slot = self.receiver.core.slot(load.request_id)
        if slot is None:
            return _fail(Reason.TRANSFER_ERROR, "the receive slot vanished")
        if slot.status == SlotStatus.COMPLETE and slot.manifest is not None:
            t0 = time.monotonic()
            result = verify_handoff(
                slot.manifest,
                Expectation(params.request_id, params.tokens_expected, params.token_hash, params.transfer_id),
                self.layout,
                load.pages,
                slot.coverage,
                self.pool,
            )
            load.timings["verify"] = time.monotonic() - t0
            load.timings["transfer"] = max(0.0, (slot.complete_at or now) - load.started)
            self.counts["bytes"] += slot.bytes_received
            return result
        if slot.status in (SlotStatus.SENDER_ABORTED, SlotStatus.ERROR):
            return _fail(Reason.TRANSFER_ERROR, slot.error or f"transfer ended: {slot.status.value}")
        if now - load.started > self.config.transfer_timeout_s:
            return _fail(Reason.TIMEOUT, f"no complete transfer within {self.config.transfer_timeout_s:g} s")
        return None

    def _conclude(self, load: _Load, now: float) -> None:
        """Tell prefill, count, record: the load's result was just decided."""
        result = load.result
        assert result is not None
        if load.slot_open:
            if result.ok:
                self.receiver.verdict(load.request_id, True)
            else:
                slot = self.receiver.core.slot(load.request_id)
                if slot is not None and slot.manifest is not None:
                    self.receiver.verdict(load.request_id, False, result.reason.value if result.reason else "")
                else:
                    self.receiver.abort(load.request_id, result.detail)
            load.quarantine_deadline = now + self.config.quarantine_timeout_s
        load.timings["total"] = now - load.started
        if result.ok:
            self.counts["verified"] += 1
        else:
            self.counts["failed"] += 1
            reason = result.reason.value if result.reason else "unknown"
            self.failed_by_reason[reason] = self.failed_by_reason.get(reason, 0) + 1
        self.counts["verify_s"] += load.timings.get("verify", 0.0)
        p = load.params
        slot = self.receiver.core.slot(load.request_id) if load.slot_open else None
        slot_manifest = slot is not None and slot.manifest is not None
        record = IntegrityRecord.from_result(
            load.request_id,
            result,
            tokens_expected=p.tokens_expected if p is not None else 0,
            pages=len(load.pages) if p is not None else 0,
            layout_fingerprint=self.layout.fingerprint,
            transfer_ref=transfer_ref(p.transfer_id) if p is not None else "",
            authenticated=self.key.secure if slot_manifest else None,
            role="decode",
            timings={k: round(v, 6) for k, v in load.timings.items()},
        )
        load.record = record
        integrity_logger.info(record.to_json())
        to = load.record_to
        if to is not None:
            xid = p.transfer_id if p is not None else ""
            self._spawn(threading.Thread(target=self._send_record, args=(to, xid, load.vllm_id, record), daemon=True))

    def _settled(self, load: _Load, now: float) -> bool:
        """No write of the load's transfer can land in its blocks any more (a verified one: nothing writes)."""
        if not load.slot_open:
            return True
        slot = self.receiver.core.slot(load.request_id)
        if slot is None or slot.settled:
            return True
        if load.quarantine_deadline is not None and now >= load.quarantine_deadline:
            self.receiver.sever(load.request_id)  # a writer stuck mid-page: its read fails, the slot settles
            load.quarantine_deadline = now + self.config.io_timeout_s
        return False

    # -- background threads -----------------------------------------------------------------------------------------
    def _spawn(self, t: threading.Thread) -> None:
        with self._lock:
            self._threads = {x for x in self._threads if x.is_alive()} | {t}
        t.start()

    def _pull(self, load: _Load) -> None:
        p = load.params
        assert p is not None
        header = to_header(Pull(p.request_id, p.transfer_id, self.receiver.address))
        logger.debug("pull start %s", p.request_id)
        try:
            reply = reply_from(control.request(p.pull, header, self._control_key(), self.config.io_timeout_s))
        except (control.ControlError, MessageError) as e:
            load.pull_error = f"cannot ask prefill for the transfer: {e}"
            return
        if isinstance(reply, Refused):
            load.pull_error = f"prefill refused the pull: {reply.reason[:400]}"
            return
        load.pulled_at = time.monotonic()
        logger.debug("pull ok %s", p.request_id)

    def _send_record(self, to: str, xid: str, vllm_id: str, record: IntegrityRecord) -> None:
        header = to_header(Record(xid, vllm_id, record.to_dict()))
        try:
            reply = reply_from(control.request(to, header, self._control_key(), self.config.io_timeout_s))
            if isinstance(reply, Ok):
                return
            logger.warning("kvfence: the front end refused the record of %s: %s", record.request_id, reply.reason)
        except (control.ControlError, MessageError) as e:
            logger.warning("kvfence: could not deliver the record of %s: %s", record.request_id, e)
        self.records_undelivered += 1

    def close(self) -> None:
        with self._lock:
            loads = list(self._loads.values())
            threads = list(self._threads)
        for load in loads:
            if load.slot_open:
                self.receiver.abort(load.request_id, "decode is shutting down")
        self.receiver.close()
        for t in threads:
            t.join(timeout=self.config.io_timeout_s)


def _fail(reason: Reason, detail: str) -> VerifyResult:
    return VerifyResult(False, reason, detail, 0, 0)


def refuse(reason: Reason, detail: str) -> VerifyResult:
    """A load refused before any transfer (malformed params, a prompt that is not the router's)."""
    return _fail(reason, detail)


def check_prompt(params: ConsumeParams, prompt_token_ids: Sequence[int]) -> VerifyResult | None:
    """The prompt vLLM will decode over must be the one the router admitted (its count and hash), or KV that
    verifies against the router's expectation would be read for another prompt; None when it is."""
    if len(prompt_token_ids) != params.tokens_expected:
        return _fail(
            Reason.TOKEN_COUNT_MISMATCH,
            f"decode's prompt has {len(prompt_token_ids)} tokens, the router admitted {params.tokens_expected}",
        )
    if token_hash(prompt_token_ids) != params.token_hash:
        return _fail(Reason.TOKEN_HASH_MISMATCH, "decode's prompt is not the one the router admitted (token hash)")
    return None
