"""Process entry points of disaggregated serving: `python -m kvfence.disagg.worker_main --role ...`.

What it knows: the command-line flags of each role, how to build a worker's engine
from them (each role has its own KV pool, sized by its own `--max-total-tokens`),
the model fingerprint both workers register (a hash of config.json and of the weight
files' bytes, so two different checkpoints of one architecture never pair), and the
worker loop shared by prefill and decode: register, then alternate between the
control channel and one engine step, publishing stats every few hundred ms, until
told to shut down, signalled, or orphaned.

What it does not know: what prefill or decode do with a message (their own modules),
or HTTP (the router role hands its `Router` to the API helper's `build_app`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
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
    worker.attach(channel.send)
    channel.send(worker.registration())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = channel.recv(timeout=0.5)
        if msg is None:
            continue
        if isinstance(msg, P.RegisterReply):
            if not msg.accepted:
                raise CapacityConfigError(f"router refused this {worker.role} worker: {msg.reason}")
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
) -> None:
    """Serve control messages and engine steps until Shutdown, `stop`, or (orphan_check) our parent dies."""
    stop = stop or threading.Event()
    worker.attach(channel.send)
    parent = os.getppid()
    last_stats = 0.0
    try:
        while not stop.is_set():
            msg = channel.recv(timeout=0.0 if worker.busy else idle_wait_s)
            while msg is not None:
                if isinstance(msg, P.Shutdown):
                    return
                worker.handle(msg)
                msg = channel.recv(timeout=0.0)
            worker.step()
            now = time.monotonic()
            if now - last_stats >= stats_interval_s:
                last_stats = now
                channel.send(P.WorkerStats(worker.role, worker.stats()))
                if orphan_check and os.getppid() != parent:
                    logger.error("%s: parent process %d is gone; exiting", worker.role, parent)
                    return
    finally:
        worker.close()


# -- building workers -------------------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="this role's KV pool size in tokens")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--router-address", default=None, help="workers: the router's control address, tcp://host:port")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--handoff-host", default="127.0.0.1", help="decode: data-plane listen host")
    p.add_argument("--handoff-port", type=int, default=None, help="decode: data-plane listen port (required)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "mooncake"])
    p.add_argument("--handoff-deadline-s", type=float, default=60.0, help="seconds a KV handoff may take")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="router: fail a request silent this long")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="decode: admit handoffs WITHOUT verification (demonstration of what the checks protect; never serve)",
    )
    p.add_argument(
        "--inject-fault", default=None, help="tests and demos only: name[@request_id][#page],... (see kvfence.faults)"
    )
    p.add_argument("--host", default="127.0.0.1", help="router: HTTP host")
    p.add_argument("--port", type=int, default=None, help="router: HTTP port (required)")
    p.add_argument("--control-port", type=int, default=None, help="router: control-plane port (required)")
    p.add_argument("--allow-context-above-pool", action="store_true")
    p.add_argument("--log-level", default="INFO")


def engine_config_from_args(args: argparse.Namespace, model_dir: str) -> Any:
    from kvfence.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(model_dir=model_dir, dtype=args.dtype),
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
        ),
        context_length=args.context_length,
        seed=args.seed,
    )


def resolve_model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from kvfence.models.default import ensure_default_model

    return str(ensure_default_model())


def build_worker(args: argparse.Namespace, model_dir: str) -> Worker:
    """The prefill or decode worker the flags describe (engine, transport, faults)."""
    from kvfence.disagg.decode import DecodeConfig, DecodeWorker
    from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
    from kvfence.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args, model_dir))
    faults = parse_faults(args.inject_fault)
    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    identity = WorkerIdentity(
        worker_id=worker_id,
        model_name=args.served_model_name or Path(model_dir).name,
        model_fingerprint=model_fingerprint(model_dir),
        settings={"model_dir": model_dir, "transport": args.transport, "dtype": args.dtype},
    )
    if args.role == "prefill":
        return PrefillWorker(
            engine,
            identity,
            PrefillConfig(transport=args.transport, deadline_s=args.handoff_deadline_s),
            faults=faults,
        )
    if args.handoff_port is None:
        raise KvfenceError("decode: --handoff-port is required (the launcher picks a free one)")
    return DecodeWorker(
        engine,
        identity,
        DecodeConfig(
            transport=args.transport,
            listen_host=args.handoff_host,
            listen_port=args.handoff_port,
            deadline_s=args.handoff_deadline_s,
            verify=not args.no_verify,
        ),
        faults=faults,
    )


def parse_faults(value: str | None) -> Any:
    """`--inject-fault name[@request_id][#page],...` -> a FaultInjector (None when absent)."""
    from kvfence.faults import FaultInjector

    if not value:
        return None
    injector = FaultInjector()
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        page = 0
        if "#" in item:
            item, page_text = item.split("#", 1)
            page = int(page_text)
        name, _, rid = item.partition("@")
        try:
            injector.enable(name, request_id=rid or None, page=page)
        except ValueError as e:
            raise KvfenceError(f"--inject-fault: {e}") from None
    return injector


class WorkerIdentity:
    """What a worker says about itself at registration, besides its engine's numbers."""

    __slots__ = ("worker_id", "model_name", "model_fingerprint", "settings")

    def __init__(self, worker_id: str, model_name: str, model_fingerprint: str, settings: dict[str, Any]) -> None:
        self.worker_id = worker_id
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.settings = settings


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
        context_length=r.context_length,
        pool_tokens=r.pool_tokens,
        page_size=r.page_size,
        dtype=dtype_name(layout.dtype),
        layout_fingerprint=layout.fingerprint,
        layout=layout.describe(),
        handoff_address=handoff_address,
        settings={**identity.settings, "num_pages": r.num_pages, "bytes_per_page": r.bytes_per_page},
    )


# -- roles ------------------------------------------------------------------------------------------------


def _run_router(args: argparse.Namespace, model_dir: str) -> int:
    from kvfence.disagg.router import Router, RouterConfig
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import run_server

    if args.port is None or args.control_port is None:
        raise KvfenceError("router: --port and --control-port are required (the launcher picks free ones)")
    hub = P.ZmqHub(args.host, args.control_port)
    router = Router(
        hub,
        RouterConfig(
            handoff_deadline_s=args.handoff_deadline_s,
            request_timeout_s=args.request_timeout_s,
            allow_context_above_pool=args.allow_context_above_pool,
            model_name=args.served_model_name,
        ),
    )
    try:
        router.wait_for_workers()
        router.start()
        tokenizer = Tokenizer.from_dir(Path(model_dir))
        settings = ApiSettings(served_model_name=router.model_name, server_args=router.server_info())
        app = build_app(router, tokenizer, settings)
        run_server(app, args.host, args.port, log_level="warning")
    finally:
        router.close()
    return 0


def _run_worker_process(args: argparse.Namespace, model_dir: str) -> int:
    if not args.router_address:
        raise KvfenceError(f"{args.role}: --router-address is required")
    worker = build_worker(args, model_dir)
    channel = P.ZmqChannel(args.router_address, worker.registration().worker_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        register(worker, channel)
        logger.info("%s: registered with %s", args.role, args.router_address)
        run_worker(worker, channel, stop=stop, orphan_check=True)
    finally:
        channel.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfence.disagg.worker_main", description=__doc__.split("\n")[0])
    add_disagg_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"[%(asctime)s {args.role}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        model_dir = resolve_model_dir(args)
        if args.role == "router":
            return _run_router(args, model_dir)
        return _run_worker_process(args, model_dir)
    except KvfenceError as e:
        print(f"kvfence {args.role}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
