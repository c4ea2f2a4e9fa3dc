"""`kvfence serve`: the OpenAI-compatible HTTP server.

What it knows: the flags every role shares (server: --host, --port, --served-model-name,
--log-level, --allow-context-above-pool, --max-body-bytes, --seed, --logprobs-mode; engine: --model,
--page-size, --max-total-tokens, --context-length, --chunked-prefill-size,
--max-num-seqs, ... from kvfence.config), the start-up capacity check (a context
length the KV pool cannot hold refuses to start, naming both numbers and the flags,
unless --allow-context-above-pool turns the pool into a hard per-request limit), and
how to build and run the aggregated role (one process: engine thread + API).

Roles are looked up in `ROLE_RUNNERS` (role -> function(args) -> exit code); the
disaggregated roles (prefill, decode, router) come from `kvfence.disagg.worker_main`
with their own extra flags, and `--disagg` (or no --role) starts a router with
`--prefill-workers` N and `--decode-workers` M workers on loopback, restarting any that
dies. What it does not know: how those roles work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from kvfence.config import add_engine_arguments, engine_config_from_args, resolve_model_dir
from kvfence.errors import KvfenceError

ROLES = ("aggregated", "prefill", "decode", "router")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the HTTP front end and start-up checks, shared by every role."""
    g = p.add_argument_group("server")
    g.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="what this process serves; without --role, `kvfence serve` starts a router plus --prefill-workers "
        "prefill and --decode-workers decode workers (default one each) as child processes on loopback (same as "
        "--disagg)",
    )
    g.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    g.add_argument(
        "--port", type=int, default=8000, metavar="N", help="listen port; 0 picks a free one (default: 8000)"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name clients send (default: the model dir name)",
    )
    g.add_argument(
        "--allow-context-above-pool",
        action="store_true",
        help="start even if one full context does not fit in the KV pool; requests above the pool are refused (400)",
    )
    g.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N", help="largest request body (default: 4 MiB)"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the sampling of requests that give no seed of their own; without it that seed is random at "
        "every start, so unseeded outputs differ across restarts, as with vLLM and OpenAI",
    )
    g.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs"],
        help="what logprobs report, as vLLM's flag: the model's distribution (raw_logprobs, default) or the one the "
        "token was drawn from, after logit_bias, penalties, temperature and top-k/top-p (processed_logprobs)",
    )
    g.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS, help="default: info")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and /server_info. "
        "Without --model, the built-in tiny random model is used.",
        epilog="examples:\n"
        "  kvfence serve --port 8000   # router + prefill + decode on loopback\n"
        "  kvfence serve --port 8000 --prefill-workers 2 --decode-workers 2   # 2 x 2 worker processes\n"
        "  kvfence serve --role aggregated --port 8000 --max-total-tokens 32768 --context-length 2048",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_arguments(p)
    add_engine_arguments(p)
    from kvfence.disagg.worker_main import add_disagg_arguments

    add_disagg_arguments(p)
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"kvfence: {msg}", file=sys.stderr, flush=True)


def server_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as plain values, for /server_info."""
    return {k: v for k, v in vars(args).items() if k != "func" and isinstance(v, (str, int, float, bool, type(None)))}


class RoleEngine(NamedTuple):
    """A role's engine after the start-up capacity check, and the numbers the check found."""

    engine: Any  # kvfence.engine.llm_engine.LLMEngine
    context_length: int  # the deployment's context length (flag or model), which may exceed the pool
    pool_tokens: int


def build_role_engine(args: argparse.Namespace, model_dir: str, role: str) -> RoleEngine:
    """The engine of one role (aggregated, prefill or decode), with the same start-up rule for every role.

    A context length the role's KV pool cannot hold refuses to start, naming both numbers and the flags.
    With --allow-context-above-pool the role starts with a warning and its engine runs with the pool as
    its context length; the front end (the API, or the router in PD mode) refuses anything above the
    pool with HTTP 400 naming it, before any engine sees the request.
    """
    import torch

    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.models.loader import load_model
    from kvfence.server.admission import role_capacity

    config = engine_config_from_args(args, model_dir, seed=args.seed)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.model.dtype]
    loaded = load_model(model_dir, dtype=dtype, device=config.model.device, progress=sys.stderr.isatty())
    context_length = config.context_length or int(loaded.context_length)
    page_size = config.cache.page_size
    num_pages = config.cache.num_pages_for(context_length)
    pool_tokens = role_capacity(role, context_length, num_pages, page_size, args.allow_context_above_pool)
    config = dataclasses.replace(config, context_length=min(context_length, pool_tokens))
    return RoleEngine(LLMEngine(config, loaded=loaded), context_length, pool_tokens)


def build_aggregated(args: argparse.Namespace) -> tuple[Any, Any]:
    """(FastAPI app, AsyncLLMEngine not yet started) for --role aggregated, after the start-up checks."""
    from kvfence.engine.async_engine import ROLE, AsyncLLMEngine
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.engine_client import Capacity

    model_dir = resolve_model_dir(args.model, _log)
    engine, context_length, pool_tokens = build_role_engine(args, model_dir, ROLE)
    page_size = engine.resolved.page_size
    capacity = Capacity(context_length, {ROLE: pool_tokens}, page_size)
    name = args.served_model_name or Path(model_dir).name
    client = AsyncLLMEngine(
        engine, name, capacity, settings={"allow_context_above_pool": bool(args.allow_context_above_pool)}
    )
    settings = ApiSettings(
        served_model_name=name,
        max_body_bytes=args.max_body_bytes,
        vocab_size=engine.vocab_size or None,
        server_args=server_args(args),
        logprobs_mode=args.logprobs_mode,
    )
    return build_app(client, engine.tokenizer, settings), client


def run_aggregated(args: argparse.Namespace) -> int:
    from kvfence.server.launch import run_server

    app, client = build_aggregated(args)
    client.start()
    try:
        run_server(app, args.host, args.port, args.log_level)
    finally:
        client.shutdown()
    return 0


# role -> runner; the disaggregated roles add theirs here
ROLE_RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {"aggregated": run_aggregated}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if args.max_body_bytes <= 0:
        raise KvfenceError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    from kvfence.disagg.worker_main import ROLE_RUNNERS as DISAGG_RUNNERS
    from kvfence.disagg.worker_main import run_launch

    if getattr(args, "disagg", False) or args.role is None:
        return run_launch(args)
    runner = {**ROLE_RUNNERS, **DISAGG_RUNNERS}.get(args.role)
    if runner is None:
        raise KvfenceError(
            f"--role {args.role} is not available from `kvfence serve` yet; "
            "start the disaggregated deployment with `python -m kvfence.disagg.worker_main` (see its --help)"
        )
    return runner(args)
