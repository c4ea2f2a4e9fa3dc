"""Every command in README.md and docs/*.md is checked: each `kvfence ...` line parses with kvfence's own parser,
each `kvfence serve` line passes the start-up checks that do not need weights (context length against the model,
pools against the context), each `python -m` module and `python scripts/...` file exists, and (slow) the README's
own `kvfence generate` and `curl` lines run against a real server. A command is a line of a fenced code block;
where a block marks commands with `$ `, only those lines are (the rest is their output). Placeholders (`...`,
`$VAR`) are parsed as far as they can be and not run.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def commands(path: Path) -> list[str]:
    """The command lines of `path`'s fenced blocks (continuations joined, `&&` chains split)."""
    out: list[str] = []
    for block in _BLOCK.findall(path.read_text()):
        lines = block.replace("\\\n", " ").splitlines()
        marked = any(line.lstrip().startswith("$ ") for line in lines)
        for line in lines:
            text = line.strip()
            if marked:
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            for part in text.split("&&"):
                part = part.strip()
                if re.match(r"(kvfence|python3?|curl)\b", part):
                    out.append(part)
    return out


ALL = [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in commands(p)]


def inline_scripts(path: Path) -> set[str]:
    """Scripts a doc writes out itself: a code block whose first line is `# NAME.py ...`."""
    return {m.group(1) for b in _BLOCK.findall(path.read_text()) if (m := re.match(r"# (\S+\.py)\b", b))}


def _argv(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    for stop in ("|", ">", "&", ";"):
        if stop in argv:
            argv = argv[: argv.index(stop)]
    return argv


def test_the_docs_have_commands_to_check() -> None:
    kinds = {c.split()[0] for _, c in ALL}
    assert {"kvfence", "curl"} <= kinds and len(ALL) > 40


@pytest.mark.parametrize("where,command", [a for a in ALL if a[1].startswith("kvfence ")], ids=lambda x: x[:70])
def test_every_kvfence_command_parses(where: str, command: str) -> None:
    from kvfence.cli import build_parser

    # shell variables stand for values the reader fills in: a port where one is asked for, else a word
    argv = [re.sub(r"\$\{?(\w+)\}?", lambda m: "8000" if "PORT" in m.group(1) else "x", a) for a in _argv(command)[1:]]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's error (2) or --help (0)
        assert e.code == 0, f"{where}: `{command}` does not parse"
        return
    if argv and argv[0] == "serve":
        _check_serve(where, command, args)


def _check_serve(where: str, command: str, args: Any) -> None:
    """What `kvfence serve` refuses at start without loading weights: a context longer than the model's, a pool that
    cannot hold one context (unless --allow-context-above-pool)."""
    from kvfence.config import DEFAULT_MIN_POOL_TOKENS, check_capacity
    from kvfence.models.default import PRESETS

    model = getattr(args, "model", None) or "kvfence-tiny-llama"
    if model not in PRESETS:
        return  # a placeholder path (/path/to/model): nothing to check it against
    model_context = int(PRESETS[model][0]["max_position_embeddings"])
    context = args.context_length or model_context
    assert context <= model_context, f"{where}: `{command}` asks for {context} tokens of a {model_context}-token model"
    if args.allow_context_above_pool:
        return
    page = args.page_size or 16
    for flag in ("max_total_tokens", "prefill_max_total_tokens", "decode_max_total_tokens"):
        pool = getattr(args, flag, None) or getattr(args, "max_total_tokens", None)
        pool = pool or max(DEFAULT_MIN_POOL_TOKENS, context)
        check_capacity(context, pool // page, page, role=f"{where}: {flag}")


@pytest.mark.parametrize("where,command", [a for a in ALL if a[1].startswith("python")], ids=lambda x: x[:70])
def test_every_python_command_names_a_module_or_script_that_exists(where: str, command: str) -> None:
    argv = _argv(command)
    if argv[1] == "-m":
        assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
    elif argv[1] != "-c":
        defined = argv[1] in inline_scripts(ROOT / where)  # the doc gives the script's text
        assert defined or (ROOT / argv[1]).is_file(), f"{where}: no file {argv[1]}"


def test_the_readmes_first_two_commands_are_the_setup_and_the_tests() -> None:
    first = commands(ROOT / "README.md")
    assert first[0].startswith("python3 -m venv") or "pip install" in first[0]
    assert any(c.startswith("kvfence generate") for c in first[:6])
    text = (ROOT / "README.md").read_text()
    assert 'python -m pytest -q -m "not slow"' in text.split("## ")[0]  # the test command, before any section


@pytest.mark.slow
def test_the_readmes_generate_and_curl_commands_run_against_a_real_server(tmp_path: Path) -> None:
    """`kvfence generate` as written, and every README curl line sent to a `kvfence serve --role aggregated` with the
    README's own flags and model name, on a free port in place of 8000 (API-key lines get the server's key)."""
    from tests.helpers.serve import OFFLINE, kvfence_serve

    readme = commands(ROOT / "README.md")
    gen = next(c for c in readme if c.startswith("kvfence generate --prompt"))
    env = {**__import__("os").environ, **OFFLINE}
    p = subprocess.run([sys.executable, "-m", "kvfence", *_argv(gen)[1:]], capture_output=True, text=True,
                       timeout=600, env=env)  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip(), p.stderr[-2000:]
    from kvfence.config import resolve_model_dir

    model_dir = Path(resolve_model_dir(None))
    curls = [c for c in readme if c.startswith("curl") and "Qwen2.5" not in c]  # the rest need that model
    assert len(curls) >= 3
    with kvfence_serve(model_dir, tmp_path / "serve.log", "--role", "aggregated", "--served-model-name",
                       "kvfence-tiny-llama") as url:  # fmt: skip
        port = url.rsplit(":", 1)[1]
        for c in curls:
            argv = [a.replace("localhost:8000", f"127.0.0.1:{port}") for a in _argv(c)]
            r = subprocess.run([*argv, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=120)
            body, status = r.stdout.rsplit("\n", 1)
            assert status == "200", f"{c}\n{body[:500]}"
