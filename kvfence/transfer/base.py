"""The data plane of a KV handoff: what every transport does, whatever carries the bytes.

What it knows: the sequence of frames a sender and a receiver exchange, the two cores and
the send loop (`run_send`) that every transport (local threads, TCP, Mooncake) shares, so
the protocol and its safety rules live in one place; a transport supplies only how bytes
move (`PageMover`) and how frames travel (`Link`). The frames are typed structs
(`transfer.frames`, kind `t` on the wire); the cores dispatch on their class:

    sender -> receiver   Manifest  {rid, xid}              payload: manifest bytes
                         Pages     {rid, xid, seq, idx[], nb[]}  payload: the pages, in idx order
                         Done      {rid, xid, pages}       last frame of a complete transfer
                         Abort     {rid, xid, reason}      last frame of a transfer prefill gave up
                         Aborted   {rid, xid}              last frame after decode asked to abort
                         Fenced    {rid, xid}              on any connection: the transfer's writer is gone
                                                           (a one-sided sender whose last frame was lost)
    receiver -> sender   Ready     {rid, xid}              the manifest is accepted: send the pages
                         ChunkAck  {rid, xid, seq, n}      n bytes of chunk seq landed (flow control)
                         Verdict   {rid, xid, ok, reason}  decode verified (or rejected) the pages
                         Abort     {rid, xid, reason}      decode gave up: stop sending
                         Error     {rid, xid, reason}      unknown request, bad manifest, ...

- Prefill sends its manifest as soon as its prompt is computed, to the decode address in its
  order; decode may not have reserved the request's pages yet (it reserves at its own pace,
  when pages are free). An authenticated manifest for a request decode does not expect yet is
  parked (bounded, with a time to live) and taken up when decode opens the slot. Either way the
  sender moves no page before the receiver's `ready`.
- Pages carry their *logical* index only. The receiver alone maps logical index ->
  destination page through the page table decode allocated (`expect`); prefill never
  learns or names decode's page numbers.
- The receiver marks logical page i in the request's `CoverageBitmap` only when every
  byte of that page landed; pages outside the allocation are counted, never written.
- The sender sends at most `max_transfer_pages` pages per chunk and keeps at most
  `max_inflight_bytes` un-acknowledged (a single chunk larger than the bound is sent
  alone), so one transfer cannot flood the receiver (invariant 7, docs/handoff.md).
- A receive slot is `settled` once no write from this transfer can land any more: no page
  write is in progress (`writing == 0`) and either the sender's last frame arrived, the
  connection closed (its reader thread has exited), or decode closed the slot and the
  transport is two-sided (every write passes through `ReceiverCore.receive_page`, which
  drops writes to a closed slot and counts the ones in progress). A one-sided transport
  (RDMA, Mooncake) sets `one_sided=True`: there a closed slot is settled only by the
  sender's last frame or its `fenced` frame (the sender's word, on any connection, that
  its writer for this transfer is gone). No deadline ever settles a slot: a writer that
  is stuck mid-page is cut off (`ReceiverCore.sever` shuts its connection down, so the
  blocked read fails and the write ends) and the slot settles when its write has ended.
- Page frames count only on the connection the transfer's manifest came in on; a page for
  the same transfer arriving on another connection is discarded.
- A device pool (`KVPool.host_visible` False) is never touched through host views: prefill sends from
  host buffers its pages were copied into (`transfer.staging.StagedPages`), decode reads pages into a
  connection's host buffers and copies them to the pool (`transfer.staging.PageLanding`); a page write
  then lasts until that copy has finished, and a transport drains its landing before it applies any
  other frame of the connection, so `done` is seen only when every page is in the pool.
- A transfer id is a capability: the router draws it (`new_transfer_id`, 128 random bits) and
  sends it to exactly the prefill and the decode worker it picked; decode's slot accepts only a
  manifest carrying that id, sealed with the cluster key (`integrity.manifest.seal`). A manifest
  that does not authenticate, or names another transfer id, is refused without touching the
  slot and counted as a security event; the prefill that holds the capability is never locked
  out by anybody else's frame. Records and logs show `transfer_ref`, a hash of the id, never the
  id itself.

What it does not know: frame bytes (`transfer.frames`), sockets (`transfer.tcp`) or queues (`transfer.local`), whether
the landed pages are right (`integrity.verify`), or what to do with an ending
(`disagg.handoff`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple, Protocol

from kvfence.auth.events import SecurityEvent
from kvfence.auth.plane import PlaneAuth
from kvfence.errors import KvfenceError
from kvfence.faults import FaultInjector, FaultPoint
from kvfence.integrity.digest import PageBytes
from kvfence.integrity.manifest import HandoffManifest, ManifestAuthError, ManifestError, seal, unseal
from kvfence.integrity.verify import CoverageBitmap
from kvfence.kv.pool import KVPool
from kvfence.transfer.frames import (
    Abort,
    Aborted,
    ChunkAck,
    Done,
    Error,
    Fenced,
    Frame,
    Manifest,
    Pages,
    Ready,
    ToReceiver,
    ToSender,
    TransferFrame,
    Verdict,
)
from kvfence.transfer.staging import HostStaging, PageLanding, StagedPages, landing_rows

Payload = Sequence[bytes | bytearray | memoryview]
logger = logging.getLogger(__name__)


# Transfer ids and the transfer config live in torch-free modules (the router and the flag tables import them).
from kvfence.transfer.transfer_config import TRANSFER_BACKENDS as TRANSFER_BACKENDS  # noqa: E402
from kvfence.transfer.transfer_config import TransferConfig  # noqa: E402
from kvfence.transfer.transfer_id import TRANSFER_ID_HEX as TRANSFER_ID_HEX  # noqa: E402
from kvfence.transfer.transfer_id import is_transfer_id as is_transfer_id  # noqa: E402
from kvfence.transfer.transfer_id import new_transfer_id as new_transfer_id  # noqa: E402
from kvfence.transfer.transfer_id import transfer_ref  # noqa: E402


class Link(Protocol):
    """One direction of a connection: sends one frame (header + payload pieces) atomically.

    A link may also have `sever()`: shut the connection down at once, from any thread, so that a
    read or write blocked on it fails (TCP). `ReceiverCore.sever` and `SendHandle.sever` use it."""

    def send(self, frame: Frame, payload: Payload = ()) -> None: ...


def sever_link(link: object) -> bool:
    """Shut `link` down if it can be; True when it could (see `Link`)."""
    sever = getattr(link, "sever", None)
    if sever is None:
        return False
    sever()
    return True


# -- receiver side ------------------------------------------------------------------------------------------


class SlotStatus(str, Enum):
    WAITING = "waiting"  # expected, no manifest yet
    RECEIVING = "receiving"  # manifest arrived, pages landing
    COMPLETE = "complete"  # the sender said done
    SENDER_ABORTED = "sender_aborted"  # the sender gave up
    ERROR = "error"  # bad manifest, connection lost, ...


class ReceiveSlot:
    """Decode's view of one incoming transfer; written by the transport thread, read by the worker."""

    def __init__(self, request_id: str, dest_pages: Sequence[int], transfer_id: str, one_sided: bool) -> None:
        self.request_id = request_id
        self.dest_pages: tuple[int, ...] = tuple(dest_pages)  # logical index -> decode page
        self.transfer_id = transfer_id  # the router's capability: the only manifest this slot accepts
        self.coverage = CoverageBitmap(len(self.dest_pages))
        self.manifest: HandoffManifest | None = None
        self.status = SlotStatus.WAITING
        self.error = ""
        self.closed = False  # decode no longer accepts writes
        self.sender_final = False  # the sender's last frame arrived
        self.link_closed = False
        self.one_sided = one_sided
        self.link: Link | None = None
        self.bytes_received = 0
        self.first_frame_at: float | None = None
        self.complete_at: float | None = None
        self.writing = 0  # page writes in progress (a transport thread is filling a destination page)
        self.lock = threading.Lock()  # guards the fields above; never held while bytes are read

    @property
    def started(self) -> bool:
        """The sender's manifest was accepted (or the transfer already ended)."""
        return self.status is not SlotStatus.WAITING

    @property
    def complete(self) -> bool:
        """The sender said it sent everything: the pages can be verified."""
        return self.status is SlotStatus.COMPLETE

    @property
    def failure(self) -> tuple[str, str] | None:
        """("aborted" | "error", why) once the transfer ended without completing; None otherwise."""
        if self.status is SlotStatus.SENDER_ABORTED:
            return "aborted", self.error
        if self.status is SlotStatus.ERROR:
            return "error", self.error
        return None

    @property
    def settled(self) -> bool:
        """No write of this transfer can land in `dest_pages` any more."""
        if self.writing:  # a transport thread holds views into a destination page right now
            return False
        if self.sender_final or self.link_closed:
            return True
        # one-sided: once a manifest bound a sender (`link`), it may know where to write without us
        return self.closed and (not self.one_sided or self.link is None)


class ReceiverCore:
    """Protocol logic of a receiver; transports feed it frames and page bytes."""

    def __init__(
        self,
        pool: KVPool,
        auth: PlaneAuth,
        faults: FaultInjector | None = None,
        one_sided: bool = False,
        pending_ttl_s: float = 120.0,
        max_pending: int = 4096,
    ) -> None:
        self.pool = pool
        self.auth = auth
        # a host-visible pool is written in place through its views; a device pool through a connection's landing
        self.page_bytes = PageBytes(pool) if pool.host_visible else None
        self.staging = None if pool.host_visible else HostStaging(pool, landing_rows(pool.layout.bytes_per_page))
        self.faults = faults
        self.one_sided = one_sided
        self.pending_ttl_s = pending_ttl_s  # how long an early manifest waits for decode to reserve its request
        self.max_pending = max_pending
        self._slots: dict[str, ReceiveSlot] = {}
        self._pending: dict[str, _Parked] = {}  # rid -> a manifest that came before its slot
        # transfers decode ended, newest last, at most `max_pending`: (rid, transfer id) of a slot it forgot, or
        # (rid, None) for a request it aborted before reserving it (any transfer of it). A late manifest for one of
        # them is refused at once rather than parked until its time to live; a new transfer under a request id a
        # client used before (its X-Request-Id again) is not one of them.
        self._ended: OrderedDict[tuple[str, str | None], None] = OrderedDict()
        self._lock = threading.Lock()
        # called (on a transport's thread) with the link and slot of each manifest accepted, before its `ready` goes
        # out: a transport that needs to tell the sender more (Mooncake: where to write) does it here
        self.accepted: Callable[[Link, ReceiveSlot], None] | None = None
        # called (on the transport's thread) when a slot's status moves: lets decode's loop wake up at once
        # instead of polling for it; must not block
        self.notify: Callable[[], None] | None = None

    def changed(self) -> None:
        if self.notify is not None:
            self.notify()

    # -- decode-side API -------------------------------------------------------------------------------------
    def expect(self, request_id: str, dest_pages: Sequence[int], transfer_id: str) -> ReceiveSlot:
        """Register where the pages of `request_id` go (its page table, logical order), for the one transfer the
        router issued (`transfer_id`)."""
        if not transfer_id:
            raise KvfenceError(f"request {request_id}: a receive slot needs the router's transfer id")
        one_sided = self.one_sided or (
            self.faults is not None and self.faults.point("delayed_write_after_abort", request_id) is not None
        )
        slot = ReceiveSlot(request_id, dest_pages, transfer_id, one_sided)
        with self._lock:
            assert request_id not in self._slots, f"request {request_id} is already expected"
            self._slots[request_id] = slot
            self._ended.pop((request_id, transfer_id), None)
            self._ended.pop((request_id, None), None)
            parked = self._pending.pop(request_id, None)
        if parked is not None:  # its sender came first: take its manifest up now
            self._on_manifest(parked.link, slot, request_id, parked.xid, parked.payload)
        return slot

    def expire_pending(self, now: float | None = None) -> None:
        """Refuse parked manifests whose request decode never reserved within `pending_ttl_s` (their senders stop
        waiting for a `ready` that will not come)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [(rid, p) for rid, p in self._pending.items() if now - p.at > self.pending_ttl_s]
            for rid, _ in old:
                del self._pending[rid]
        for rid, p in old:
            _reply(p.link, Error(rid, p.xid, f"decode never reserved request {rid}"))

    def abort(self, request_id: str, reason: str) -> None:
        """Decode gives up on `request_id`: stop writes, tell the sender to stop (also one whose manifest is parked
        because decode never reserved the request)."""
        with self._lock:
            parked = self._pending.pop(request_id, None)
            if request_id not in self._slots:
                self._end(request_id, None)
        if parked is not None:
            _reply(parked.link, Abort(request_id, parked.xid, reason))
        self._close(request_id, lambda rid, xid: Abort(rid, xid, reason))

    def verdict(self, request_id: str, ok: bool, reason: str = "") -> None:
        """Tell the sender how verification ended (it may release its source pages)."""
        self._close(request_id, lambda rid, xid: Verdict(rid, xid, ok, reason))

    def forget(self, request_id: str) -> None:
        """Drop the slot; later frames for it are discarded as unknown."""
        with self._lock:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._end(request_id, slot.transfer_id)

    def _end(self, request_id: str, transfer_id: str | None) -> None:
        """Remember that decode is done with this transfer of `request_id` (None: with every transfer of it; called
        with `_lock` held)."""
        self._ended[(request_id, transfer_id)] = None
        while len(self._ended) > self.max_pending:
            self._ended.popitem(last=False)

    def slot(self, request_id: str) -> ReceiveSlot | None:
        return self._slots.get(request_id)

    def sever(self, request_id: str) -> bool:
        """Cut the connection carrying `request_id`'s transfer, so a write stuck in the middle of a page fails
        and the slot can settle; True when there was a connection that could be cut. Every transfer on that
        connection fails with it (a connection stalled mid-frame carries nothing else anyway). A one-sided
        transfer is not cut: its writes do not pass through the connection, so cutting it proves nothing."""
        slot = self._slots.get(request_id)
        if slot is None or slot.one_sided or slot.link is None or slot.link_closed:
            return False
        return sever_link(slot.link)

    def _close(self, request_id: str, last_word: Callable[[str, str], ToSender]) -> None:
        """Close `request_id`'s slot to writes and tell its sender `last_word(rid, xid)` (once)."""
        slot = self._slots.get(request_id)
        if slot is None:
            return
        with slot.lock:  # no page write starts after this; one in progress is counted in `writing`
            already = slot.closed
            slot.closed = True
            link = slot.link
        if link is not None and not already and not slot.link_closed:
            try:
                link.send(last_word(request_id, slot.transfer_id))
            except OSError:
                pass  # the connection is gone; `link_closed` will settle the slot

    # -- transport-side API ----------------------------------------------------------------------------------
    def on_frame(self, link: Link, frame: ToReceiver, payload: bytes | bytearray | memoryview = b"") -> None:
        """Every non-page frame from a sender (decoded by the transport, `frames.decode_to_receiver`)."""
        rid, xid = frame.rid, frame.xid
        slot = self._slots.get(rid)
        if isinstance(frame, Manifest):
            self._on_manifest(link, slot, rid, xid, payload)
            return
        if slot is None or slot.transfer_id != xid:
            return
        if isinstance(frame, Fenced):  # the sender's writer for this transfer is gone (sent on any connection)
            with slot.lock:
                slot.sender_final = True
                if slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                    slot.status = SlotStatus.ERROR
                    slot.error = "the sender fenced the transfer before it completed"
            self.changed()
            return
        if link is not slot.link:  # the transfer's frames come on the connection its manifest came on
            return
        with slot.lock:
            if isinstance(frame, Done):
                slot.sender_final = True
                if slot.status == SlotStatus.RECEIVING:
                    slot.status = SlotStatus.COMPLETE
                    slot.complete_at = time.monotonic()
            elif isinstance(frame, Abort):
                slot.sender_final = True
                if slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                    slot.status = SlotStatus.SENDER_ABORTED
                    slot.error = frame.reason
            elif isinstance(frame, Aborted):
                slot.sender_final = True
        self.changed()

    def _on_manifest(
        self, link: Link, slot: ReceiveSlot | None, rid: str, xid: str, payload: bytes | bytearray | memoryview
    ) -> None:
        """A manifest: authenticate it and check its capability before it may touch the slot (a refused one leaves
        the slot exactly as it was, so a stranger's frame cannot fail or hijack the request)."""
        events = self.auth.events
        try:
            data = unseal(payload, self.auth.manifest_key)
        except ManifestAuthError as e:
            events.record(SecurityEvent.MANIFEST_UNAUTHENTICATED, f"manifest for request {rid!r}: {e}")
            link.send(Error(rid, xid, "manifest does not authenticate"))
            return
        if slot is None:  # decode has not reserved the request yet: park it until `expect`
            self._park(link, rid, xid, payload)
            return
        if xid != slot.transfer_id:
            events.record(
                SecurityEvent.CAPABILITY_MISMATCH,
                f"manifest for request {rid!r} names transfer {transfer_ref(xid)}, not the one the router issued",
            )
            link.send(Error(rid, xid, f"request {rid} expects another transfer"))
            return
        try:
            manifest = HandoffManifest.from_bytes(data)
            parse_error = ""
        except ManifestError as e:  # sealed by a key holder with the capability, yet malformed: that transfer fails
            manifest, parse_error = None, str(e)
        if manifest is not None and (manifest.request_id != rid or manifest.transfer_id != xid):
            events.record(
                SecurityEvent.CAPABILITY_MISMATCH,
                f"manifest names request {manifest.request_id!r} in a frame for {rid!r}",
            )
            link.send(Error(rid, xid, "manifest does not match its frame"))
            return
        reply: ToSender
        with slot.lock:
            if slot.manifest is not None or slot.status != SlotStatus.WAITING:
                reply = Error(rid, xid, f"second manifest for request {rid}")
            else:
                slot.link = link
                slot.first_frame_at = time.monotonic()
                if slot.closed:
                    reply = Abort(rid, xid, "decode aborted the request")
                elif manifest is None:
                    slot.status, slot.error, slot.closed = SlotStatus.ERROR, parse_error, True
                    reply = Error(rid, xid, parse_error)
                else:
                    slot.manifest = manifest
                    slot.status = SlotStatus.RECEIVING
                    reply = Ready(rid, xid)
        self.changed()
        if isinstance(reply, Ready) and self.accepted is not None:
            self.accepted(link, slot)
        _reply(link, reply)

    def _park(self, link: Link, rid: str, xid: str, payload: bytes | bytearray | memoryview) -> None:
        """Keep an authenticated manifest for a request decode has not reserved yet (the first one per request; at
        most `max_pending`, oldest refused first)."""
        self.expire_pending()
        refused: list[tuple[str, _Parked, str]] = []
        with self._lock:
            if rid in self._slots:  # reserved meanwhile
                slot = self._slots[rid]
            else:
                slot = None
                if (rid, xid) in self._ended or (rid, None) in self._ended:
                    refused.append((rid, _Parked(link, xid, b"", 0.0), f"decode no longer expects request {rid}"))
                elif rid in self._pending:
                    refused.append((rid, _Parked(link, xid, b"", 0.0), f"second manifest for request {rid}"))
                else:
                    self._pending[rid] = _Parked(link, xid, bytes(payload), time.monotonic())
                    while len(self._pending) > self.max_pending:
                        old = next(iter(self._pending))
                        why = f"decode cannot hold request {old}'s manifest (too many wait for their reservation)"
                        refused.append((old, self._pending.pop(old), why))
        if slot is not None:
            self._on_manifest(link, slot, rid, xid, payload)
            return
        for r, p, why in refused:
            _reply(p.link, Error(r, p.xid, why))

    def landing(self) -> PageLanding | None:
        """A connection's landing for a device pool (None: pages are written in place); the transport calls its
        `commit` after each `pages` frame, `drain` before any other frame and `close` when the connection ends."""
        return None if self.staging is None else PageLanding(self.staging)

    def receive_page(
        self,
        rid: str,
        xid: str,
        index: int,
        nbytes: int,
        fill: Callable[[list[memoryview] | None, int], None],
        link: Link | None = None,
        landing: PageLanding | None = None,
        notice: bool = False,
    ) -> None:
        """Land one page: `fill(views, nbytes)` must consume exactly `nbytes` of input, writing into
        `views` (the destination page, logical order) or discarding when `views` is None. Transports pass
        the `link` the page came on: a page from any other connection than the manifest's is discarded.
        On a device pool `views` are a row of the connection's `landing`, copied to the page later; a
        `notice` (Mooncake) carries no bytes (they were written elsewhere) and only counts the page."""
        slot = self._slots.get(rid)
        if slot is None or slot.transfer_id != xid or (link is not None and link is not slot.link):
            fill(None, nbytes)
            return
        staged = self.page_bytes is None and not notice
        if staged:
            assert landing is not None, "a device pool's pages land through the connection's PageLanding"
            row, row_views = landing.reserve()  # before the slot lock: it may wait for an older copy to finish
        with slot.lock:
            inside = 0 <= index < len(slot.dest_pages)
            accepting = (
                (not slot.closed or slot.one_sided) and not slot.sender_final and slot.status != SlotStatus.ERROR
            )  # nothing lands after the sender's last frame: verification may already be reading
            stale = False
            if accepting and inside and not slot.closed and self.faults is not None:
                p = self.faults.point("stale_page", rid)
                stale = p is not None and p.page == index and self.faults.hit("stale_page", rid) is not None
            views: list[memoryview] | None = None
            if accepting and inside and not stale:
                if notice:
                    views = []
                elif staged:
                    views = row_views
                else:
                    assert self.page_bytes is not None
                    views = self.page_bytes.views(slot.dest_pages[index])
                slot.writing += 1  # closing now cannot settle the slot until this write ends
            dest = slot.dest_pages[index] if inside else -1
        held = False
        try:
            fill(views, nbytes)  # outside the lock: a stalled sender never blocks decode's abort()
            if staged and views is not None:
                if nbytes == self.pool.layout.bytes_per_page:
                    assert landing is not None
                    landing.hold(row, slot, dest)  # its copy to the pool ends the write
                    held = True
                elif nbytes:
                    assert landing is not None
                    landing.write_prefix(row, dest, nbytes)
        finally:
            with slot.lock:
                if views is not None and not held:
                    slot.writing -= 1
        with slot.lock:
            slot.bytes_received += nbytes
            if slot.closed:
                return
            if not inside:
                slot.coverage.mark_outside()
            elif nbytes == self.pool.layout.bytes_per_page:
                slot.coverage.mark(index)

    def link_closed(self, link: Link) -> None:
        """The connection carrying `link` is gone: its slots are settled; unfinished ones failed."""
        for slot in list(self._slots.values()):
            if slot.link is link:
                with slot.lock:
                    slot.link_closed = True
                    if slot.status in (SlotStatus.WAITING, SlotStatus.RECEIVING):
                        slot.status = SlotStatus.ERROR
                        slot.error = "connection to prefill closed before the transfer completed"
        self.changed()


class _Parked(NamedTuple):
    """A manifest that came before decode reserved its request."""

    link: Link
    xid: str
    payload: bytes
    at: float


def _reply(link: Link, frame: ToSender) -> None:
    """Send a frame back to a sender, whose connection may already be gone."""
    try:
        link.send(frame)
    except OSError:
        pass


def fill_from_bytes(data: bytes | bytearray | memoryview) -> Callable[[list[memoryview] | None, int], None]:
    """A `fill` for `receive_page` that copies from an in-memory payload (local transport)."""
    src = memoryview(data).cast("B")

    def fill(views: list[memoryview] | None, nbytes: int) -> None:
        assert nbytes == len(src), (nbytes, len(src))
        if views is None:
            return
        off = 0
        for v in views:
            n = min(len(v), nbytes - off)
            if n <= 0:
                break
            v[:n] = src[off : off + n]
            off += n

    return fill


# -- sender side --------------------------------------------------------------------------------------------


class SendStatus(str, Enum):
    SENDING = "sending"
    AWAITING_VERDICT = "awaiting_verdict"  # done sent, source pages still needed until a verdict
    VERIFIED = "verified"  # decode verified the pages
    REJECTED = "rejected"  # decode's verification failed
    ABORTED = "aborted"  # decode asked to stop, or prefill aborted
    ERROR = "error"  # connection, protocol or deadline failure


class SendHandle:
    """Prefill's view of one outgoing transfer; polled by the worker, updated by transport threads."""

    def __init__(self, manifest: HandoffManifest) -> None:
        self.manifest = manifest
        self.request_id = manifest.request_id
        self.transfer_id = manifest.transfer_id
        self.status = SendStatus.SENDING
        self.reason = ""
        self.pages_sent = 0
        self.bytes_sent = 0
        self.inflight_bytes = 0
        self.max_inflight_seen = 0
        self.chunks_sent = 0
        self.max_chunk_pages = 0
        self.sender_done = False  # the send thread exited: no more reads of the source pages
        self.final_sent = False  # the transfer's last frame (done/abort/aborted) reached the connection
        self.ready = False  # decode accepted the manifest (its `ready`): pages may move
        self.peer_lost = False  # the connection to decode failed (nobody answered, or it broke): the peer is gone
        self.link: Link | None = None  # the connection carrying the transfer, once connected
        self.address = ""  # the receiver's address
        self.local_abort: str | None = None
        self.remote_abort: str | None = None
        self.started_at = time.monotonic()
        self.done_at: float | None = None
        self._cond = threading.Condition()

    @property
    def finished(self) -> bool:
        """A final status is known (the verdict, an abort or an error)."""
        return self.status in (SendStatus.VERIFIED, SendStatus.REJECTED, SendStatus.ABORTED, SendStatus.ERROR)

    @property
    def done_sent(self) -> bool:
        """The transfer's `done` went out (or a verdict already came): decode's verdict is what it waits for."""
        return self.status in (SendStatus.AWAITING_VERDICT, SendStatus.VERIFIED, SendStatus.REJECTED)

    @property
    def verified(self) -> bool:
        return self.status is SendStatus.VERIFIED

    @property
    def decode_refused(self) -> bool:
        """Decode rejected the pages or asked to stop (it reports that itself); not prefill's own failure."""
        return self.status is SendStatus.REJECTED or (
            self.status is SendStatus.ABORTED and self.remote_abort is not None
        )

    def abort(self, reason: str) -> None:
        """Prefill gives up: the send loop stops at the next chunk and sends `abort`."""
        with self._cond:
            if self.local_abort is None:
                self.local_abort = reason
            self._cond.notify_all()

    def sever(self) -> bool:
        """Cut the connection this transfer runs on, so a send thread blocked writing to it fails and stops
        reading the source pages; True when there was a connection that could be cut (`sever_link`)."""
        return self.link is not None and sever_link(self.link)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `finished` (tests and benchmarks; workers poll)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout)

    def wait_sender_done(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.sender_done, timeout)

    # -- called by transports ----------------------------------------------------------------------------------
    def _set(self, status: SendStatus, reason: str = "") -> None:
        with self._cond:
            if not self.finished:
                self.status, self.reason = status, reason
            self._cond.notify_all()

    def on_frame(self, frame: ToSender) -> None:
        with self._cond:
            if isinstance(frame, Ready):
                self.ready = True
            elif isinstance(frame, ChunkAck):
                self.inflight_bytes -= frame.n
            elif isinstance(frame, Verdict):
                if not self.finished:
                    self.status = SendStatus.VERIFIED if frame.ok else SendStatus.REJECTED
                    self.reason = frame.reason
            elif isinstance(frame, Abort):
                self.remote_abort = frame.reason
                if not self.finished:
                    self.status, self.reason = SendStatus.ABORTED, self.remote_abort
            elif isinstance(frame, Error):
                if not self.finished:
                    self.status, self.reason = SendStatus.ERROR, frame.reason
            self._cond.notify_all()

    def on_link_closed(self, cause: str = "") -> None:
        if not self.finished:
            self.peer_lost = True
        self._set(SendStatus.ERROR, cause or "connection to decode closed")


class SenderCore:
    """Routes receiver frames to the handles of one sender; shared by transports."""

    def __init__(self) -> None:
        self._handles: dict[tuple[str, str], SendHandle] = {}
        self._lock = threading.Lock()

    def add(self, handle: SendHandle) -> None:
        with self._lock:
            for key in [k for k, h in self._handles.items() if h.finished and h.sender_done]:
                del self._handles[key]
            self._handles[(handle.request_id, handle.transfer_id)] = handle

    def on_frame(self, frame: ToSender) -> None:
        """A receiver's frame about one transfer goes to that transfer's handle (one about none is the transport's)."""
        if not isinstance(frame, TransferFrame):
            return
        h = self._handles.get((frame.rid, frame.xid))
        if h is not None:
            h.on_frame(frame)
            if h.finished and h.sender_done:
                self.discard(h)

    def discard(self, handle: SendHandle) -> None:
        with self._lock:
            self._handles.pop((handle.request_id, handle.transfer_id), None)

    def attach(self, link: SenderLink, handle: SendHandle) -> None:
        """`handle`'s transfer goes over `link` (transfer threads attach concurrently: one at a time here)."""
        with self._lock:
            link.handles = [h for h in link.handles if not (h.finished and h.sender_done)] + [handle]
            handle.link = link

    def link_closed(self, handles: Sequence[SendHandle] | None = None, cause: str = "") -> None:
        """The connection is gone; `cause` says why when a send on it failed (else: closed by the peer)."""
        for h in list(handles if handles is not None else self._handles.values()):
            h.on_link_closed(cause)

    def sending(self) -> list[SendHandle]:
        """The handles whose send thread has not exited yet."""
        with self._lock:
            return [h for h in self._handles.values() if not h.sender_done]


class SendPlan(NamedTuple):
    """What the sender's fault hooks make of one transfer (no faults: every page, in order, intact)."""

    order: list[int]  # logical indices to send
    source: list[int]  # whose bytes go under each logical index
    damage: dict[int, str]  # logical index -> "corrupt_byte" | "short_write"
    late: FaultPoint | None  # delayed_write_after_abort: keep writing after decode aborted


def plan_faults(num_pages: int, rid: str, faults: FaultInjector | None) -> SendPlan:
    """Fire the sender-side fault hooks of `rid` once: drop_page, reorder_pages, corrupt_byte, short_write."""
    order, source = list(range(num_pages)), list(range(num_pages))
    damage: dict[int, str] = {}
    if faults is None:
        return SendPlan(order, source, damage, None)
    if (p := faults.point("drop_page", rid)) and p.page < num_pages and faults.hit("drop_page", rid):
        order.remove(p.page)
    if (p := faults.point("reorder_pages", rid)) and num_pages >= 2 and faults.hit("reorder_pages", rid):
        a = min(p.page, num_pages - 2)
        source[a], source[a + 1] = source[a + 1], source[a]
    for name in ("corrupt_byte", "short_write"):
        if (p := faults.point(name, rid)) and p.page < num_pages and faults.hit(name, rid):
            damage[p.page] = name
    return SendPlan(order, source, damage, faults.point("delayed_write_after_abort", rid))


class PageMover(Protocol):
    """One transfer's byte-moving step; `run_send` does the rest (manifest, chunks, bounds, faults, last frame)."""

    def prepare(self, deadline: float) -> None:
        """After the manifest went out: wait until pages may be moved or the transfer stops (setting the handle's
        error on a timeout); raising KvfenceError fails the transfer and sends `abort`."""
        ...

    def can_move(self) -> bool:
        """Checked before each chunk: False stops the transfer (nothing may be moved)."""
        ...

    def move(self, chunk: list[int], srcs: list[int], damage: dict[int, str]) -> Payload:
        """Move the pages of one chunk (logical indices `chunk`, read from source pages `srcs`, damaged as
        `damage` says); returns the payload of the chunk's `pages` frame."""
        ...

    def lookahead(self, chunk: list[int], srcs: list[int]) -> None:
        """Called after `move` returned a chunk's payload and before that payload is sent: the chunk that will be
        moved next (a mover may start copying it now, so the copy overlaps the send)."""
        ...


class InlinePages:
    """The two-sided step (local, TCP): a chunk's page bytes travel in its `pages` frame, back to back."""

    def __init__(self, pool: KVPool) -> None:
        self.page_bytes = PageBytes(pool)
        self.bpp = pool.layout.bytes_per_page

    def prepare(self, deadline: float) -> None:
        pass

    def can_move(self) -> bool:
        return True

    def lookahead(self, chunk: list[int], srcs: list[int]) -> None:
        pass  # nothing to copy ahead: the pool's views are sent as they are

    def move(self, chunk: list[int], srcs: list[int], damage: dict[int, str]) -> Payload:
        pieces: list[bytes | bytearray | memoryview] = []
        for i, s in zip(chunk, srcs, strict=True):
            views = self.page_bytes.views(s)
            if i not in damage:
                pieces.extend(views)
                continue
            raw = bytearray(b"".join(views))
            if damage[i] == "corrupt_byte":
                raw[len(raw) // 2] ^= 0x5A
                pieces.append(raw)
            else:  # short_write
                pieces.append(raw[: self.bpp // 2])
        return pieces


def run_send(
    link: Link,
    handle: SendHandle,
    pool: KVPool,
    src_pages: Sequence[int],
    config: TransferConfig,
    manifest_key: bytes,
    faults: FaultInjector | None = None,
    mover: PageMover | None = None,
    staging: HostStaging | None = None,
) -> None:
    """Send one transfer over `link` (blocking; transports run it on a thread).

    Sends the manifest (sealed with `manifest_key`), then the first `manifest.num_pages` of `src_pages` (logical order)
    in chunks moved by `mover` (default: `InlinePages` for a host-visible pool, else `StagedPages` through `staging`,
    the sender's buffers), honouring the in-flight bound, then `done` (or `abort`/`aborted`). Fault hooks:
    short_write, drop_page, corrupt_byte, reorder_pages (`plan_faults`), delayed_write_after_abort.
    """
    m = handle.manifest
    rid, xid = m.request_id, m.transfer_id
    own = mover is None  # a mover made here is closed here
    if mover is None:
        mover = default_mover(pool, config, staging)
    bpp = pool.layout.bytes_per_page
    deadline = handle.started_at + config.send_timeout_s
    assert len(src_pages) >= m.num_pages, (len(src_pages), m.num_pages)
    order, source, damage, late = plan_faults(m.num_pages, rid, faults)

    def stopping() -> bool:
        return (
            handle.local_abort is not None
            or (handle.remote_abort is not None and late is None)
            or handle.status == SendStatus.ERROR
        )

    try:
        link.send(Manifest(rid, xid), [seal(m.to_bytes(), manifest_key)])
        with handle._cond:  # decode may reserve later than we computed: no page moves before its `ready`
            if not handle._cond.wait_for(
                lambda: handle.ready or stopping() or handle.finished, timeout=max(0.0, deadline - time.monotonic())
            ):
                handle.status, handle.reason = (
                    SendStatus.ERROR,
                    f"decode did not accept the manifest within {config.send_timeout_s}s",
                )
        if not stopping():
            mover.prepare(deadline)
        if late is not None:  # the fault: hold the page writes until decode has aborted, then send anyway
            with handle._cond:
                handle._cond.wait_for(lambda: handle.remote_abort is not None, timeout=config.send_timeout_s / 2)
        for seq, start in enumerate(range(0, len(order), config.max_transfer_pages)):
            if not mover.can_move():
                break
            chunk = order[start : start + config.max_transfer_pages]
            sizes = [bpp // 2 if damage.get(i) == "short_write" else bpp for i in chunk]
            nbytes = sum(sizes)
            with handle._cond:

                def room(nbytes: int = nbytes) -> bool:
                    return (
                        stopping()
                        or handle.inflight_bytes == 0
                        or handle.inflight_bytes + nbytes <= config.max_inflight_bytes
                    )

                ok = handle._cond.wait_for(room, timeout=max(0.0, deadline - time.monotonic()))
                if not ok:
                    handle.status, handle.reason = SendStatus.ERROR, f"send timed out after {config.send_timeout_s}s"
                if stopping():
                    break
                handle.inflight_bytes += nbytes
                handle.max_inflight_seen = max(handle.max_inflight_seen, handle.inflight_bytes)
            if handle.remote_abort is not None and late is not None:
                faults.hit("delayed_write_after_abort", rid)  # type: ignore[union-attr]
                time.sleep(late.delay_s)  # keep writing after the abort, slowly
            payload = mover.move(chunk, [src_pages[source[i]] for i in chunk], damage)
            upcoming = order[start + config.max_transfer_pages : start + 2 * config.max_transfer_pages]
            if upcoming:
                mover.lookahead(upcoming, [src_pages[source[i]] for i in upcoming])
            link.send(Pages(rid, xid, seq, chunk, sizes), payload)
            handle.chunks_sent += 1
            handle.max_chunk_pages = max(handle.max_chunk_pages, len(chunk))
            handle.pages_sent += len(chunk)
            handle.bytes_sent += nbytes
        link.send(_last_frame(handle))
        handle.final_sent = True
    except KvfenceError as e:  # the mover failed (a refused write, a peer it cannot write to)
        handle._set(SendStatus.ERROR, str(e))
        try:
            link.send(Abort(rid, xid, str(e)))
            handle.final_sent = True
        except OSError:
            pass
    except OSError as e:
        handle.peer_lost = not handle.finished
        handle._set(SendStatus.ERROR, f"connection to decode failed: {e}")
    finally:
        if own and isinstance(mover, StagedPages):
            mover.close()  # before sender_done: the copies read the source pages
        with handle._cond:
            handle.sender_done = True
            handle.done_at = time.monotonic()
            handle._cond.notify_all()


def default_mover(pool: KVPool, config: TransferConfig, staging: HostStaging | None = None) -> PageMover:
    """How a two-sided transport moves `pool`'s pages: in place from a host-visible pool, else through host staging
    (`staging`: the sender's buffers, kept across transfers; one is made for this transfer when None)."""
    if pool.host_visible:
        return InlinePages(pool)
    return StagedPages(staging or HostStaging(pool, config.max_transfer_pages))


def sender_staging(pool: KVPool, config: TransferConfig) -> HostStaging | None:
    """A sender's staging buffers for `pool` (None for a host-visible pool): two chunks of `max_transfer_pages`."""
    return None if pool.host_visible else HostStaging(pool, config.max_transfer_pages)


def _last_frame(handle: SendHandle) -> ToReceiver:
    """The frame that ends a transfer, by how it ended; a clean end awaits decode's verdict."""
    rid, xid = handle.request_id, handle.transfer_id
    if handle.local_abort is not None:
        handle._set(SendStatus.ABORTED, handle.local_abort)
        return Abort(rid, xid, handle.local_abort)
    if handle.remote_abort is not None:
        return Aborted(rid, xid)
    if handle.status == SendStatus.ERROR:
        return Abort(rid, xid, handle.reason)
    with handle._cond:
        if handle.status == SendStatus.SENDING:
            handle.status = SendStatus.AWAITING_VERDICT
        handle._cond.notify_all()
    return Done(rid, xid, handle.pages_sent)


class Receiver(Protocol):
    """What decode uses; implemented by `LocalReceiver`, `TcpReceiver` and `MooncakeReceiver`."""

    address: str
    core: ReceiverCore

    def expect(self, request_id: str, dest_pages: Sequence[int], transfer_id: str) -> ReceiveSlot: ...
    def abort(self, request_id: str, reason: str) -> None: ...
    def verdict(self, request_id: str, ok: bool, reason: str = "") -> None: ...
    def forget(self, request_id: str) -> None: ...
    def sever(self, request_id: str) -> bool: ...
    def close(self) -> None: ...


class Sender(Protocol):
    """What prefill uses; `send` returns at once, the transfer runs in the background."""

    def send(self, address: str, manifest: HandoffManifest, src_pages: Sequence[int]) -> SendHandle: ...
    def close(self) -> None: ...


class ReceiverBase:
    """The decode-side API of `Receiver`, served by the transport's `core`."""

    core: ReceiverCore

    def expect(self, request_id: str, dest_pages: Sequence[int], transfer_id: str) -> ReceiveSlot:
        return self.core.expect(request_id, dest_pages, transfer_id)

    def abort(self, request_id: str, reason: str) -> None:
        self.core.abort(request_id, reason)

    def verdict(self, request_id: str, ok: bool, reason: str = "") -> None:
        self.core.verdict(request_id, ok, reason)

    def forget(self, request_id: str) -> None:
        self.core.forget(request_id)

    def sever(self, request_id: str) -> bool:
        return self.core.sever(request_id)


class SenderLink(Link, Protocol):
    """A sender's connection to one receiver, with the handles of the transfers it carries."""

    closed: bool
    handles: list[SendHandle]


class SenderBase:
    """`Sender.send` for every transport: register the handle, then connect and run the transfer on the transfer's
    own thread, so a decode that does not answer (up to the connect and handshake timeouts) never stalls the
    caller (prefill's loop, which must keep reporting to the router); a failed connect fails the handle.

    A transport supplies `_connect(address)` (raises OSError or ValueError when no receiver is there) and
    `_transfer(link, handle, src_pages)` (the blocking send, usually `run_send`)."""

    core: SenderCore
    _thread_name = "kvfence-send"  # + "-<request id>"

    def _connect(self, address: str) -> SenderLink:
        raise NotImplementedError

    def _transfer(self, link: SenderLink, handle: SendHandle, src_pages: list[int]) -> None:
        raise NotImplementedError

    def _new_handle(self, manifest: HandoffManifest) -> SendHandle:
        return SendHandle(manifest)

    def _connect_failed(self, address: str, error: Exception) -> str:
        return f"cannot connect to decode at {address}: {error}"

    def send(self, address: str, manifest: HandoffManifest, src_pages: Sequence[int]) -> SendHandle:
        handle = self._new_handle(manifest)
        handle.address = address
        self.core.add(handle)
        threading.Thread(
            target=self._connect_and_transfer,
            args=(address, handle, list(src_pages)),
            name=f"{self._thread_name}-{manifest.request_id}",
            daemon=True,
        ).start()
        return handle

    def _connect_and_transfer(self, address: str, handle: SendHandle, src_pages: list[int]) -> None:
        try:
            if handle.local_abort is not None:  # aborted before its turn to connect: no connect, no pages read
                raise ConnectionError(f"aborted before connecting ({handle.local_abort})")
            link = self._connect(address)
        except Exception as e:  # OSError/ValueError: no receiver there; anything else is still this send's end
            if not isinstance(e, (OSError, ValueError)):
                logger.exception("connecting to decode at %s failed", address)
            handle.peer_lost = True
            handle._set(SendStatus.ERROR, self._connect_failed(address, e))
            with handle._cond:  # no thread will read the source pages
                handle.sender_done = True
                handle._cond.notify_all()
            return
        self.core.attach(link, handle)
        self._transfer(link, handle, src_pages)
