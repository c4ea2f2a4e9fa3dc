"""A disaggregated deployment in one process, for fast tests: a router with N prefill and M decode workers.

What it knows: how to build the same objects `kvfence serve` runs as processes, here with
the worker loops on threads, control messages on queues (`QueueHub`) and KV over the
local transport (`transfer.local`), sharing one loaded model; how to stop one worker's
loop as if its process vanished, and bring it back. What it does not know: processes or
ports (`kvfence.disagg.launcher` starts the real deployment).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfence.disagg import messages as P
from kvfence.disagg.decode import DecodeConfig, DecodeWorker
from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
from kvfence.disagg.router import Router, RouterConfig
from kvfence.disagg.worker import WorkerIdentity, register, run_worker
from kvfence.disagg.worker import model_fingerprint as fingerprint_of
from kvfence.engine.llm_engine import LLMEngine
from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender
from tests.helpers.auth import plane_auth

logger = logging.getLogger(__name__)


class InProcessDeployment:
    """A router with N prefill and M decode workers in this process: worker loops on threads, KV over `transfer.local`.

    `prefill_config` / `decode_config` are one EngineConfig (one worker) or a sequence of them (one
    worker each, pools may differ). Every engine shares one loaded model (forward passes only read
    it); each has its own KV pool. Workers are `prefill-i` / `decode-i`; `prefill` and `decode` (and
    their engines) are the first of each. `faults` (one injector) is given to every worker, since
    sender- and receiver-side faults live on different sides. `clock`: the router's (default monotonic time),
    e.g. a `tests.helpers.clock.ManualClock`.
    """

    def __init__(
        self,
        prefill_config: Any,
        decode_config: Any,
        router_config: Any = None,
        *,
        loaded: Any = None,
        verify: bool = True,
        strict: bool = False,
        deadline_s: float = 30.0,
        faults: Any = None,
        transfer_config: Any = None,
        model_fingerprint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        prefill_configs = list(prefill_config) if isinstance(prefill_config, (list, tuple)) else [prefill_config]
        decode_configs = list(decode_config) if isinstance(decode_config, (list, tuple)) else [decode_config]
        model_dir = str(prefill_configs[0].model.model_dir)
        fp = model_fingerprint or fingerprint_of(model_dir)
        name = Path(model_dir).name
        self.fabric = LocalFabric()
        self.auth = plane_auth()  # one cluster key for this deployment's senders and receivers
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        for i, cfg in enumerate(prefill_configs):
            engine = LLMEngine(cfg, loaded=loaded)
            loaded = loaded or engine.loaded
            sender = LocalSender(self.fabric, engine.pool, transfer_config, faults, auth=self.auth)
            self.prefills.append(
                PrefillWorker(
                    engine,
                    WorkerIdentity(f"prefill-{i}", name, fp, {"model_dir": model_dir, "transport": "local"}),
                    PrefillConfig(transport="local", deadline_s=deadline_s, strict=strict),
                    faults=faults,
                    sender=sender,
                    auth=self.auth,
                )
            )
        for i, cfg in enumerate(decode_configs):
            engine = LLMEngine(cfg, loaded=loaded)
            wid = f"decode-{i}"
            self.decodes.append(
                DecodeWorker(
                    engine,
                    WorkerIdentity(wid, name, fp, {"model_dir": model_dir, "transport": "local"}),
                    DecodeConfig(transport="local", deadline_s=deadline_s, verify=verify, strict=strict),
                    faults=faults,
                    receiver=LocalReceiver(self.fabric, wid, engine.pool, faults, auth=self.auth),
                    auth=self.auth,
                )
            )
        self.prefill, self.decode = self.prefills[0], self.decodes[0]
        self.prefill_engine, self.decode_engine = self.prefill.engine, self.decode.engine
        self.sender, self.receiver = self.prefill.sender, self.decode.receiver
        self.hub = P.QueueHub()
        self.router = Router(
            self.hub,
            router_config
            or RouterConfig(
                handoff_deadline_s=deadline_s,
                wait_prefill_workers=len(self.prefills),
                wait_decode_workers=len(self.decodes),
            ),
            clock=clock,
        )
        self._threads: dict[str, threading.Thread] = {}
        self._stops: dict[str, threading.Event] = {}
        self.errors: list[BaseException] = []
        for worker in self.workers:
            self.start_worker(worker)
        try:
            self.router.wait_for_workers(timeout=min(30.0, self.router.config.register_timeout_s))
        except BaseException:
            self._stop_all()
            raise
        self.router.start()

    @property
    def workers(self) -> list[Any]:
        return [*self.prefills, *self.decodes]

    def start_worker(self, worker: Any) -> None:
        """Run `worker`'s loop on a thread of its own (register, then serve); also to bring one back."""
        wid = worker.identity.worker_id
        channel = self.hub.connect(wid, replace=True)
        stop = threading.Event()

        def serve() -> None:
            try:
                register(worker, channel, timeout=30)
                run_worker(worker, channel, stop=stop, idle_wait_s=0.002)
            except Exception as e:  # kept for the tests; a refused registration ends the thread
                logger.exception("in-process worker %s ended with an error", wid)  # in the failing test's log
                self.errors.append(e)

        t = threading.Thread(target=serve, name=f"kvfence-{wid}", daemon=True)
        self._stops[wid], self._threads[wid] = stop, t
        t.start()

    def stop_worker(self, worker_id: str, timeout: float = 10.0) -> None:
        """Stop one worker's loop as if its process vanished: it sends nothing more, and closes its transport."""
        self._stops[worker_id].set()
        self._threads[worker_id].join(timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no worker holds a request or a page (handoffs settled, quarantines over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w.idle() for w in self.workers):
                return True
            time.sleep(0.01)
        return False

    def _stop_all(self) -> None:
        for stop in self._stops.values():
            stop.set()
        for t in self._threads.values():
            t.join(timeout=10)

    def close(self) -> None:
        self.router.close()
        self._stop_all()

    def __enter__(self) -> InProcessDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
