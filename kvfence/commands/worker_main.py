"""Process entry points of disaggregated serving: `python -m kvfence.commands.worker_main --role ...`.

What it knows: how to turn the parsed flags (defined in `kvfence.commands.args` and
`kvfence.config`) into a running role: a prefill or decode worker (its engine with its
own KV pool, sized by its own `--max-total-tokens`; its transport and faults; then the
worker loop of `kvfence.disagg.worker`), the router (a `Router` behind the API's
`build_app`), or `--disagg`, a whole deployment of child processes (`kvfence.disagg.launcher`);
torch threads per role; and the exit code 2 on a configuration error.

What it does not know: the worker loop or registration (`kvfence.disagg.worker`), what
prefill or decode do with a message (their own modules), or HTTP.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfence.auth.keys import ENV_KEY, ENV_KEY_FILE, INSECURE_WARNING, ClusterKey, load_cluster_key
from kvfence.errors import KvfenceError
from kvfence.roles import DECODE, PREFILL, ROUTER

if TYPE_CHECKING:  # each role imports what it runs: the launcher (`--disagg`) stays a small process
    from kvfence.auth.plane import PlaneAuth
    from kvfence.disagg.worker import Worker

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from kvfence.commands.args import add_disagg_arguments, add_server_arguments
    from kvfence.config import add_engine_arguments

    p = argparse.ArgumentParser(prog="python -m kvfence.commands.worker_main", description=__doc__.split("\n")[0])
    add_server_arguments(p)
    add_engine_arguments(p)
    add_disagg_arguments(p)
    return p


def cluster_key(args: argparse.Namespace, role: str) -> ClusterKey:
    """The deployment secret this process runs with (`kvfence.auth.keys.load_cluster_key`); the environment copy
    `kvfence serve` handed us is removed, so nothing this process starts inherits it."""
    key = load_cluster_key(args.cluster_key_file, args.insecure_no_auth)
    os.environ.pop(ENV_KEY, None)
    if key.secure:
        logger.info("%s: authenticated planes, cluster key id %s", role, key.key_id)
    else:
        logger.warning("%s: %s", role, INSECURE_WARNING)
    return key


def cluster_auth(key: ClusterKey) -> str:
    """What a start-up line says of the internal planes' authentication."""
    return f"cluster auth on (key id {key.key_id})" if key.secure else "cluster auth OFF (--insecure-no-auth)"


def parse_faults(value: str | None) -> Any:
    """`--inject-fault NAME[@PATTERN][#PAGE][%N],...` -> a FaultInjector (None when absent); see kvfence.faults."""
    from kvfence.faults import FaultInjector

    try:
        return FaultInjector.from_flag(value)
    except ValueError as e:
        raise KvfenceError(f"--inject-fault: {e}") from None


# -- building workers -------------------------------------------------------------------------------------


def build_worker(args: argparse.Namespace, model_dir: str, key: ClusterKey) -> Worker:
    """The prefill or decode worker the flags describe (engine with its own pool, transport, faults, keys)."""
    from kvfence.auth.events import SecurityEvents
    from kvfence.auth.plane import PlaneAuth
    from kvfence.commands.args import grammar_budget
    from kvfence.disagg.decode import DecodeConfig, DecodeWorker
    from kvfence.disagg.prefill import PrefillConfig, PrefillWorker
    from kvfence.disagg.worker import WorkerIdentity, model_fingerprint
    from kvfence.server.role_engine import build_role_engine
    from kvfence.transfer.base import TransferConfig

    engine, context_length, _ = build_role_engine(args, model_dir, args.role)
    faults = parse_faults(args.inject_fault)
    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    auth = PlaneAuth(key, SecurityEvents(worker_id))
    identity = WorkerIdentity(
        worker_id=worker_id,
        model_name=args.served_model_name or Path(model_dir).name,
        model_fingerprint=model_fingerprint(model_dir),
        settings={
            "model_dir": model_dir,
            "transport": args.transport,
            "kernels": engine.resolved.kernels,
            "verify": not args.no_verify,
            "allow_context_above_pool": bool(args.allow_context_above_pool),
            "auth": key.describe(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        },
        context_length=context_length,
    )
    if args.role == PREFILL:
        config = PrefillConfig(
            transport=args.transport,
            deadline_s=args.handoff_deadline_s,
            strict=args.strict_kv,
            transfer=TransferConfig(io_timeout_s=args.kv_io_timeout_s),
            grammar_budget=grammar_budget(args),
        )
        if args.throttle_kv_send:
            if args.transport != "tcp":
                raise KvfenceError("--throttle-kv-send works with --transfer-backend tcp only")
            sender = throttled_sender(engine.pool, args, auth)
            return PrefillWorker(engine, identity, config, faults=faults, sender=sender, auth=auth)
        return PrefillWorker(engine, identity, config, faults=faults, auth=auth)
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
            grammar_budget=grammar_budget(args),
        ),
        faults=faults,
        auth=auth,
    )


def throttled_sender(pool: Any, args: argparse.Namespace, auth: PlaneAuth) -> Any:
    """A TCP sender that sends one page per frame and sleeps before each page frame (`--throttle-kv-send`)."""
    from kvfence.transfer.base import TransferConfig
    from kvfence.transfer.frames import Frame, Pages
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

                def send(frame: Frame, payload: Any = ()) -> None:
                    if isinstance(frame, Pages) and frame.rid.startswith(prefix):
                        time.sleep(delay_s)
                    plain(frame, payload)

                conn.send, conn.throttled = send, True  # type: ignore[method-assign,attr-defined]
            return conn

    config = TransferConfig(max_transfer_pages=1, io_timeout_s=args.kv_io_timeout_s)
    return SlowTcpSender(pool, config, parse_faults(args.inject_fault), auth=auth)


# -- roles (each a function(args) -> exit code, also registered with `kvfence serve`) --------------------


def torch_threads_for(role: str, num_cpus: int, num_workers: int = 2) -> int:
    """Default intra-op threads per role: the processes of one deployment share the machine's cores.

    Two workers with torch's default (one thread per core) each spin OpenMP threads
    over the same cores; on 2 cores that made a decode step ~10x slower than with one
    thread. The router does no tensor work; each of the `num_workers` workers gets an
    equal share of what is left.
    """
    return 1 if role == ROUTER else max(1, (num_cpus - 1) // max(1, num_workers))


def set_torch_threads(role: str, requested: int | None) -> None:
    """Apply --torch-threads, or the per-role default unless $OMP_NUM_THREADS already chose."""
    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        return
    n = requested if requested is not None else torch_threads_for(role, len(os.sched_getaffinity(0)))
    if n < 1:
        raise KvfenceError(f"--torch-threads must be at least 1, got {n}")
    if role == ROUTER and "torch" not in sys.modules:
        # The router does no tensor work and does not load torch (about 200 MiB); should a grammar compile load it
        # later (xgrammar imports it), torch reads its thread count from here.
        os.environ["OMP_NUM_THREADS"] = str(n)
        logger.info("%s: %d torch thread(s) (torch not loaded)", role, n)
        return
    import torch

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
    from kvfence.auth.curve import for_key as curve_keys
    from kvfence.auth.events import SecurityEvents
    from kvfence.auth.keys import api_key_from
    from kvfence.commands.args import flag_values, grammar_budget
    from kvfence.config import resolve_model_dir
    from kvfence.disagg import messages as P
    from kvfence.disagg.router import Router, RouterConfig
    from kvfence.models.heap import release_freed_heap
    from kvfence.models.startup_pages import release_startup_pages
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import check_free, listen, run_server
    from kvfence.server.role_engine import load_tokenizer
    from kvfence.server.startup import startup_line
    from kvfence.server.tool_parsers import resolve_parser

    if args.control_port is None:
        raise KvfenceError("router: --control-port is required (the port workers register on)")
    if args.exit_with_parent:
        _exit_with_parent()
    key = cluster_key(args, ROUTER)
    sock = listen(args.host, args.port)  # both ports are checked before the router waits for anyone
    check_free(args.host, args.control_port, "--control-port")
    set_torch_threads(ROUTER, args.torch_threads)
    model_dir = resolve_model_dir(args.model)
    hub = P.ZmqHub(args.host, args.control_port, curve=curve_keys(key), events=SecurityEvents(ROUTER))
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
            first_token_before_verdict=not args.first_token_after_verify,
            prefix_affinity=not args.no_prefix_affinity,
        ),
        auth=key.describe(),
    )
    try:
        router.wait_for_workers()
        router.start()
        tokenizer = load_tokenizer(args, model_dir)
        release_freed_heap()  # what parsing tokenizer.json and the imports freed (~8 MiB)
        release_startup_pages()  # the libraries' code that ran once while starting (models.startup_pages)
        settings = ApiSettings(
            served_model_name=router.model_name,
            max_body_bytes=args.max_body_bytes,
            vocab_size=router.vocab_size,
            server_args=flag_values(args),  # the live workers are in /server_info's `engine`, not a snapshot
            logprobs_mode=args.logprobs_mode,
            tool_call_parser=resolve_parser(args.tool_call_parser, tokenizer.chat_template),
            grammar_budget=grammar_budget(args),
            api_key=api_key_from(args.api_key),
        )
        ports = {"control": f"tcp://{args.host}:{args.control_port}"}
        run_server(
            build_app(router, tokenizer, settings),
            args.host,
            args.port,
            args.log_level,
            sock=sock,
            banner=lambda url: startup_line(
                ROUTER,
                router.server_info(),
                {**ports, "serving": url},
                settings.api_key is not None,
                cluster_auth(key),
            ),  # fmt: skip
        )
    finally:
        router.close()
    return 0


def run_worker_role(args: argparse.Namespace) -> int:
    from kvfence.auth.curve import for_key as curve_keys
    from kvfence.config import resolve_model_dir
    from kvfence.disagg import messages as P
    from kvfence.disagg.worker import register, run_worker

    if not args.router_address:
        raise KvfenceError(f"{args.role}: --router-address is required (the router's tcp://host:port)")
    from kvfence.server.startup import engine_info, loading_line, startup_line

    key = cluster_key(args, args.role)
    if args.role == DECODE and args.handoff_port:
        from kvfence.server.launch import check_free

        check_free(args.handoff_host, args.handoff_port, "--handoff-port")  # before the model loads
    set_torch_threads(args.role, args.torch_threads)
    model_dir = resolve_model_dir(args.model)
    print(loading_line(args.role, model_dir), file=sys.stderr, flush=True)
    worker = build_worker(args, model_dir, key)
    identity = worker.identity
    ports = {"router": args.router_address}
    if args.role == DECODE:
        ports["kv data"] = f"{args.handoff_host}:{args.handoff_port}"
    context = identity.context_length or worker.engine.resolved.context_length  # None: the engine's own
    info = engine_info(worker.engine, identity.model_name, context)
    print(startup_line(args.role, info, ports, None, cluster_auth(key)), file=sys.stderr, flush=True)
    cores = None
    if args.core_board is not None:
        from kvfence.disagg.core_board import CoreBoard

        if args.core_board_slot is None:
            raise KvfenceError(f"{args.role}: --core-board needs --core-board-slot")
        import torch

        # Prefill borrows idle cores: its forward over a prompt is long, matrix-bound and scales with threads.
        # Decode only publishes that it has work: its short steps gained nothing measurable from a second
        # thread and kept prefill off the core it borrowed (docs/benchmarks.md, "Disaggregated serving").
        borrow = args.role == PREFILL
        cores = CoreBoard(args.core_board, args.core_board_slot, share=torch.get_num_threads(), borrow=borrow)
        logger.info("%s: slot %d of this host's core board (%d threads shared, borrowing: %s)", args.role, cores.slot,
                    cores.budget, borrow)  # fmt: skip
    stop = threading.Event()
    channel = P.ZmqChannel(args.router_address, worker.registration().worker_id, curve_keys(key), stop=stop)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if not register(worker, channel, stop=stop):
            logger.info("%s: stopped before a router at %s accepted it", args.role, args.router_address)
            return 0
        logger.info("%s: registered with %s", args.role, args.router_address)
        run_worker(
            worker,
            channel,
            stop=stop,
            orphan_check=args.exit_with_parent,
            router_timeout_s=args.router_timeout_s,
            reconnect_s=args.reconnect_timeout_s,
            cores=cores,
        )
    finally:
        channel.close()
        if cores is not None:
            cores.close()
    logger.info("%s: stopped", args.role)
    return 0


def launch_command_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(common, prefill, decode) flags for the three processes of `--disagg`, from this process's flags."""
    from kvfence.config import CacheConfig

    common: list[str] = []
    for flag, value in (
        ("--model", args.model),
        ("--served-model-name", args.served_model_name),
        ("--dtype", args.dtype),
        ("--device", args.device),
        ("--kernels", args.kernels),
        ("--page-size", args.page_size),
        ("--context-length", args.context_length),
        ("--chunked-prefill-size", args.chunked_prefill_size),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-decode-steps", args.max_decode_steps),
        ("--decode-steps-ms", args.decode_steps_ms),
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
        ("--tokenizer", args.tokenizer),
        ("--chat-template", args.chat_template),
        ("--tool-call-parser", args.tool_call_parser),
        ("--max-grammar-bytes", args.max_grammar_bytes),
        ("--grammar-compile-timeout-s", args.grammar_compile_timeout_s),
    ):
        if value is not None:
            common += [flag, str(value)]
    for flag, on in (
        ("--allow-context-above-pool", args.allow_context_above_pool),
        ("--strict-kv", args.strict_kv),
        ("--first-token-after-verify", args.first_token_after_verify),
        ("--no-prefix-affinity", args.no_prefix_affinity),
        ("--insecure-no-auth", args.insecure_no_auth),
    ):
        if on:
            common.append(flag)
    prefill, decode = [], []
    if (n := args.prefill_max_total_tokens or args.max_total_tokens) is not None:
        prefill += ["--max-total-tokens", str(n)]
    if (n := args.decode_max_total_tokens or args.max_total_tokens) is not None:
        decode += ["--max-total-tokens", str(n)]
    caching = getattr(args, "enable_prefix_caching", CacheConfig.enable_prefix_caching)
    # prefill only: a decode worker never builds a cache (server.role_engine), its prompts' KV arrives by handoff
    prefill.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    if args.no_verify:
        decode.append("--no-verify")
    if args.throttle_kv_send:
        prefill += ["--throttle-kv-send", args.throttle_kv_send]
    return tuple(common), tuple(prefill), tuple(decode)


def run_launch(args: argparse.Namespace) -> int:
    """`--disagg`: a router and N prefill + M decode workers as child processes; the router's HTTP port is --port."""
    from kvfence.config import resolve_model_dir
    from kvfence.disagg.core_board import default_budget
    from kvfence.disagg.launcher import LaunchConfig, launch

    if args.model is None:  # build the default model once here, not three times in parallel
        args.model = resolve_model_dir(None, lambda m: print(f"kvfence: {m}", file=sys.stderr))
    # The processes we start share one secret: the key given (file or environment), else a fresh one. It reaches
    # them through their environment, never their command lines.
    given = args.cluster_key_file or os.environ.get(ENV_KEY_FILE) or os.environ.get(ENV_KEY)
    key = load_cluster_key(args.cluster_key_file, args.insecure_no_auth) if given or args.insecure_no_auth else None
    key = key or ClusterKey.generate()
    if not key.secure:
        print(f"kvfence: {INSECURE_WARNING}", file=sys.stderr)
    from kvfence.server.launch import check_free

    check_free(args.host, args.port, "--port")  # before any process starts (the router would die on it)
    common, prefill, decode = launch_command_args(args)
    workers = args.prefill_workers + args.decode_workers
    core_budget = None
    if args.torch_threads is None and not os.environ.get("OMP_NUM_THREADS"):  # share the cores among all workers
        cpus = len(os.sched_getaffinity(0))
        share = torch_threads_for(PREFILL, cpus, workers)
        threads = ("--torch-threads", str(share))
        prefill, decode = (*prefill, *threads), (*decode, *threads)
        core_budget = default_budget(cpus, [share] * workers)  # and lend each other the cores they leave idle
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
            core_budget=core_budget,
        ),
        key,
    )


ROLE_RUNNERS = {PREFILL: run_worker_role, DECODE: run_worker_role, ROUTER: run_router}


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
