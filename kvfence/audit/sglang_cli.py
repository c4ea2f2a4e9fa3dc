"""An SGLang launch command line, read the way SGLang's own argument parser reads it.

What it knows: the shell shapes a launch takes (`KEY=VAL ... python -m sglang.launch_server ...`, `sglang serve
[MODEL] ...`, inside a script with `export KEY=VAL` lines and backslash continuations, ending at a redirection
or `&`), and, from the option table of each SGLang version (kvfence.audit.sglang_flags, generated from the
wheels), how argparse maps each token to a ServerArgs field: exact option strings, `--opt=value`, unique prefixes
(argparse's allow_abbrev, which SGLang leaves on), flags without a value, lists, negative numbers as values, and
the value parsers: `int`, `float`, and SGLang's human_readable_int (utils/common.py, the same in 0.5.19 ..
0.5.23): an integer, or a number with a case-sensitive suffix, SI k/M/G/T (decimals allowed, e.g. 25.6k) or
IEC Ki/Mi/Gi/Ti (integers only, e.g. 1Mi = 1,048,576).
It also says on which line of a script the launch starts and each option (and `export`ed variable) was given, so
findings can point at the line to change.
What it does not know: the contents of `--config FILE`, shell expansions (`$TP`), and resolution: a value that
is not on the command line is absent from the result, never filled in with a guessed default.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, NamedTuple

from kvfence.audit import sglang_flags

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_HRI_RE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_NEGATIVE_RE = re.compile(r"-\d+|-\d*\.\d+")  # argparse's negative-number matcher
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_STOP_RE = re.compile(r"\d?>>?.*|&>.*|&&?|\|\|?|;")


def human_readable_int(value: str) -> int:
    """The integer SGLang's `--context-length 1Mi` style flags mean; ValueError for what SGLang refuses."""
    value = value.strip()
    m = _HRI_RE.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in _IEC:
            if "." in number:
                raise ValueError(f"decimals are not allowed with IEC suffixes like '{suffix}': {value!r}")
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"invalid integer value {value!r} (SGLang takes a plain integer, SI suffixes 1k/1M or IEC 1Ki/1Mi; "
            "suffixes are case-sensitive)"
        ) from None


class LaunchCommand(NamedTuple):
    args: dict[str, Any]  # ServerArgs field -> the value SGLang's parser would store
    env: dict[str, str]  # KEY=VAL prefixes and export lines
    problems: list[str]  # what SGLang's parser would refuse, or what we could not evaluate
    table: str  # which version's option table read it
    line: int = 1  # 1-based line of the text where the launch command starts
    arg_lines: dict[str, int] = {}  # ServerArgs field -> 1-based line of the option that set it
    env_lines: dict[str, int] = {}  # variable -> 1-based line that set it


class ParsedArgv(NamedTuple):
    args: dict[str, Any]
    problems: list[str]
    given: dict[str, str]  # ServerArgs field -> the option token that set it (as written, e.g. `--tp`)


def version_index(version: tuple[int, int, int] | None) -> int | None:
    """Index into sglang_flags.VERSIONS; None when the version is unknown or outside 0.5.19 .. 0.5.23."""
    if version is None:
        return None
    for i, v in enumerate(sglang_flags.VERSIONS):
        if tuple(int(x) for x in v.split(".")) == version:
            return i
    return None


def options_for(index: int | None) -> dict[str, tuple[str, int | str, str]]:
    """{option: (dest, nargs, kind)} of one version; the union of all (newest meaning wins) when index is None."""
    out: dict[str, tuple[str, int | str, str]] = {}
    for opt, (dest, nargs, kind, first, last) in sglang_flags.OPTIONS.items():
        if index is None or first <= index <= last:
            out[opt] = (dest or opt[2:].replace("-", "_"), nargs, kind)
    return out


def _convert(kind: str, raw: str) -> Any:
    if kind == "hri":
        return human_readable_int(raw)
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw


def _is_option(tok: str) -> bool:
    return tok.startswith("-") and len(tok) > 1 and not _NEGATIVE_RE.fullmatch(tok)


def _resolve(tok: str, table: dict[str, tuple[str, int | str, str]]) -> tuple[str | None, str | None, str]:
    """(option, explicit value, problem) for one `--...` token, as argparse resolves it."""
    if tok in table:
        return tok, None, ""
    name, eq, explicit = tok.partition("=")
    if eq and name in table:
        return name, explicit, ""
    if name.startswith("--"):
        hits = sorted(o for o in table if o.startswith(name))
        if len(hits) == 1:
            return hits[0], (explicit if eq else None), ""
        if hits:
            return None, None, f"ambiguous option {name} (could match {', '.join(hits[:4])})"
    return None, None, f"unrecognized argument {tok}"


def parse_argv(argv: list[str], index: int | None, serve: bool = False) -> ParsedArgv:
    """ServerArgs values from the argument list after `launch_server` / `serve`, the problems found, and which
    token set each value."""
    table = options_for(index)
    args: dict[str, Any] = {}
    problems: list[str] = []
    given: dict[str, str] = {}
    if serve:
        argv = list(argv)
        if argv and not argv[0].startswith("-"):  # `sglang serve MODEL ...`
            argv = ["--model-path", argv[0], *argv[1:]]
        stripped: list[str] = []
        i = 0
        while i < len(argv):  # `--model-type` belongs to `sglang serve` itself
            if argv[i] == "--model-type":
                i += 2
                continue
            if not argv[i].startswith("--model-type="):
                stripped.append(argv[i])
            i += 1
        argv = stripped
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not _is_option(tok):
            problems.append(f"unrecognized argument {tok}")
            continue
        opt, explicit, problem = _resolve(tok, table)
        if opt is None:
            problems.append(problem)
            continue
        dest, nargs, kind = table[opt]
        if nargs == 0:
            if explicit is not None:
                problems.append(f"{opt} takes no value (got {tok})")
                continue
            args[dest] = kind != "false"
            given[dest] = tok
            continue
        values: list[str] = []
        if explicit is not None:
            values = [explicit]
        else:
            while i < len(argv) and not _is_option(argv[i]):
                values.append(argv[i])
                i += 1
                if nargs in (1, "?"):
                    break
        if nargs == 1 and not values:
            problems.append(f"{opt} expects one argument")
            continue
        if nargs == "+" and not values:
            problems.append(f"{opt} expects at least one argument")
            continue
        if any(v.startswith("$") or "$(" in v or "`" in v for v in values):
            problems.append(f"{opt} {' '.join(values)}: a shell expansion, value not evaluated")
            continue
        try:
            converted = [_convert(kind, v) for v in values]
        except ValueError as e:
            problems.append(f"{opt}: {e}")
            continue
        args[dest] = converted[0] if nargs in (1, "?") and converted else converted
        given[dest] = tok.partition("=")[0]
    return ParsedArgv(args, problems, given)


def _split_launch(tokens: list[str]) -> tuple[list[str], list[str], bool] | None:
    """(env-and-wrapper tokens before the program, argv after it, is `sglang serve`) or None."""
    for k, tok in enumerate(tokens):
        if tok in ("sglang.launch_server", "sglang.srt.server") or tok.endswith("launch_server.py"):
            return tokens[:k], tokens[k + 1 :], False
        if (tok == "sglang" or tok.endswith("/sglang")) and k + 1 < len(tokens) and tokens[k + 1] == "serve":
            return tokens[:k], tokens[k + 2 :], True
    return None


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(1-based first physical line, text) of each line once backslash continuations are joined."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    first = 0
    for n, physical in enumerate(text.splitlines(), start=1):
        if not parts:
            first = n
        if physical.rstrip("\r").endswith("\\"):
            parts.append(physical.rstrip("\r")[:-1])
            continue
        parts.append(physical)
        out.append((first, " ".join(parts)))
        parts = []
    if parts:
        out.append((first, " ".join(parts)))
    return out


def _token_line(physical: list[str], start: int, token: str) -> int:
    """1-based line, from `start` on, where `token` stands as a word (an option or a KEY=VAL)."""
    pat = re.compile(r"(?<![\w-])" + re.escape(token) + r"(?![\w-])")
    for n in range(start, len(physical) + 1):
        if pat.search(physical[n - 1]):
            return n
    return start


def _shell_commands(text: str) -> Iterator[tuple[int, list[str]]]:
    """(1-based first physical line, shell tokens) of each logical line that is not blank, not a comment and that
    shlex can split (a line it cannot is skipped)."""
    for first, raw in _logical_lines(text):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            yield first, shlex.split(line, comments=True)
        except ValueError:
            continue


def _before_shell_stop(argv: list[str]) -> list[str]:
    """The arguments up to the first shell operator (`&&`, `|`, `;`, a redirection...) that ends the command."""
    for k, tok in enumerate(argv):
        if _SHELL_STOP_RE.fullmatch(tok):
            return argv[:k]
    return argv


def parse_launch_command(text: str, version: tuple[int, int, int] | None = None) -> LaunchCommand | None:
    """The first SGLang launch in a command line or shell script; None when there is none."""
    physical = text.splitlines()
    env: dict[str, str] = {}
    env_lines: dict[str, int] = {}
    for first, tokens in _shell_commands(text):
        split = _split_launch(tokens)
        if split is None:
            if tokens and tokens[0] == "export":
                tokens = tokens[1:]
            for t in tokens:
                if _ENV_RE.match(t):
                    key, val = t.split("=", 1)
                    env[key], env_lines[key] = val, first
            continue
        before, argv, serve = split
        for t in before:
            if _ENV_RE.match(t):
                key, val = t.split("=", 1)
                env[key], env_lines[key] = val, first
        argv = _before_shell_stop(argv)
        index = version_index(version)
        parsed = parse_argv(argv, index, serve=serve)
        problems = parsed.problems
        if "config" in parsed.args:
            problems.append(f"--config {parsed.args['config']}: options in that file are not read here")
        table = f"SGLang {sglang_flags.VERSIONS[index]}" if index is not None else "all SGLang 0.5.19-0.5.23 options"
        arg_lines = {dest: _token_line(physical, first, tok) for dest, tok in parsed.given.items()}
        return LaunchCommand(parsed.args, env, problems, table, first, arg_lines, env_lines)
    return None


def parse_env_lines(text: str) -> dict[str, str]:
    """`KEY=VAL` / `export KEY=VAL` lines (comments and blank lines ignored)."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        env.update(dict(t.split("=", 1) for t in tokens if _ENV_RE.match(t)))
    return env
