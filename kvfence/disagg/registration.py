"""Worker registration at the router: who may join, keepalives, and who went silent.

What it knows: how the router answers a registering worker (accepted, or refused with
the reason, which is also kept for the start-up error), that a worker must register over
its own connection and match the deployment (`workers.check_match`: every prefill must be
able to hand KV to every decode, so a pair that cannot is refused, `check_pair`), the
keepalive the router sends each up worker (`RegisterReply(accepted=True, reason=HEARTBEAT)`),
the answer to a worker the router does not know (`RegisterReply(accepted=False,
reason=REREGISTER ...)`, at most once a second per worker) and which up workers have been
silent longer than `worker_timeout_s`.

What it does not know: requests. What a worker's death or return means for the requests it
holds is the router's business (`Router._declare_dead`); this module only names them.
Not thread-safe on its own: it takes the router's lock around the worker table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvfence.disagg import messages as P
from kvfence.disagg.workers import WorkerEntry, WorkerTable, check_match
from kvfence.errors import CapacityConfigError

logger = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"  # reason of the router's keepalive RegisterReply
REREGISTER = "re-register"  # prefix of the reason telling an unknown worker to register again
MAX_REFUSALS = 16  # refusal reasons kept for the start-up error and tests


def check_pair(prefill: P.Register, decode: P.Register) -> None:
    """Refuse a prefill/decode pair that cannot exchange KV; the message names every difference and both values."""
    check_match(decode, prefill)


class Registrar:
    """The router's side of registration and liveness, over the router's `WorkerTable` and hub."""

    def __init__(
        self,
        hub: P.Hub,
        workers: WorkerTable,
        lock: threading.RLock,
        allow_context_above_pool: bool,
        heartbeat_interval_s: float,
        worker_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hub = hub
        self._clock = clock  # the router's clock: a new worker was last heard at registration
        self.workers = workers
        self._lock = lock
        self.allow_context_above_pool = allow_context_above_pool
        self.heartbeat_interval_s = heartbeat_interval_s
        self.worker_timeout_s = worker_timeout_s
        self.refusals: list[str] = []  # why workers were refused (last few)
        self._told_reregister: dict[str, float] = {}  # worker id -> when we last asked it to register again
        self._last_heartbeat = 0.0

    def register(self, wid: str, msg: P.Register, taking_traffic: bool, replaced: Callable[[str, str], None]) -> None:
        """A worker registering: at start, a replacement, a new one, or a known one coming back.

        `replaced(wid, detail)` is called first when `wid` was registered already (it restarted or lost its
        router and dropped its requests): the router fails what still needed the old one.
        """
        if msg.worker_id != wid:
            self.refuse(wid, msg, f"worker registered as {msg.worker_id!r} over the connection of {wid!r}")
            return
        try:
            with self._lock:
                self.workers.check(msg, self.allow_context_above_pool)
        except CapacityConfigError as e:
            self.refuse(wid, msg, str(e))
            return
        with self._lock:
            old = self.workers.get(wid)
            live = old is not None and self._clock() - old.last_seen < self.workers.suspect_after_s
        if old is not None and live and not self.same_instance(old, msg):
            # Another process holds this id and is alive (a paused worker that woke up after being replaced, or a
            # second one started by mistake): refuse the newcomer rather than evict a live worker.
            self.refuse(
                wid,
                msg,
                f"worker id {wid} belongs to another live process (instance {old.reg.instance}, heard "
                f"{self._clock() - old.last_seen:.1f}s ago); give this one another --worker-id",
            )
            return
        if old is not None:
            replaced(wid, f"{msg.role} worker {wid} registered again (it restarted or lost its router)")
        with self._lock:
            self.workers.add(msg, self._clock())
            self._told_reregister.pop(wid, None)
        self.hub.send(wid, P.RegisterReply(accepted=True))
        logger.info(
            "router: %s worker %s registered (pool %d tokens, data plane %s)%s",
            msg.role,
            wid,
            msg.pool_tokens,
            msg.handoff_address or "-",
            " and takes traffic" if taking_traffic else "",
        )

    @staticmethod
    def same_instance(entry: WorkerEntry, msg: P.Register | P.WorkerStats) -> bool:
        """Whether `msg` comes from the process `entry` registered (processes name themselves with a random
        `instance`; a message without one is taken as the same)."""
        return not msg.instance or not entry.reg.instance or msg.instance == entry.reg.instance

    def refuse(self, wid: str, msg: P.Register, reason: str) -> None:
        logger.warning("router: refused %s worker %s: %s", msg.role, wid, reason)
        self.refusals = [*self.refusals[-(MAX_REFUSALS - 1) :], f"{wid}: {reason}"]
        self.hub.send(wid, P.RegisterReply(accepted=False, reason=reason))

    def unknown(self, wid: str, now: float) -> None:
        """A message from a worker the router does not know (it restarted) or declared dead: register again."""
        if now - self._told_reregister.get(wid, 0.0) > 1.0:
            self._told_reregister[wid] = now
            reason = f"{REREGISTER}: this router does not know worker {wid}; register again"
            self.hub.send(wid, P.RegisterReply(accepted=False, reason=reason))

    def keepalive(self, now: float) -> list[tuple[str, str]]:
        """Send keepalives when due; return (worker id, why) of every up worker silent for `worker_timeout_s`."""
        with self._lock:
            up = self.workers.up()
        if now - self._last_heartbeat >= self.heartbeat_interval_s:
            self._last_heartbeat = now
            for e in up:
                self.hub.send(e.worker_id, P.RegisterReply(accepted=True, reason=HEARTBEAT))
        silent = []
        for e in up:
            quiet = now - e.last_seen
            if quiet > self.worker_timeout_s:
                silent.append((e.worker_id, f"{e.role} worker {e.worker_id} lost: no message for {quiet:.1f}s"))
        return silent
