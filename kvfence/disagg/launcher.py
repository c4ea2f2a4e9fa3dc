"""Start a router and N prefill + M decode workers as child processes, and keep them running.

What it knows: how to pick free loopback ports at run time (the OS chooses; each is
passed to its process explicitly on the command line: the router's HTTP and control
ports, one data-plane port per decode worker), the command lines (`python -m
kvfence.commands.worker_main --role ...`, each worker with a stable `--worker-id` such as
`decode-1`), the order (router first, since workers register with it), the core board
the workers pool their threads on when given a core budget (a small file made at start,
removed at stop, each worker told its slot: `kvfence.disagg.core_board`), and what to do
when a child exits:

* the router holds nothing but in-flight requests (those fail when it dies), so it is
  restarted on the same ports up to `max_router_restarts` times, and the workers register
  with it again keeping their loaded models and pools;
* a worker that dies (killed, crashed) is restarted in its slot (same id, same ports) up
  to `max_worker_restarts` times; it registers again and takes traffic, while the router
  has failed the requests that were on it and routed new ones to the others;
* a process that exits with code 2 (the router refused a worker, its flags are wrong, a port
  it needs is taken: starting it again would fail the same way), or anything past its
  restart limit, stops the whole deployment with the exit codes reported, for the supervisor
  above; the router is no exception.

Ctrl-C / SIGTERM stops all of them (workers first).

The processes share one cluster key (`kvfence.auth.keys`): the one given, else a fresh one drawn
here. It reaches each child through its environment (`$KVFENCE_CLUSTER_KEY`), never its command
line, and each child removes it from its own environment once read. Under --insecure-no-auth the
children get that flag instead.

What it does not know: what the processes do; it only starts, watches and stops them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.auth.keys import API_KEY_ENV, ENV_KEY, ENV_KEY_FILE, ClusterKey
from kvfence.disagg.core_board import CoreBoard
from kvfence.errors import KvfenceError

CONFIG_ERROR_EXIT = 2  # what a kvfence process exits with on a refusal or a configuration error
# How long an idle OpenMP thread of a worker on a core board spins before it sleeps (GNU OpenMP, torch's runtime
# on Linux; in busy-wait iterations). libgomp's default, 300,000, keeps a thread that a worker no longer uses
# spinning for milliseconds on a core its neighbour has just claimed.
BOARD_SPINCOUNT = 20_000


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on `host` (bound, read, closed)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", taken: Sequence[int] = ()) -> list[int]:
    """`n` different ports the OS says are free right now on `host`, none of them in `taken`. All are held bound
    until the last is picked: ports picked one at a time can repeat (the OS may hand a closed port out again)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in taken:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


@dataclass(frozen=True)
class LaunchConfig:
    host: str = "127.0.0.1"
    http_port: int = 0  # 0 -> pick a free port
    control_port: int = 0  # router's control-plane (zmq) port; 0 -> pick
    handoff_ports: tuple[int, ...] = ()  # each decode worker's data-plane port; missing ones are picked
    num_prefill: int = 1
    num_decode: int = 1
    common_args: tuple[str, ...] = ()  # passed to every role (model, page size, ...)
    prefill_args: tuple[str, ...] = ()  # e.g. ("--max-total-tokens", "4096")
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    max_router_restarts: int = 3  # a router that exits is started again on the same ports this many times
    max_worker_restarts: int = 3  # per worker slot: a worker that dies is started again this many times
    core_budget: int | None = None  # threads the workers pool on a core board (None: each keeps its own)
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        assert self.num_prefill >= 1 and self.num_decode >= 1, (self.num_prefill, self.num_decode)
        assert len(self.handoff_ports) <= self.num_decode, self.handoff_ports
        assert self.max_router_restarts >= 0 and self.max_worker_restarts >= 0
        assert self.core_budget is None or self.core_budget >= 1, self.core_budget


@dataclass(frozen=True)
class LaunchedPorts:
    http: int
    control: int
    handoff: tuple[int, ...]  # decode-i listens on handoff[i]


def slot_role(slot: str) -> str:
    """The role of a launcher slot: router -> router, decode-1 -> decode."""
    return slot.rsplit("-", 1)[0]


class Launcher:
    """The processes of one disaggregated deployment, one per slot ("router", "prefill-0", "decode-1", ...)."""

    def __init__(
        self, config: LaunchConfig, stdout: int | None = None, stderr: int | None = None, key: ClusterKey | None = None
    ) -> None:
        """`key`: the deployment's cluster key (default: a fresh one, known only to this launcher's children)."""
        self.config = config
        self.key = key if key is not None else ClusterKey.generate()
        given = [p for p in (config.http_port, config.control_port, *config.handoff_ports) if p]
        missing = (not config.http_port) + (not config.control_port) + config.num_decode - len(config.handoff_ports)
        fresh = iter(free_ports(missing, config.host, taken=given))  # one pick: no port twice
        self.ports = LaunchedPorts(
            http=config.http_port or next(fresh),
            control=config.control_port or next(fresh),
            handoff=(
                *config.handoff_ports,
                *(next(fresh) for _ in range(config.num_decode - len(config.handoff_ports))),
            ),
        )
        self.slots: tuple[str, ...] = (
            "router",
            *(f"prefill-{i}" for i in range(config.num_prefill)),
            *(f"decode-{i}" for i in range(config.num_decode)),
        )
        self._stdout = stdout
        self._stderr = stderr
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: Counter[str] = Counter()  # slot -> times restarted
        self.core_board: str | None = None  # the workers' shared core board, made by start()

    @property
    def router_restarts(self) -> int:
        return self.restarts["router"]

    # -- command lines --------------------------------------------------------
    def command(self, slot: str) -> list[str]:
        c, p = self.config, self.ports
        role = slot_role(slot)
        base = [c.python, "-m", "kvfence.commands.worker_main", "--role", role, "--exit-with-parent", *c.common_args]
        if not self.key.secure and "--insecure-no-auth" not in base:
            base.append("--insecure-no-auth")
        router_addr = f"tcp://{c.host}:{p.control}"
        if slot == "router":
            return [*base, "--host", c.host, "--port", str(p.http), "--control-port", str(p.control), *c.router_args]
        worker = [*base, "--router-address", router_addr, "--worker-id", slot]
        if self.core_board is not None:
            worker += ["--core-board", self.core_board, "--core-board-slot", str(self.slots.index(slot) - 1)]
        if role == "prefill":
            return [*worker, *c.prefill_args]
        if role == "decode":
            port = p.handoff[int(slot.rsplit("-", 1)[1])]
            return [*worker, "--handoff-host", c.host, "--handoff-port", str(port), *c.decode_args]
        raise ValueError(f"unknown slot {slot!r}")

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.ports.http}"

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        if self.config.core_budget is not None and self.core_board is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # memory-backed where there is one
            fd, self.core_board = tempfile.mkstemp(prefix="kvfence-cores-", dir=shm)
            os.close(fd)
            CoreBoard.create(self.core_board, len(self.slots) - 1, self.config.core_budget)
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: str) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop(ENV_KEY_FILE, None)  # the key goes in the environment below: one source for every child
        env.pop(ENV_KEY, None)
        if self.key.secure:
            env[ENV_KEY] = self.key.to_hex()
        if slot != "router":
            env.pop(API_KEY_ENV, None)  # only the router serves clients: the workers never see their key
        if self.core_board is not None and slot != "router":
            env.setdefault("GOMP_SPINCOUNT", str(BOARD_SPINCOUNT))
        self.procs[slot] = subprocess.Popen(
            self.command(slot), stdout=self._stdout, stderr=self._stderr, env=env, start_new_session=True
        )

    def dead(self) -> list[tuple[str, int]]:
        """Children that exited, with their exit codes."""
        return [(slot, p.returncode) for slot, p in self.procs.items() if p.poll() is not None]

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
        for slot in (*self.slots[1:], "router"):
            p = self.procs.get(slot)
            if p is not None and p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        if self.core_board is not None:
            Path(self.core_board).unlink(missing_ok=True)
            self.core_board = None
        return {slot: p.returncode for slot, p in self.procs.items()}

    def supervise(self) -> int | None:
        """One look at the children: restart the ones that may be; None while serving, else the exit code
        after stopping everything (see the module docstring for the rules)."""
        for slot, code in self.dead():
            limit = self.config.max_router_restarts if slot == "router" else self.config.max_worker_restarts
            refused = code == CONFIG_ERROR_EXIT  # any process refused on configuration fails the same way again
            if refused or self.restarts[slot] >= limit:
                why = "it cannot start as configured" if refused else f"restarted {self.restarts[slot]} time(s) already"
                print(f"kvfence: {_describe([(slot, code)])} ({why}); stopping the others", file=sys.stderr)
                self.stop()
                return 1
            self.restarts[slot] += 1
            then = "the workers register with it again" if slot == "router" else "it registers again"
            print(
                f"kvfence: {_describe([(slot, code)])}; restarting it ({self.restarts[slot]}/{limit}); {then}",
                file=sys.stderr,
            )
            self._spawn(slot)
        return None

    def watch(self) -> int:
        """Block until we are told to stop or the deployment cannot go on; then stop all. Returns an exit code."""
        stop: dict[str, int | None] = {"signal": None}

        def on_signal(signum: int, _frame: object) -> None:
            stop["signal"] = signum

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while stop["signal"] is None:
                code = self.supervise()
                if code is not None:
                    return code
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
    return ", ".join(f"{slot} exited with code {code}" for slot, code in dead)


def launch(config: LaunchConfig, key: ClusterKey | None = None) -> int:
    """Start the processes and serve until Ctrl-C / SIGTERM or the deployment cannot go on."""
    launcher = Launcher(config, key=key)
    launcher.start()
    handoff = ", ".join(f"decode-{i} {config.host}:{port}" for i, port in enumerate(launcher.ports.handoff))
    auth = f"cluster key id {launcher.key.key_id}" if launcher.key.secure else "NO AUTHENTICATION"
    print(
        f"kvfence: router http {launcher.base_url}, control tcp://{config.host}:{launcher.ports.control}; "
        f"{config.num_prefill} prefill and {config.num_decode} decode worker(s); handoff {handoff}; {auth}",
        file=sys.stderr,
    )
    from kvfence.models.startup_pages import release_startup_pages

    release_startup_pages()  # the imports' and the start's code: the launcher only watches from here on
    return launcher.watch()
