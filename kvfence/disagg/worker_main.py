"""Process entry points of disaggregated serving: `python -m kvfence.disagg.worker_main --role ...`.

What it knows: the command-line flags of each role, how to build a worker's engine
from them (each role has its own KV pool, sized by its own `--max-total-tokens`),
the model fingerprint every worker registers (a hash of config.json and of the weight
files' bytes, so two different checkpoints of one architecture never pair), and the
worker loop shared by prefill and decode: register, then alternate between the
control channel and one engine step, publishing load reports every few hundred ms
(each says how many orders it covers), until told to shut down, signalled, or
orphaned; a worker that loses its router drops what it holds and registers again.

What it does not know: what prefill or decode do with a message (their own modules),
or HTTP (the router role hands its `Router` to the API helper's `build_app`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from kvfence.disagg import protocol as P
from kvfence.errors import CapacityConfigError, KvfenceError

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "router")


class Worker(Protocol):
    role: str

    def registration(self) -> P.Register: ...
    def handle(self, msg: P.Message) -> None: ...
    def step(self) -> bool: ...  # True when it did work (the loop then polls without waiting)
    @property
    def busy(self) -> bool: ...
    # optional: `poll_interval_s -> float | None`, a shorter wait than the idle one while not busy;
    # `set_waker(fn)`, given the channel's `wake` so other threads can end the loop's wait
    def stats(self) -> dict[str, Any]: ...
    def attach(self, send: Any) -> None: ...
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


def register(worker: Worker, channel: Channel, timeout: float = 300.0) -> None:
    """Send the registration and wait for the router's answer; a refusal raises with its reason."""
    from kvfence.disagg.router import HEARTBEAT, REREGISTER

    worker.attach(channel.send)
    channel.send(worker.registration())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = channel.recv(timeout=0.5)
        if msg is None:
            continue
        if isinstance(msg, P.RegisterReply):
            if msg.reason.startswith(REREGISTER):  # an answer to a message queued before our Register: the
                continue  # Register itself comes after it on the same connection, so it needs no resending
            if not msg.accepted:
                raise CapacityConfigError(f"router refused this {worker.role} worker: {msg.reason}")
            if msg.reason == HEARTBEAT:  # a keepalive of a router that still knows us from before
                continue
            return
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
    reconnect_s: float = 60.0,
) -> None:
    """Serve control messages and engine steps until Shutdown, `stop`, or (orphan_check) our parent dies.

    With `router_timeout_s`, a router silent that long (it sends keepalives) is lost: the
    worker drops every request it holds (freeing their pages) and registers again with
    whatever router answers at the same address within `reconnect_s`, else raises
    KvfenceError (the process exits non-zero and its launcher reports it). A router
    that does not know this worker (it restarted, or declared it dead) asks it to
    register again; the worker does the same.
    """
    from kvfence.disagg.router import REREGISTER

    stop = stop or threading.Event()
    worker.attach(channel.send)
    set_waker, wake = getattr(worker, "set_waker", None), getattr(channel, "wake", None)
    if set_waker is not None and wake is not None:
        set_waker(wake)  # transport threads end the loop's wait when a transfer moves on
    parent = os.getppid()
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
                    orders += isinstance(msg, (P.PrefillOrder, P.DecodePrepare))
                msg = channel.recv(timeout=0.0)
            if router_timeout_s is not None and not lost and time.monotonic() - heard > router_timeout_s:
                lost = f"no message from the router for {router_timeout_s:.0f}s"
            if lost:
                if router_timeout_s is None:
                    raise KvfenceError(f"{worker.role}: the router no longer knows this worker ({lost})")
                dropped = drop_requests(worker, f"router lost: {lost}")
                logger.error("%s: %s; dropped %d request(s), registering again", worker.role, lost, dropped)
                try:
                    register(worker, channel, timeout=reconnect_s)
                except KvfenceError as e:
                    raise KvfenceError(f"{worker.role}: router lost ({lost}) and none answered: {e}") from None
                logger.info("%s: registered again", worker.role)
                heard, orders, last_stats = time.monotonic(), 0, 0.0
            worker.step()
            now = time.monotonic()
            if now - last_stats >= stats_interval_s:
                last_stats = now
                channel.send(P.WorkerStats(worker.role, {**worker.stats(), "orders_seen": orders}))
                if orphan_check and os.getppid() != parent:
                    logger.error("%s: parent process %d is gone; exiting", worker.role, parent)
                    return
    finally:
        worker.close()


def held_request_ids(worker: Any) -> list[str]:
    """Every request a prefill or decode worker holds (queued, running, handing off)."""
    rids: list[str] = []
    for name in ("orders", "handoffs", "incoming", "running"):
        rids += list(getattr(worker, name, {}))
    rids += [inc.prepare.request_id for inc in getattr(worker, "queued", ())]
    return list(dict.fromkeys(rids))


def drop_requests(worker: Any, reason: str) -> int:
    """Abort every request the worker holds, as the router's Abort would (pages freed or quarantined)."""
    rids = held_request_ids(worker)
    for rid in rids:
        worker.handle(P.Abort(rid, reason))
    return len(rids)


# -- flags ----------------------------------------------------------------------------------------------


def add_disagg_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the disaggregated roles, on top of `kvfence serve`'s server and engine flags."""
    g = p.add_argument_group("disaggregated serving (--role prefill|decode|router, or --disagg for a whole deployment)")
    g.add_argument(
        "--disagg",
        action="store_true",
        help="start a router and --prefill-workers / --decode-workers workers (one process each, free loopback "
        "ports); role-specific pool sizes: --prefill-max-total-tokens / --decode-max-total-tokens",
    )
    g.add_argument("--router-address", default=None, metavar="URL", help="workers: the router's tcp://host:port")
    g.add_argument("--control-port", type=int, default=None, metavar="N", help="router: control-plane port")
    g.add_argument("--worker-id", default=None, help="workers: name to register with (default: role + random)")
    g.add_argument("--handoff-host", default="127.0.0.1", help="decode: data-plane listen host")
    g.add_argument("--handoff-port", type=int, default=None, metavar="N", help="decode: data-plane listen port")
    g.add_argument(
        "--transfer-backend",
        "--transport",
        dest="transport",
        default="tcp",
        choices=["tcp", "mooncake"],
        help="KV data plane: kvfence's own TCP transport, or the Mooncake Transfer Engine (TCP protocol, P2P "
        "handshake; needs mooncake-transfer-engine-non-cuda) with control frames over TCP (default: tcp)",
    )
    g.add_argument("--handoff-deadline-s", type=float, default=60.0, help="seconds a KV handoff may take (default 60)")
    g.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="router: fail a request silent this long (default 300)"
    )
    g.add_argument(
        "--kv-io-timeout-s",
        type=float,
        default=10.0,
        help="KV data connections: drop one that moves no byte this long in the middle of a frame (default 10)",
    )
    g.add_argument("--strict-kv", action="store_true", help="poison KV pages when they are quarantined or freed")
    g.add_argument(
        "--no-verify",
        action="store_true",
        help="decode: admit handoffs WITHOUT verifying them -- only to demonstrate what the checks protect against",
    )
    g.add_argument(
        "--inject-fault",
        default=None,
        metavar="SPEC",
        help="tests/demos: NAME[@PATTERN][#PAGE][%%N],... -- PATTERN a glob over request ids (clients set them "
        "with X-Request-Id), %%N every Nth matching request (kvfence.faults)",
    )
    g.add_argument("--prefill-max-total-tokens", type=int, default=None, metavar="N", help="--disagg: prefill pool")
    g.add_argument("--decode-max-total-tokens", type=int, default=None, metavar="N", help="--disagg: decode pool")
    g.add_argument(
        "--prefill-workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="--disagg: start N prefill worker processes (each its own pool); router: wait for N at start (default 1)",
    )
    g.add_argument(
        "--decode-workers",
        type=_positive_int,
        default=1,
        metavar="M",
        help="--disagg: start M decode worker processes (each its own pool and data-plane port); router: wait for M "
        "at start (default 1)",
    )
    g.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process goes away")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads of this process (default: $OMP_NUM_THREADS if set, else router 1 and each "
        "worker (cores - 1) // 2, at least 1, so the three processes do not oversubscribe the cores)",
    )
    g.add_argument(
        "--worker-timeout-s",
        type=float,
        default=10.0,
        help="router: declare a worker dead after this long without a message from it (default 10)",
    )
    g.add_argument(
        "--router-timeout-s",
        type=float,
        default=10.0,
        help="workers: after this long without a message from the router, drop all requests and register again "
        "(default 10)",
    )
    g.add_argument(
        "--reconnect-timeout-s",
        type=float,
        default=60.0,
        help="workers: how long to try registering with a new router before exiting with code 2 (default 60)",
    )
    g.add_argument(
        "--max-router-restarts",
        type=int,
        default=3,
        help="--disagg: restart a router that exits this many times (the workers register again; default 3)",
    )
    g.add_argument(
        "--max-worker-restarts",
        type=int,
        default=3,
        help="--disagg: restart each worker that dies (killed, crashed) this many times; a worker that exits with "
        "code 2 (refused by the router, bad flags) stops the deployment (default 3)",
    )
    g.add_argument(
        "--throttle-kv-send",
        default=None,
        metavar="SECONDS[@PREFIX]",
        help="tests/demos, prefill over tcp: send KV one page per frame and sleep SECONDS before each page frame "
        "(only for request ids starting with PREFIX)",
    )


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from kvfence.commands.serve import add_server_arguments
    from kvfence.config import add_engine_arguments

    p = argparse.ArgumentParser(prog="python -m kvfence.disagg.worker_main", description=__doc__.split("\n")[0])
    add_server_arguments(p)
    add_engine_arguments(p)
    add_disagg_arguments(p)
    return p


def parse_faults(value: str | None) -> Any:
    """`--inject-fault NAME[@PATTERN][#PAGE][%N],...` -> a FaultInjector (None when absent); see kvfence.faults."""
    from kvfence.faults import FaultInjector

    try:
        return FaultInjector.from_flag(value)
    except ValueError as e:
        raise KvfenceError(f"--inject-fault: {e}") from None


# -- building workers -------------------------------------------------------------------------------------


class WorkerIdentity:
    """What a worker says about itself at registration, besides its engine's numbers.

    `context_length`: the deployment's context length when it exceeds what the engine runs with (the
    engine is capped at its pool under --allow-context-above-pool); None: the engine's own."""

    __slots__ = ("worker_id", "model_name", "model_fingerprint", "settings", "context_length")

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


def registration_for(role: str, engine: Any, identity: WorkerIdentity, handoff_address: str = "") -> P.Register:
    """The Register message of a worker built around `engine` (an LLMEngine)."""
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
        settings={**identity.settings, "num_pages": r.num_pages, "bytes_per_page": r.bytes_per_page},
        vocab_size=int(engine.vocab_size),
    )


def build_worker(args: argparse.Namespace, model_dir: str) -> Worker:
    """The prefill or decode worker the flags describe (engine with its own pool, transport, faults)."""
    from kvfence.commands.serve import build_role_engine
    from kvfence.disagg.decode import DecodeConfig, DecodeWorker
    from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
    from kvfence.transfer.base import TransferConfig

    engine, context_length, _ = build_role_engine(args, model_dir, args.role)
    faults = parse_faults(args.inject_fault)
    identity = WorkerIdentity(
        worker_id=args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}",
        model_name=args.served_model_name or Path(model_dir).name,
        model_fingerprint=model_fingerprint(model_dir),
        settings={
            "model_dir": model_dir,
            "transport": args.transport,
            "verify": not args.no_verify,
            "allow_context_above_pool": bool(args.allow_context_above_pool),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        },
        context_length=context_length,
    )
    if args.role == "prefill":
        config = PrefillConfig(
            transport=args.transport,
            deadline_s=args.handoff_deadline_s,
            strict=args.strict_kv,
            transfer=TransferConfig(io_timeout_s=args.kv_io_timeout_s),
        )
        if args.throttle_kv_send:
            if args.transport != "tcp":
                raise KvfenceError("--throttle-kv-send works with --transfer-backend tcp only")
            return PrefillWorker(engine, identity, config, faults=faults, sender=throttled_sender(engine.pool, args))
        return PrefillWorker(engine, identity, config, faults=faults)
    if args.handoff_port is None:
        raise KvfenceError("decode: --handoff-port is required (the launcher picks a free one and passes it)")
    if args.no_verify:
        logger.warning("decode: --no-verify: KV handoffs are admitted WITHOUT verification (demonstration only)")
    return DecodeWorker(
        engine,
        identity,
        DecodeConfig(
            transport=args.transport,
            listen_host=args.handoff_host,
            listen_port=args.handoff_port,
            deadline_s=args.handoff_deadline_s,
            verify=not args.no_verify,
            strict=args.strict_kv,
            io_timeout_s=args.kv_io_timeout_s,
        ),
        faults=faults,
    )


def throttled_sender(pool: Any, args: argparse.Namespace) -> Any:
    """A TCP sender that sends one page per frame and sleeps before each page frame (`--throttle-kv-send`)."""
    from kvfence.transfer.base import TransferConfig
    from kvfence.transfer.tcp import TcpSender

    delay_text, _, prefix = args.throttle_kv_send.partition("@")
    delay_s = float(delay_text)
    if delay_s < 0:
        raise KvfenceError("--throttle-kv-send: SECONDS must be >= 0")

    class SlowTcpSender(TcpSender):
        def _connect(self, address: str) -> Any:
            conn = super()._connect(address)
            if not getattr(conn, "throttled", False):
                plain = conn.send

                def send(header: dict[str, Any], payload: Any = ()) -> None:
                    if header.get("t") == "pages" and str(header.get("rid", "")).startswith(prefix):
                        time.sleep(delay_s)
                    plain(header, payload)

                conn.send, conn.throttled = send, True  # type: ignore[method-assign]
            return conn

    config = TransferConfig(max_transfer_pages=1, io_timeout_s=args.kv_io_timeout_s)
    return SlowTcpSender(pool, config, parse_faults(args.inject_fault))


# -- roles (each a function(args) -> exit code, also registered with `kvfence serve`) --------------------


def torch_threads_for(role: str, num_cpus: int, num_workers: int = 2) -> int:
    """Default intra-op threads per role: the processes of one deployment share the machine's cores.

    Two workers with torch's default (one thread per core) each spin OpenMP threads
    over the same cores; on 2 cores that made a decode step ~10x slower than with one
    thread. The router does no tensor work; each of the `num_workers` workers gets an
    equal share of what is left.
    """
    return 1 if role == "router" else max(1, (num_cpus - 1) // max(1, num_workers))


def set_torch_threads(role: str, requested: int | None) -> None:
    """Apply --torch-threads, or the per-role default unless $OMP_NUM_THREADS already chose."""
    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    n = requested if requested is not None else torch_threads_for(role, len(os.sched_getaffinity(0)))
    if n < 1:
        raise KvfenceError(f"--torch-threads must be at least 1, got {n}")
    torch.set_num_threads(n)
    logger.info("%s: %d torch thread(s)", role, n)


def _exit_with_parent() -> None:
    """Watch our parent; when it is gone (the launcher was killed), stop this process like Ctrl-C would."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        logger.error("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvfence-parent-watch", daemon=True).start()


def run_router(args: argparse.Namespace) -> int:
    from kvfence.config import resolve_model_dir
    from kvfence.disagg.router import Router, RouterConfig
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import run_server

    if args.control_port is None:
        raise KvfenceError("router: --control-port is required (the port workers register on)")
    if args.exit_with_parent:
        _exit_with_parent()
    set_torch_threads("router", args.torch_threads)
    model_dir = resolve_model_dir(args.model)
    hub = P.ZmqHub(args.host, args.control_port)
    router = Router(
        hub,
        RouterConfig(
            handoff_deadline_s=args.handoff_deadline_s,
            request_timeout_s=args.request_timeout_s,
            allow_context_above_pool=args.allow_context_above_pool,
            model_name=args.served_model_name,
            worker_timeout_s=args.worker_timeout_s,
            wait_prefill_workers=args.prefill_workers,
            wait_decode_workers=args.decode_workers,
        ),
    )
    try:
        router.wait_for_workers()
        router.start()
        tokenizer = Tokenizer.from_dir(Path(model_dir))
        settings = ApiSettings(
            served_model_name=router.model_name,
            max_body_bytes=args.max_body_bytes,
            vocab_size=router.vocab_size,
            server_args=router.server_info(),
            logprobs_mode=args.logprobs_mode,
        )
        run_server(build_app(router, tokenizer, settings), args.host, args.port, args.log_level)
    finally:
        router.close()
    return 0


def run_worker_role(args: argparse.Namespace) -> int:
    from kvfence.config import resolve_model_dir

    if not args.router_address:
        raise KvfenceError(f"{args.role}: --router-address is required (the router's tcp://host:port)")
    set_torch_threads(args.role, args.torch_threads)
    worker = build_worker(args, resolve_model_dir(args.model))
    channel = P.ZmqChannel(args.router_address, worker.registration().worker_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        register(worker, channel)
        logger.info("%s: registered with %s", args.role, args.router_address)
        run_worker(
            worker,
            channel,
            stop=stop,
            orphan_check=args.exit_with_parent,
            router_timeout_s=args.router_timeout_s,
            reconnect_s=args.reconnect_timeout_s,
        )
    finally:
        channel.close()
    logger.info("%s: stopped", args.role)
    return 0


def launch_command_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(common, prefill, decode) flags for the three processes of `--disagg`, from this process's flags."""
    common: list[str] = []
    for flag, value in (
        ("--model", args.model),
        ("--served-model-name", args.served_model_name),
        ("--dtype", args.dtype),
        ("--device", args.device),
        ("--page-size", args.page_size),
        ("--context-length", args.context_length),
        ("--chunked-prefill-size", args.chunked_prefill_size),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--seed", args.seed),
        ("--logprobs-mode", args.logprobs_mode),
        ("--log-level", args.log_level),
        ("--handoff-deadline-s", args.handoff_deadline_s),
        ("--request-timeout-s", args.request_timeout_s),
        ("--max-body-bytes", args.max_body_bytes),
        ("--inject-fault", args.inject_fault),
        ("--transfer-backend", args.transport),
        ("--worker-timeout-s", args.worker_timeout_s),
        ("--router-timeout-s", args.router_timeout_s),
        ("--reconnect-timeout-s", args.reconnect_timeout_s),
        ("--torch-threads", args.torch_threads),
        ("--kv-io-timeout-s", args.kv_io_timeout_s),
    ):
        if value is not None:
            common += [flag, str(value)]
    for flag, on in (("--allow-context-above-pool", args.allow_context_above_pool), ("--strict-kv", args.strict_kv)):
        if on:
            common.append(flag)
    prefill, decode = [], []
    if (n := args.prefill_max_total_tokens or args.max_total_tokens) is not None:
        prefill += ["--max-total-tokens", str(n)]
    if (n := args.decode_max_total_tokens or args.max_total_tokens) is not None:
        decode += ["--max-total-tokens", str(n)]
    if args.no_verify:
        decode.append("--no-verify")
    if args.throttle_kv_send:
        prefill += ["--throttle-kv-send", args.throttle_kv_send]
    return tuple(common), tuple(prefill), tuple(decode)


def run_launch(args: argparse.Namespace) -> int:
    """`--disagg`: a router and N prefill + M decode workers as child processes; the router's HTTP port is --port."""
    from kvfence.config import resolve_model_dir
    from kvfence.disagg.launcher import LaunchConfig, launch

    if args.model is None:  # build the default model once here, not three times in parallel
        args.model = resolve_model_dir(None, lambda m: print(f"kvfence: {m}", file=sys.stderr))
    common, prefill, decode = launch_command_args(args)
    workers = args.prefill_workers + args.decode_workers
    if args.torch_threads is None and not os.environ.get("OMP_NUM_THREADS"):  # share the cores among all workers
        threads = ("--torch-threads", str(torch_threads_for("prefill", len(os.sched_getaffinity(0)), workers)))
        prefill, decode = (*prefill, *threads), (*decode, *threads)
    return launch(
        LaunchConfig(
            host=args.host,
            http_port=args.port,
            num_prefill=args.prefill_workers,
            num_decode=args.decode_workers,
            common_args=common,
            prefill_args=prefill,
            decode_args=decode,
            router_args=("--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers)),
            max_router_restarts=args.max_router_restarts,
            max_worker_restarts=args.max_worker_restarts,
        )
    )


ROLE_RUNNERS = {"prefill": run_worker_role, "decode": run_worker_role, "router": run_router}


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.disagg and args.role not in ROLE_RUNNERS:
        p.error(f"--role must be one of {', '.join(ROLE_RUNNERS)} (or pass --disagg to start all three)")
    role = "launcher" if args.disagg else args.role
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[%(asctime)s {role}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return run_launch(args) if args.disagg else ROLE_RUNNERS[args.role](args)
    except KvfenceError as e:
        print(f"kvfence {role}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    # Everything is closed by now; skip the interpreter's slow teardown of torch (seconds per process).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
