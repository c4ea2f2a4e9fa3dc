"""`kvfence proxy`: kvfence's OpenAI front end over vLLM prefill/decode instances running kvfence's connector.

What it knows: the command line (the two instances' URLs, or `--launch` to start them itself with the connector,
the model directory whose tokenizer the front end uses, the server flags shared with `kvfence serve`), and the order
of start-up and shutdown. What it does not know: the front end (`kvfence.integrations.vllm.proxy`) or vLLM's
launch (`kvfence.integrations.vllm.launch`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvfence.errors import KvfenceError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "proxy",
        help="kvfence's verified front end over a vLLM prefill and a vLLM decode instance",
        description="Serve kvfence's OpenAI API (/v1/completions, /v1/chat/completions, /metrics, /server_info) over "
        "a vLLM prefill instance and a vLLM decode instance that run kvfence's KV connector "
        "(kvfence.integrations.vllm.connector): the proxy tokenizes, issues a secret transfer id per request, gives "
        "decode the expected token count and hash, and returns each choice's integrity record. See docs/vllm.md.",
        epilog="examples:\n"
        "  kvfence proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --model /models/llama\n"
        "  kvfence proxy --launch --vllm-python /opt/vllm/bin/python --port 8000   # starts both instances too",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", metavar="URL", help="the vLLM prefill instance (kv_producer)")
    p.add_argument("--decode", metavar="URL", help="the vLLM decode instance (kv_consumer)")
    p.add_argument("--model", default=None, help="model directory: its tokenizer (default: the built-in model)")
    p.add_argument("--launch", action="store_true", help="start the two vLLM instances (with --model) on loopback")
    p.add_argument("--vllm-python", default=sys.executable, help="the interpreter with vLLM, for --launch")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="--launch: each instance's KV cache (GiB)")
    p.add_argument("--block-size", type=int, default=None, help="--launch: vLLM's block size (tokens)")
    p.add_argument("--max-model-len", type=int, default=2048, help="--launch: vLLM's --max-model-len")
    p.add_argument(
        "--cluster-key-file",
        default=None,
        help="the deployment's key, the one the vLLM instances' connectors hold (also $KVFENCE_CLUSTER_KEY_FILE); "
        "with --launch and no key a fresh one is made for the instances started",
    )
    p.add_argument(
        "--insecure-no-auth", action="store_true", help="run without a key (anyone on the network can forge records)"
    )
    p.add_argument("--record-timeout-s", type=float, default=30.0, help="how long a record from decode may take")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port; 0 picks a free one (default: 8000)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the model dir name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body")
    p.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence.auth.keys import ENV_KEY, INSECURE_WARNING, ClusterKey, ClusterKeyError, load_cluster_key
    from kvfence.config import resolve_model_dir
    from kvfence.integrations.vllm import launch as vlaunch
    from kvfence.integrations.vllm.proxy import build_client
    from kvfence.models.tokenizer import Tokenizer
    from kvfence.server.api import ApiSettings, build_app
    from kvfence.server.launch import run_server

    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if args.launch and (args.prefill or args.decode):
        raise KvfenceError("--launch starts its own instances: drop --prefill/--decode, or drop --launch")
    if not args.launch and not (args.prefill and args.decode):
        raise KvfenceError("give both --prefill URL and --decode URL of running vLLM instances, or --launch")
    try:
        key = load_cluster_key(args.cluster_key_file, args.insecure_no_auth)
    except ClusterKeyError:
        if not args.launch:
            raise
        key = ClusterKey.generate()  # for the instances this command starts; handed to them in their environment
    if not key.secure:
        print(f"kvfence: WARNING: {INSECURE_WARNING}", file=sys.stderr, flush=True)
    model_dir = resolve_model_dir(args.model, lambda m: print(f"kvfence: {m}", file=sys.stderr))
    servers: list[vlaunch.VllmServer] = []
    try:
        prefill, decode = args.prefill, args.decode
        if args.launch:
            extra = {"insecure_no_auth": True} if not key.secure else {}
            env = {ENV_KEY: key.to_hex()} if key.secure else {}  # the instances' key: in their environment only
            specs = [
                vlaunch.VllmSpec(
                    role,
                    model_dir,
                    vlaunch.kvfence_transfer_config(role, extra),
                    kv_cache_gib=args.kv_cache_gib,
                    max_model_len=args.max_model_len,
                    block_size=args.block_size,
                    python=args.vllm_python,
                    env=env,
                )
                for role in ("prefill", "decode")
            ]
            print("kvfence: starting vLLM prefill and decode (most of a minute)", file=sys.stderr, flush=True)
            servers = vlaunch.start_all(specs)
            for s in servers:
                print(f"kvfence: vLLM {s.spec.label} at {s.url} (log {s.log_path})", file=sys.stderr, flush=True)
            prefill, decode = servers[0].url, servers[1].url
        client = build_client(prefill, decode, key, record_timeout_s=args.record_timeout_s)
        name = args.served_model_name or Path(model_dir).name
        client.model_name = name
        tokenizer = Tokenizer.from_dir(model_dir)
        settings = ApiSettings(
            served_model_name=name,
            max_body_bytes=args.max_body_bytes,
            vocab_size=tokenizer.vocab_size or None,
            server_args={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
        )
        try:
            run_server(build_app(client, tokenizer, settings), args.host, args.port, args.log_level)
        finally:
            client.close()
    finally:
        for s in servers:
            s.stop()
    return 0
