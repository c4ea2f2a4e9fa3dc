"""The `kvfence` command line: a thin dispatcher over `kvfence.commands.*`.

What it knows: the list of subcommand modules, that a `KvfenceError` is shown
as one line on stderr with exit code 2 instead of a traceback, and that a flag a
subcommand does not know is reported with that subcommand's own usage and the closest
flag it does know ("did you mean"), not the top-level usage argparse would print. What
it does not know: what any subcommand does; each module registers its own parser.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

from kvfence.errors import KvfenceError

_COMMANDS = ["generate", "serve", "bench", "audit", "probe", "cluster-key", "proxy"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `kvfence` parser; with `only` (a subcommand's name) just that subcommand is registered, so running one
    does not import the others' modules (`kvfence serve` and the processes it starts stay free of torch until a role
    needs it; the benchmarks import torch and transformers)."""
    parser = argparse.ArgumentParser(
        prog="kvfence",
        description="LLM serving with disaggregated prefill/decode whose KV handoff is verified "
        "end to end, plus tools that audit SGLang deployments for cross-request KV leakage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in [only] if only in _COMMANDS else _COMMANDS:
        try:
            module = importlib.import_module(f"kvfence.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name != f"kvfence.commands.{name.replace('-', '_')}":
                raise
            continue
        module.register(sub)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


def _unknown(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The error for arguments `parser` does not take, with the closest flag it does take."""
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    message = f"unrecognized arguments: {' '.join(extras)}"
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


# How long an idle OpenMP thread spins at a barrier before it sleeps (GNU OpenMP, torch's runtime on Linux, read once
# when torch loads it: so set before any subcommand module imports torch). libgomp's default, 300,000 iterations,
# keeps threads spinning for a partner the OS has descheduled when other processes compete for the cores (issue
# 26.5); 20,000 (the core board's value, disagg/launcher.BOARD_SPINCOUNT) sleeps soon after. $GOMP_SPINCOUNT or
# $OMP_WAIT_POLICY set by the user win. The native kernels' own helper threads follow the same variables.
# OMP_WAIT_POLICY=PASSIVE is not the default: measured against this (docs/benchmarks.md, "work sharing under
# contention") it cost 2-22% quiet and gained nothing beyond the noise under two busy loops.
SPINCOUNT = 20_000


def main(argv: list[str] | None = None) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPINCOUNT))
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subcommand(parser, getattr(args, "command", None)).error(_unknown(_subcommand(parser, args.command), extras))
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
