"""The worker loop shared by prefill and decode: register, serve, register again.

What it knows: what a worker and its control channel look like to the loop (`Worker`,
`Channel`), what a worker says about itself at registration (`WorkerIdentity`, and the
`Register` message `registration_for` builds around an engine), the model fingerprint
every worker registers (a hash of config.json and of the weight files' bytes, so two
different checkpoints of one architecture never pair), and the loop itself: register,
then alternate between the control channel and one engine step (on a host's core board,
claiming idle neighbours' cores for it), publishing load reports every few hundred ms (each
says how many orders it covers, and the threads the worker ran with), until told to shut
down, stopped, or orphaned; a worker that loses its router drops what it holds and
registers again.

What it does not know: command-line flags or processes (`kvfence.commands.worker_main`),
what prefill or decode do with a message (their own modules), or HTTP.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvfence.disagg import messages as P
from kvfence.disagg.router_config import RECONNECT_TIMEOUT_S
from kvfence.errors import CapacityConfigError, KvfenceError

if TYPE_CHECKING:
    from kvfence.disagg.core_board import CoreBoard

logger = logging.getLogger(__name__)


class Worker(Protocol):
    role: str
    identity: WorkerIdentity
    engine: Any  # the role's engine (`disagg.worker_engine`), for the start-up line

    def registration(self) -> P.Register: ...
    def handle(self, msg: P.Message) -> None: ...
    def step(self) -> bool: ...  # True when it did work (the loop then polls without waiting)
    @property
    def busy(self) -> bool: ...
    # optional: `poll_interval_s -> float | None`, a shorter wait than the idle one while not busy;
    # `set_waker(fn)`, given the channel's `wake` so other threads can end the loop's wait
    def stats(self) -> dict[str, Any]: ...
    def attach(self, send: Any) -> None: ...
    def held_request_ids(self) -> list[str]: ...  # every request not finished here, whatever its state
    def close(self) -> None: ...


class Channel(Protocol):
    def send(self, msg: P.Message) -> None: ...
    def recv(self, timeout: float | None = 0.0) -> P.Message | None: ...
    def close(self) -> None: ...


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of config.json and every weight file's bytes (xxh3_64 streamed; ~10 GB/s)."""
    import xxhash

    d = Path(model_dir)
    h = hashlib.sha256()
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        x = xxhash.xxh3_64()
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                x.update(block)
        h.update(f.name.encode() + b":" + x.digest())
    return h.hexdigest()[:16]


# -- the loop ---------------------------------------------------------------------------------------------


def register(worker: Worker, channel: Channel, timeout: float = 300.0, stop: threading.Event | None = None) -> bool:
    """Send the registration and wait for the router's answer: True once accepted, False if `stop` was set first
    (SIGTERM while no router answers); a refusal raises with its reason, and so does `timeout`."""
    from kvfence.disagg.registration import HEARTBEAT, REREGISTER

    worker.attach(channel.send)
    channel.send(worker.registration())
    deadline = time.monotonic() + timeout
    refused = getattr(channel, "refused_handshakes", None)
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        msg = channel.recv(timeout=0.5)
        if msg is None:
            if refused is not None and refused() >= 3:  # the router is there and says no: a key mismatch
                raise CapacityConfigError(
                    f"the router refused this {worker.role} worker's control-plane handshake {refused()} times: it "
                    "holds another cluster key (give every process of the deployment the same --cluster-key-file; "
                    "each logs its key id at start)"
                )
            continue
        if isinstance(msg, P.RegisterReply):
            if msg.reason.startswith(REREGISTER):  # an answer to a message queued before our Register: the
                continue  # Register itself comes after it on the same connection, so it needs no resending
            if not msg.accepted:
                raise CapacityConfigError(f"router refused this {worker.role} worker: {msg.reason}")
            if msg.reason == HEARTBEAT:  # a keepalive of a router that still knows us from before
                continue
            return True
        if isinstance(msg, P.Shutdown):
            raise KvfenceError(f"router shut down before accepting this {worker.role} worker")
        logger.warning("%s: ignoring %s before registration", worker.role, msg.kind)
    raise KvfenceError(f"{worker.role}: no answer from the router within {timeout:.0f}s")


def run_worker(
    worker: Worker,
    channel: Channel,
    stop: threading.Event | None = None,
    stats_interval_s: float = 0.25,
    idle_wait_s: float = 0.01,
    orphan_check: bool = False,
    router_timeout_s: float | None = None,
    reconnect_s: float = RECONNECT_TIMEOUT_S,
    cores: CoreBoard | None = None,
) -> None:
    """Serve control messages and engine steps until Shutdown, `stop`, or (orphan_check) our parent dies.

    With `cores` (the launcher's board of this host), each step runs on this worker's share of the cores
    plus those of co-located workers that have no work (`kvfence.disagg.core_board`).

    With `router_timeout_s`, a router silent that long (it sends keepalives) is lost: the
    worker drops every request it holds (freeing their pages) and registers again with
    whatever router answers at the same address within `reconnect_s`, else raises
    KvfenceError (the process exits non-zero and its launcher reports it). A router
    that does not know this worker (it restarted, or declared it dead) asks it to
    register again; the worker does the same.
    """
    from kvfence.disagg.registration import REREGISTER

    stop = stop or threading.Event()
    worker.attach(channel.send)
    set_waker, wake = getattr(worker, "set_waker", None), getattr(channel, "wake", None)
    if set_waker is not None and wake is not None:
        set_waker(wake)  # transport threads end the loop's wait when a transfer moves on
    parent = os.getppid()
    instance = worker.registration().instance  # this process, in every load report
    last_stats = 0.0
    heard = time.monotonic()
    orders = 0  # orders handled since this worker registered: its load reports say which ones they cover
    try:
        while not stop.is_set():
            wait = 0.0 if worker.busy else min(idle_wait_s, getattr(worker, "poll_interval_s", None) or idle_wait_s)
            msg = channel.recv(timeout=wait)
            lost = ""
            while msg is not None:
                heard = time.monotonic()
                if isinstance(msg, P.Shutdown):
                    return
                if isinstance(msg, P.RegisterReply) and msg.reason.startswith(REREGISTER):
                    lost = msg.reason
                elif not isinstance(msg, P.RegisterReply):
                    worker.handle(msg)
                    orders += isinstance(msg, P.Order)
                msg = channel.recv(timeout=0.0)
            if router_timeout_s is not None and not lost and time.monotonic() - heard > router_timeout_s:
                lost = f"no message from the router for {router_timeout_s:.0f}s"
            if lost:
                if router_timeout_s is None:
                    raise KvfenceError(f"{worker.role}: the router no longer knows this worker ({lost})")
                dropped = drop_requests(worker, f"router lost: {lost}")
                logger.error("%s: %s; dropped %d request(s), registering again", worker.role, lost, dropped)
                try:
                    if not register(worker, channel, timeout=reconnect_s, stop=stop):
                        return  # told to stop while waiting for a router
                except KvfenceError as e:
                    raise KvfenceError(f"{worker.role}: router lost ({lost}) and none answered: {e}") from None
                logger.info("%s: registered again", worker.role)
                heard, orders, last_stats = time.monotonic(), 0, 0.0
            if cores is not None:
                cores.claim(worker.busy)  # threads for this step: our share, plus idle neighbours' cores
            worker.step()
            if cores is not None and not worker.busy:
                cores.claim(False)  # hand the cores back at once, not after the next wait
            now = time.monotonic()
            if now - last_stats >= stats_interval_s:
                last_stats = now
                stats = {**worker.stats(), "orders_seen": orders}
                if cores is not None:
                    stats.update(torch_threads=cores.threads, steps_borrowing_cores=cores.steps_borrowing)
                channel.send(P.WorkerStats(worker.role, stats, instance=instance))
                if orphan_check and os.getppid() != parent:
                    logger.error("%s: parent process %d is gone; exiting", worker.role, parent)
                    return
    finally:
        worker.close()


def drop_requests(worker: Worker, reason: str) -> int:
    """Abort every request the worker holds, as the router's Abort would (pages freed, or quarantined until their
    transfer settles); returns how many."""
    rids = worker.held_request_ids()
    for rid in rids:
        worker.handle(P.Abort(rid, reason))
    return len(rids)


# -- what a worker registers with ---------------------------------------------------------------------


class WorkerIdentity:
    """What a worker says about itself at registration, besides its engine's numbers.

    `context_length`: the deployment's context length when it exceeds what the engine runs with (the
    engine is capped at its pool under --allow-context-above-pool); None: the engine's own."""

    __slots__ = ("worker_id", "model_name", "model_fingerprint", "settings", "context_length", "instance")

    def __init__(
        self,
        worker_id: str,
        model_name: str,
        model_fingerprint: str,
        settings: dict[str, Any],
        context_length: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.settings = settings
        self.context_length = context_length
        self.instance = secrets.token_hex(8)  # this process: tells a worker that comes back from its replacement


def registration_for(role: str, engine: Any, identity: WorkerIdentity, handoff_address: str = "") -> P.Register:
    """The Register message of a worker built around `engine` (an LLMEngine)."""
    from kvfence.integrity.digest import digest_algorithm_for
    from kvfence.kv.layout import dtype_name

    r = engine.resolved
    layout = engine.pool.layout
    return P.Register(
        role=role,
        worker_id=identity.worker_id,
        model_name=identity.model_name,
        model_fingerprint=identity.model_fingerprint,
        context_length=identity.context_length or r.context_length,
        pool_tokens=r.pool_tokens,
        page_size=r.page_size,
        dtype=dtype_name(layout.dtype),
        layout_fingerprint=layout.fingerprint,
        layout=layout.describe(),
        handoff_address=handoff_address,
        settings={
            **identity.settings,
            "num_pages": r.num_pages,
            "bytes_per_page": r.bytes_per_page,
            "digest_algorithm": digest_algorithm_for(engine.pool),
        },
        vocab_size=int(engine.vocab_size),
        instance=identity.instance,
    )
