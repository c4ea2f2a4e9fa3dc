"""The exit status of the operator tools (`kvfence audit sglang|vllm|logs`, `kvfence probe`).

What it knows: the codes, so that a CI job can tell "dangerous" from "could not check":
0 clean, 1 warnings, 2 critical (the worst finding of a tool that ran to the end), 3 could not check (an input
that cannot be read or reached, a server that is down or is not the engine the tool checks, a target the probe
refuses), 4 usage (the command line is wrong); that a tool error is one line on stderr
(`kvfence <tool>: error: ...`), never a traceback; and an argument parser whose usage errors exit with 4
instead of argparse's 2 (which would read as critical).
What it does not know: any finding or rule (kvfence.audit.findings), nor what each tool reads.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from kvfence.errors import KvfenceError

CLEAN = 0
WARNINGS = 1
CRITICAL = 2
COULD_NOT_CHECK = 3
USAGE = 4

HELP = (
    "Exit status: 0 clean, 1 warnings, 2 critical finding(s); 3 could not check (an input unreadable or "
    "missing, a server down or not the SGLang/vLLM the tool expects, a refused target); 4 usage error. "
    "A tool error is one line on stderr."
)


class UsageError(KvfenceError):
    """The command line asks for something impossible (a malformed KEY=VAL, no input given)."""


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors that exit with USAGE, for the parsers of the operator tools.

    argparse exits 2 on a usage error, which these tools use for "critical"; unrecognised arguments are caught
    here too (argparse otherwise hands them to the top-level parser, which exits 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def add_tool_parser(subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand parser of class ToolArgumentParser (its own subparsers inherit the class)."""
    kept = subparsers._parser_class
    subparsers._parser_class = ToolArgumentParser
    try:
        return subparsers.add_parser(name, **kwargs)
    finally:
        subparsers._parser_class = kept


def tool_error_code(e: BaseException) -> int:
    """USAGE for a UsageError, COULD_NOT_CHECK for anything else a tool could not get past."""
    return USAGE if isinstance(e, UsageError) else COULD_NOT_CHECK


def report_error(prog: str, e: BaseException) -> int:
    """Print the one line of a tool error on stderr and return its exit code."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    print(f"{prog}: error: {text}", file=sys.stderr)
    return tool_error_code(e)
