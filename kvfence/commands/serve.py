"""`kvfence serve`: the OpenAI-compatible HTTP server.

What it knows: which flags `kvfence serve` takes (server and disaggregated ones from
`kvfence.commands.args`, engine ones from `kvfence.config`; the model may also be given as
the first positional argument, as with vLLM), and how to build and run the aggregated
role (one process: engine thread + API; its engine from `kvfence.server.role_engine`,
which refuses a context length the pool cannot hold), saying what it is loading before it
loads and, once its port is bound, one line with everything it chose. The API key
(`--api-key` or $KVFENCE_API_KEY) reaches the processes `kvfence serve` starts through
the environment, never their command lines.

Roles are looked up in `ROLE_RUNNERS` (role -> function(args) -> exit code); the
disaggregated roles (prefill, decode, router) come from `kvfence.commands.worker_main`,
and `--disagg` (or no --role) starts a router with `--prefill-workers` N and
`--decode-workers` M workers on loopback, restarting any that dies. What it does not
know: how those roles work.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfence.auth.keys import API_KEY_ENV, api_key_from
from kvfence.commands.args import add_disagg_arguments, add_server_arguments, flag_values, grammar_budget
from kvfence.config import add_engine_arguments, resolve_model_dir
from kvfence.errors import KvfenceError
from kvfence.roles import AGGREGATED


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /tokenize, "
        "/detokenize, /health, /metrics and /server_info. Without a model, the built-in tiny random model is used.",
        epilog="examples:\n"
        "  kvfence serve /models/Llama-3.2-1B-Instruct --max-model-len 4096   # router + prefill + decode on loopback\n"
        "  kvfence serve --port 8000   # the built-in tiny model\n"
        "  kvfence serve --port 8000 --prefill-workers 2 --decode-workers 2   # 2 x 2 worker processes\n"
        "  kvfence serve --role aggregated --port 8000 --max-total-tokens 32768 --context-length 2048",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face model directory, as --model (vLLM's positional form)",
    )
    add_server_arguments(p)
    add_engine_arguments(p)
    add_disagg_arguments(p)
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"kvfence: {msg}", file=sys.stderr, flush=True)


def resolve_model_arg(args: argparse.Namespace) -> None:
    """`kvfence serve MODEL` is `--model MODEL`; both, naming different models, is a mistake."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise KvfenceError(f"two models given: {tag} (positional) and --model {args.model}; give one")
    args.model = tag


def build_aggregated(args: argparse.Namespace) -> tuple[Any, Any]:
    """(FastAPI app, AsyncLLMEngine not yet started) for --role aggregated, after the start-up checks."""
    from kvfence.engine.async_engine import AsyncLLMEngine
    from kvfence.engine.engine_client import Capacity
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.role_engine import build_role_engine
    from kvfence.server.startup import loading_line
    from kvfence.server.tool_parsers import resolve_parser

    resolve_model_arg(args)
    budget = grammar_budget(args)
    model_dir = resolve_model_dir(args.model, _log)
    print(loading_line(AGGREGATED, model_dir), file=sys.stderr, flush=True)
    engine, context_length, pool_tokens = build_role_engine(args, model_dir, AGGREGATED)
    page_size = engine.resolved.page_size
    capacity = Capacity(context_length, {AGGREGATED: pool_tokens}, page_size)
    name = args.served_model_name or Path(model_dir).name
    client = AsyncLLMEngine(
        engine, name, capacity, settings={"allow_context_above_pool": bool(args.allow_context_above_pool)}
    )
    settings = ApiSettings(
        served_model_name=name,
        max_body_bytes=args.max_body_bytes,
        vocab_size=engine.vocab_size or None,
        server_args=flag_values(args),
        logprobs_mode=args.logprobs_mode,
        tool_call_parser=resolve_parser(args.tool_call_parser, getattr(engine.tokenizer, "chat_template", None)),
        grammar_budget=budget,
        api_key=api_key_from(args.api_key),
    )
    return build_app(client, engine.tokenizer, settings, grammar_compiler=engine.grammar_compiler), client


def run_aggregated(args: argparse.Namespace) -> int:
    from kvfence.server.launch import listen, run_server
    from kvfence.server.startup import startup_line

    sock = listen(args.host, args.port)  # a taken port is refused before the model loads
    app, client = build_aggregated(args)
    required = app.state.context.settings.api_key is not None
    client.start()
    try:
        run_server(
            app,
            args.host,
            args.port,
            args.log_level,
            banner=lambda url: startup_line(AGGREGATED, client.server_info(), {"serving": url}, required),
            sock=sock,
        )
    finally:
        client.shutdown()
    return 0


# role -> runner; the disaggregated roles add theirs here
ROLE_RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {AGGREGATED: run_aggregated}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if args.max_body_bytes <= 0:
        raise KvfenceError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    from kvfence.commands.worker_main import ROLE_RUNNERS as DISAGG_RUNNERS
    from kvfence.commands.worker_main import run_launch

    resolve_model_arg(args)
    grammar_budget(args)  # a bad budget is refused here, before any process starts
    if getattr(args, "disagg", False) or args.role is None:
        key = api_key_from(args.api_key)
        if key is not None:  # the router child reads it from its environment, not from a command line
            os.environ[API_KEY_ENV] = key
            args.api_key = None
        return run_launch(args)
    runner = {**ROLE_RUNNERS, **DISAGG_RUNNERS}.get(args.role)
    if runner is None:
        raise KvfenceError(
            f"--role {args.role} is not available from `kvfence serve` yet; "
            "start the disaggregated deployment with `python -m kvfence.commands.worker_main` (see its --help)"
        )
    return runner(args)
