"""`kvfence bench NAME ...`: a dispatcher over the modules in `kvfence.bench`.

What it knows: that every module named in `kvfence.bench.BENCHMARKS` registers its own
subcommand, and that a missing module is skipped. What it does not know: what any
benchmark does or prints.
"""

from __future__ import annotations

import argparse
import importlib

from kvfence.bench import BENCHMARKS
from kvfence.errors import KvfenceError


def _register_broken(sub: argparse._SubParsersAction, name: str, error: Exception) -> None:
    """A benchmark that cannot load must not take the rest of the CLI down; it reports why when run."""

    def _fail(args: argparse.Namespace) -> int:
        raise KvfenceError(f"benchmark {name!r} is unavailable: {error}")

    if name not in sub.choices:  # it may have registered itself before failing
        sub.add_parser(name, help=f"(unavailable: {error})", add_help=False).set_defaults(func=_fail)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure kvfence against baselines measured in the same run",
        description="Benchmarks. Every number is measured on this machine, in this run, next to its baseline.",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"kvfence.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"kvfence.bench.{name}":
                continue  # not there: nothing to register
            _register_broken(sub, name, e)
            continue
        try:
            module.register(sub)
        except ImportError as e:  # a benchmark's own dependency is missing: say so when it is asked for
            _register_broken(sub, name, e)

    def _help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_help)
