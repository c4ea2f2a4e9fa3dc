"""The command-line flags of `kvfence serve` and of `python -m kvfence.commands.worker_main`, defined once.

What it knows: the flags of the HTTP front end and its start-up checks, shared by every
role (--role, --host, --port, --served-model-name, --api-key, --tokenizer, --chat-template,
--tool-call-parser, the grammar budget, --allow-context-above-pool, --max-body-bytes,
--seed, --logprobs-mode, --log-level), and the flags of the
disaggregated roles and of a whole deployment (--disagg, --router-address, --control-port,
--handoff-port, --transfer-backend, timeouts, restart limits, worker counts, ...). A flag
that sets a config dataclass's field takes that field's default (RouterConfig,
DecodeConfig, TransferConfig, LaunchConfig, the worker loop's reconnect timeout), so each
default is stated once. The engine's flags (--model, --page-size, ...) live with the
engine's config in `kvfence.config`. What it does not know: what any role does with its
flags.
"""

from __future__ import annotations

import argparse

from kvfence.disagg.decode_config import DecodeConfig
from kvfence.disagg.launcher import LaunchConfig
from kvfence.disagg.router_config import RECONNECT_TIMEOUT_S, RouterConfig
from kvfence.engine.structured_output import GrammarBudget
from kvfence.roles import ROLES
from kvfence.server.tool_parsers import PARSERS
from kvfence.transfer.transfer_config import TRANSFER_BACKENDS, TransferConfig

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
        "--api-key",
        default=None,
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' (401 otherwise; /health and /metrics stay open); also "
        "read from $KVFENCE_API_KEY, which keeps it out of the process list. The router and aggregated serve check "
        "it; it never appears in logs, /server_info or /metrics",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a local directory with the tokenizer.json to use instead of the model's (its eos ids stay the model's)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the Jinja chat template to render messages with instead of the tokenizer's: a file, or the template "
        "itself",
    )
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *PARSERS],
        help="the format tool calls are parsed from in the output under tool_choice auto: hermes "
        '(<tool_call>{...}</tool_call>), llama3_json ({"name": ..., "parameters": ...}); auto: llama3_json when '
        "the chat template speaks of <|python_tag|> or an ipython role, else hermes (default: auto)",
    )
    g.add_argument(
        "--max-grammar-bytes",
        type=_positive_int,
        default=GrammarBudget.max_grammar_bytes,
        metavar="N",
        help="largest grammar (xgrammar EBNF) a response_format or forced tool call may compile to; larger ones get "
        f"HTTP 400 (default: {GrammarBudget.max_grammar_bytes})",
    )
    g.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=GrammarBudget.compile_timeout_s,
        metavar="S",
        help="longest a request waits for its grammar to compile (off the step loop); past it the request gets "
        f"HTTP 400 and the schema is refused at once from then on (default: {GrammarBudget.compile_timeout_s:g})",
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


def add_disagg_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the disaggregated roles, on top of `kvfence serve`'s server and engine flags."""
    g = p.add_argument_group("disaggregated serving (--role prefill|decode|router, or --disagg for a whole deployment)")
    g.add_argument(
        "--disagg",
        action="store_true",
        help="start a router and --prefill-workers / --decode-workers workers (one process each, free loopback "
        "ports); role-specific pool sizes: --prefill-max-total-tokens / --decode-max-total-tokens",
    )
    g.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="PATH",
        help="the deployment secret every router and worker of one deployment must share (64 hex characters, mode "
        "600; `kvfence cluster-key PATH` writes one); also $KVFENCE_CLUSTER_KEY_FILE. It authenticates the control "
        "plane (CURVE), the KV data plane and every manifest. `kvfence serve` without --role makes a fresh one for "
        "the processes it starts; a role started on its own refuses to start without one",
    )
    g.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="run the control and data planes WITHOUT authentication (anyone who can reach the ports can register "
        "workers and forge KV handoffs that verify): tests and demos only; /server_info says auth is off",
    )
    g.add_argument("--router-address", default=None, metavar="URL", help="workers: the router's tcp://host:port")
    g.add_argument("--control-port", type=int, default=None, metavar="N", help="router: control-plane port")
    g.add_argument("--worker-id", default=None, help="workers: name to register with (default: role + random)")
    g.add_argument("--handoff-host", default=DecodeConfig.listen_host, help="decode: data-plane listen host")
    g.add_argument("--handoff-port", type=int, default=None, metavar="N", help="decode: data-plane listen port")
    g.add_argument(
        "--transfer-backend",
        "--transport",
        dest="transport",
        default=DecodeConfig.transport,
        choices=[b for b in TRANSFER_BACKENDS if b != "local"],  # "local" is in-process, tests only
        help="KV data plane: kvfence's own TCP transport, or the Mooncake Transfer Engine (TCP protocol, P2P "
        "handshake; needs mooncake-transfer-engine-non-cuda) with control frames over TCP "
        f"(default: {DecodeConfig.transport})",
    )
    g.add_argument(
        "--handoff-deadline-s",
        type=float,
        default=RouterConfig.handoff_deadline_s,
        help=f"seconds a KV handoff may take (default {RouterConfig.handoff_deadline_s:g})",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=RouterConfig.request_timeout_s,
        help=f"router: fail a request silent this long (default {RouterConfig.request_timeout_s:g})",
    )
    g.add_argument(
        "--kv-io-timeout-s",
        type=float,
        default=TransferConfig.io_timeout_s,
        help="KV data connections: drop one that moves no byte this long in the middle of a frame "
        f"(default {TransferConfig.io_timeout_s:g})",
    )
    g.add_argument("--strict-kv", action="store_true", help="poison KV pages when they are quarantined or freed")
    g.add_argument(
        "--first-token-after-verify",
        action="store_true",
        help="router: hold the first token until decode verified the handoff (default: stream prefill's first "
        "token at once; docs/handoff.md, 'What the client sees before the verdict')",
    )
    g.add_argument(
        "--no-prefix-affinity",
        action="store_true",
        help="router: route prompts by load only (default: a prompt goes back to the prefill worker whose prefix "
        "cache holds its leading pages, while that worker's extra queue is less than the prefill it saves)",
    )
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
        default=LaunchConfig.num_prefill,
        metavar="N",
        help="--disagg: start N prefill worker processes (each its own pool); router: wait for N at start "
        f"(default {LaunchConfig.num_prefill})",
    )
    g.add_argument(
        "--decode-workers",
        type=_positive_int,
        default=LaunchConfig.num_decode,
        metavar="M",
        help="--disagg: start M decode worker processes (each its own pool and data-plane port); router: wait for M "
        f"at start (default {LaunchConfig.num_decode})",
    )
    g.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process goes away")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads of this process (default: $OMP_NUM_THREADS if set, else router 1 and each "
        "worker (cores - 1) // 2, at least 1, so the three processes do not oversubscribe the cores; workers that "
        "`kvfence serve` starts on one host then also borrow the cores of co-located workers that have no work, "
        "which setting this or $OMP_NUM_THREADS turns off)",
    )
    g.add_argument(
        "--core-board",
        default=None,
        metavar="PATH",
        help="workers: the core board the launcher made for this host's workers (kvfence.disagg.core_board); "
        "set by `kvfence serve`, with --core-board-slot",
    )
    g.add_argument("--core-board-slot", type=int, default=None, metavar="N", help="workers: this worker's slot")
    g.add_argument(
        "--worker-timeout-s",
        type=float,
        default=RouterConfig.worker_timeout_s,
        help="router: declare a worker dead after this long without a message from it "
        f"(default {RouterConfig.worker_timeout_s:g})",
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
        default=RECONNECT_TIMEOUT_S,
        help="workers: how long to try registering with a new router before exiting with code 2 "
        f"(default {RECONNECT_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-router-restarts",
        type=int,
        default=LaunchConfig.max_router_restarts,
        help="--disagg: restart a router that exits this many times (the workers register again; "
        f"default {LaunchConfig.max_router_restarts})",
    )
    g.add_argument(
        "--max-worker-restarts",
        type=int,
        default=LaunchConfig.max_worker_restarts,
        help="--disagg: restart each worker that dies (killed, crashed) this many times; a worker that exits with "
        f"code 2 (refused by the router, bad flags) stops the deployment (default {LaunchConfig.max_worker_restarts})",
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


def grammar_budget(args: argparse.Namespace) -> GrammarBudget:
    """The grammar budget the flags give (a ConfigError-free check: argparse already refused non-positive sizes)."""
    from kvfence.errors import KvfenceError

    if not args.grammar_compile_timeout_s > 0:
        raise KvfenceError(f"--grammar-compile-timeout-s must be positive, got {args.grammar_compile_timeout_s:g}")
    return GrammarBudget(max_grammar_bytes=args.max_grammar_bytes, compile_timeout_s=args.grammar_compile_timeout_s)


SECRET_FLAGS = ("api_key",)  # flags whose values never leave the process (nor reach /server_info)


def flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The parsed flags as plain values, for /server_info's `server_args` (secrets left out)."""
    return {
        k: v
        for k, v in vars(args).items()
        if k != "func" and k not in SECRET_FLAGS and isinstance(v, (str, int, float, bool, type(None)))
    }
