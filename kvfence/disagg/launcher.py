"""Start a router, a prefill worker and a decode worker: as child processes, or as threads of one process.

What it knows: how to pick free loopback ports at run time (the OS chooses; each is
passed to its process explicitly on the command line), the three command lines
(`python -m kvfence.disagg.worker_main --role ...`), the order (router first, since
workers register with it), and the rule that the three live and die together: a
worker that exits takes the others down (reported with its exit code, for the
supervisor above to restart the deployment), and Ctrl-C / SIGTERM stops all of them.
The one exception is the router: it holds nothing but in-flight requests (those fail
when it dies), so a router that exits is restarted on the same ports, up to
`max_router_restarts` times, and the workers register with it again keeping their
loaded models and pools.
`InProcessDeployment` builds the same three objects in one process (workers on
threads, control messages on queues, KV on the local transport) for fast tests.

What it does not know: what the processes do; it only starts, watches and stops them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence.errors import KvfenceError


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on `host` (bound, read, closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class LaunchConfig:
    host: str = "127.0.0.1"
    http_port: int = 0  # 0 -> pick a free port
    control_port: int = 0  # router's control-plane (zmq) port; 0 -> pick
    handoff_port: int = 0  # decode's data-plane port; 0 -> pick
    common_args: tuple[str, ...] = ()  # passed to every role (model, page size, ...)
    prefill_args: tuple[str, ...] = ()  # e.g. ("--max-total-tokens", "4096")
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    max_router_restarts: int = 3  # a router that exits is started again on the same ports this many times
    python: str = field(default_factory=lambda: sys.executable)


@dataclass(frozen=True)
class LaunchedPorts:
    http: int
    control: int
    handoff: int


class Launcher:
    """The three processes of one disaggregated deployment; use as a context manager."""

    def __init__(self, config: LaunchConfig, stdout: int | None = None, stderr: int | None = None) -> None:
        self.config = config
        self.ports = LaunchedPorts(
            http=config.http_port or free_port(config.host),
            control=config.control_port or free_port(config.host),
            handoff=config.handoff_port or free_port(config.host),
        )
        self._stdout = stdout
        self._stderr = stderr
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.router_restarts = 0

    # -- command lines --------------------------------------------------------
    def command(self, role: str) -> list[str]:
        c, p = self.config, self.ports
        base = [c.python, "-m", "kvfence.disagg.worker_main", "--role", role, "--exit-with-parent", *c.common_args]
        router_addr = f"tcp://{c.host}:{p.control}"
        if role == "router":
            return [*base, "--host", c.host, "--port", str(p.http), "--control-port", str(p.control), *c.router_args]
        if role == "prefill":
            return [*base, "--router-address", router_addr, *c.prefill_args]
        if role == "decode":
            return [
                *base,
                "--router-address",
                router_addr,
                "--handoff-host",
                c.host,
                "--handoff-port",
                str(p.handoff),
                *c.decode_args,
            ]
        raise ValueError(f"unknown role {role!r}")

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.ports.http}"

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        for role in ("router", "prefill", "decode"):
            self._spawn(role)

    def _spawn(self, role: str) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.procs[role] = subprocess.Popen(
            self.command(role), stdout=self._stdout, stderr=self._stderr, env=env, start_new_session=True
        )

    def dead(self) -> list[tuple[str, int]]:
        """Children that exited, with their exit codes."""
        return [(role, p.returncode) for role, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until the router's HTTP server answers /health; raise if a child dies first."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                self.stop()
                raise KvfenceError(f"disaggregated deployment failed to start: {_describe(dead)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise KvfenceError(f"router did not become ready at {self.base_url} within {timeout:.0f}s")

    def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM every child (workers first), then SIGKILL what is left after `grace_s`."""
        for role in ("prefill", "decode", "router"):
            p = self.procs.get(role)
            if p is not None and p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        return {role: p.returncode for role, p in self.procs.items()}

    def watch(self) -> int:
        """Block until a child exits or we are told to stop; then stop all. Returns an exit code."""
        stop = {"signal": None}

        def on_signal(signum: int, _frame: object) -> None:
            stop["signal"] = signum

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while stop["signal"] is None:
                dead = self.dead()
                if [role for role, _ in dead] == ["router"] and self.router_restarts < self.config.max_router_restarts:
                    self.router_restarts += 1
                    print(
                        f"kvfence: {_describe(dead)}; restarting it ({self.router_restarts}/"
                        f"{self.config.max_router_restarts}); the workers register with it again",
                        file=sys.stderr,
                    )
                    self._spawn("router")
                    continue
                if dead:
                    print(f"kvfence: {_describe(dead)}; stopping the others", file=sys.stderr)
                    self.stop()
                    return 1
                time.sleep(0.2)
            self.stop()
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the child leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(dead: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{role} exited with code {code}" for role, code in dead)


def launch(config: LaunchConfig) -> int:
    """Start the three processes and serve until Ctrl-C / SIGTERM or a child dies."""
    launcher = Launcher(config)
    launcher.start()
    print(
        f"kvfence: router http {launcher.base_url}, control tcp://{config.host}:{launcher.ports.control}, "
        f"decode handoff {config.host}:{launcher.ports.handoff}",
        file=sys.stderr,
    )
    return launcher.watch()


# -- one process ------------------------------------------------------------------------------------------


class InProcessDeployment:
    """Router + prefill + decode in this process: worker loops on threads, KV over `transfer.local`.

    Both engines share one loaded model (forward passes only read it); each has its own
    KV pool sized by its own `EngineConfig`. `faults` (one injector) is given to both
    sides, since sender- and receiver-side faults live on different sides.
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
    ) -> None:
        from kvfence.disagg import protocol as P
        from kvfence.disagg.decode import DecodeConfig, DecodeWorker
        from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
        from kvfence.disagg.router import Router, RouterConfig
        from kvfence.disagg.worker_main import WorkerIdentity, register, run_worker
        from kvfence.disagg.worker_main import model_fingerprint as fingerprint_of
        from kvfence.engine.llm_engine import LLMEngine
        from kvfence.transfer.local import LocalFabric, LocalReceiver, LocalSender

        self.prefill_engine = LLMEngine(prefill_config, loaded=loaded)
        self.decode_engine = LLMEngine(decode_config, loaded=loaded or self.prefill_engine.loaded)
        model_dir = str(prefill_config.model.model_dir)
        fp = model_fingerprint or fingerprint_of(model_dir)
        name = Path(model_dir).name
        self.fabric = LocalFabric()
        self.receiver = LocalReceiver(self.fabric, "decode-0", self.decode_engine.pool, faults)
        self.sender = LocalSender(self.fabric, self.prefill_engine.pool, transfer_config, faults)
        self.prefill = PrefillWorker(
            self.prefill_engine,
            WorkerIdentity("prefill-0", name, fp, {"model_dir": model_dir, "transport": "local"}),
            PrefillConfig(transport="local", deadline_s=deadline_s, strict=strict),
            faults=faults,
            sender=self.sender,
        )
        self.decode = DecodeWorker(
            self.decode_engine,
            WorkerIdentity("decode-0", name, fp, {"model_dir": model_dir, "transport": "local"}),
            DecodeConfig(transport="local", deadline_s=deadline_s, verify=verify, strict=strict),
            faults=faults,
            receiver=self.receiver,
        )
        self.hub = P.QueueHub()
        self.router = Router(self.hub, router_config or RouterConfig(handoff_deadline_s=deadline_s))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        for worker in (self.prefill, self.decode):
            channel = self.hub.connect(worker.identity.worker_id)

            def serve(worker: Any = worker, channel: Any = channel) -> None:
                try:
                    register(worker, channel, timeout=30)
                    run_worker(worker, channel, stop=self._stop, idle_wait_s=0.002)
                except Exception as e:  # kept for the tests; a refused registration ends the thread
                    self.errors.append(e)

            t = threading.Thread(target=serve, name=f"kvfence-{worker.role}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self.router.wait_for_workers(timeout=30)
        except BaseException:
            self._stop.set()
            for t in self._threads:
                t.join(timeout=10)
            raise
        self.router.start()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until neither worker holds a request or a page (handoffs settled, quarantines over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.prefill.idle() and self.decode.idle():
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.router.close()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> InProcessDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
