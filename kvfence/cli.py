"""The `kvfence` command line: a thin dispatcher over `kvfence.commands.*`.

What it knows: the list of subcommand modules, and that a `KvfenceError` is shown
as one line on stderr with exit code 2 instead of a traceback. What it does not
know: what any subcommand does; each module registers its own parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvfence.errors import KvfenceError

_COMMANDS = ["generate", "serve", "bench", "audit", "probe", "proxy"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfence",
        description="LLM serving with disaggregated prefill/decode whose KV handoff is verified "
        "end to end, plus tools that audit SGLang deployments for cross-request KV leakage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"kvfence.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kvfence.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvfenceError as e:
        print(f"kvfence: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvfence: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
