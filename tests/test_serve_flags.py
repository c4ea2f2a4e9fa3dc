"""The flags a vLLM/SGLang user types by reflex, the mistakes they make, and what `kvfence serve` says at start.

`kvfence serve MODEL`, `--model-path`, `--max-model-len`, `--tokenizer`, `--chat-template`; an unknown flag
gets serve's own usage and the closest flag; a hub id gets one line on how to get a local directory; the
start-up line names what was chosen; README, --help and the build's log give one native-build estimate.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvfence.cli import build_parser, main
from kvfence.models.native_kernels import NATIVE_BUILD_ESTIMATE
from kvfence.server.role_engine import chat_template_from, load_tokenizer
from kvfence.server.startup import startup_line

README = Path(__file__).parent.parent / "README.md"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_model_as_positional_and_the_vllm_spellings(tiny_llama_dir: Path) -> None:
    from kvfence.commands.serve import resolve_model_arg

    args = parse(str(tiny_llama_dir), "--max-model-len", "512")
    resolve_model_arg(args)
    assert (args.model, args.context_length) == (str(tiny_llama_dir), 512)
    assert parse("--model-path", "m").model == "m"
    both = parse("a", "--model", "b")
    with pytest.raises(Exception, match="two models given"):
        resolve_model_arg(both)


def test_an_unknown_flag_gets_serves_usage_and_the_closest_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-model-length", "4096"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: kvfence serve") and "did you mean --max-model-len?" in err
    with pytest.raises(SystemExit):
        main(["generate", "--promt", "hi"])
    assert "usage: kvfence generate" in capsys.readouterr().err


def test_a_hub_id_says_models_load_from_local_directories(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--role", "aggregated", "meta-llama/Llama-3.1-8B-Instruct"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "local directories" in err and "hf download meta-llama/Llama-3.1-8B-Instruct --local-dir" in err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path, tiny_llama_dir: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert chat_template_from(str(path)) == template == chat_template_from(template)
    for bad, why in ((str(tmp_path / "missing.jinja"), "not a file"), ("{% for x %}", "not a valid Jinja template")):
        with pytest.raises(Exception, match=why):
            chat_template_from(bad)
    tok = load_tokenizer(argparse.Namespace(tokenizer=None, chat_template=template), str(tiny_llama_dir))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_tokenizer_from_another_directory_keeps_the_models_eos(make_model: Any, tiny_llama_dir: Path) -> None:
    other = make_model(seed=1)
    (other / "generation_config.json").unlink(missing_ok=True)
    tok = load_tokenizer(argparse.Namespace(tokenizer=str(other), chat_template=None), str(tiny_llama_dir))
    assert tok.source == str(other / "tokenizer.json")
    model_tok = load_tokenizer(argparse.Namespace(tokenizer=None, chat_template=None), str(tiny_llama_dir))
    assert tok.eos_token_ids == model_tok.eos_token_ids


def test_startup_line_names_every_choice() -> None:
    info = {
        "model_name": "tiny",
        "architecture": "LlamaForCausalLM",
        "model_dir": "/m",
        "dtype": "float32",
        "kernels": "native",
        "context_length": 2048,
        "num_pages": 128,
        "max_total_tokens": {"aggregated": 2048},
        "page_size": 16,
    }
    line = startup_line("aggregated", info, {"serving": "http://127.0.0.1:8000"}, False)
    assert line == (
        "kvfence aggregated: model tiny (LlamaForCausalLM, /m), dtype float32, kernels native, context 2048 tokens, "
        "KV pool 128 pages = 2048 tokens, page size 16, api key off, serving http://127.0.0.1:8000"
    )


def test_one_native_build_estimate_in_readme_help_and_log(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch.utils.cpp_extension as ext

    from kvfence.models import native_kernels

    assert NATIVE_BUILD_ESTIMATE in " ".join(README.read_text().split())
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert NATIVE_BUILD_ESTIMATE in " ".join(capsys.readouterr().out.split())

    def no_build(**kwargs: Any) -> Any:
        raise RuntimeError("not building in this test")

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path))  # nothing built there
    monkeypatch.setattr(ext, "load_inline", no_build)
    with caplog.at_level(logging.WARNING), pytest.raises(native_kernels.NativeKernelsUnavailable):
        native_kernels.load.__wrapped__(("-DKVFENCE_TEST_ONLY",))
    assert any(NATIVE_BUILD_ESTIMATE in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # a real `kvfence serve` process (~15 s)
def test_aggregated_says_what_it_loads_then_one_line_of_what_it_chose(tiny_llama_dir: Path) -> None:
    cmd = [sys.executable, "-m", "kvfence", "serve", str(tiny_llama_dir), "--role", "aggregated", "--port", "0"]
    cmd += ["--max-model-len", "256", "--page-size", "4", "--max-total-tokens", "512", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("serving http://" in x for x in lines):
            line = proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line.rstrip())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert lines and lines[0] == f"kvfence aggregated: loading {tiny_llama_dir}", lines
    (chose,) = [x for x in lines if x.startswith("kvfence aggregated: model ")]
    assert re.fullmatch(
        rf"kvfence aggregated: model {tiny_llama_dir.name} \(LlamaForCausalLM, {re.escape(str(tiny_llama_dir))}\), "
        r"dtype float32, kernels (native|torch), context 256 tokens, KV pool 128 pages = 512 tokens, page size 4, "
        r"api key off, serving http://127\.0\.0\.1:\d+",
        chose,
    ), chose


def test_disaggregated_serve_forwards_the_server_flags_but_never_the_key() -> None:
    from kvfence.commands.worker_main import launch_command_args

    values = {
        "--tokenizer": "/tok",
        "--chat-template": "/t.jinja",
        "--tool-call-parser": "llama3_json",
        "--max-grammar-bytes": "4096",
        "--grammar-compile-timeout-s": "2.0",
    }
    args = parse(*[x for kv in values.items() for x in kv], "--api-key", "sk-never-forwarded")
    common, prefill, decode = launch_command_args(args)
    for flag, value in values.items():
        assert common[common.index(flag) + 1] == value, flag
    assert not any("sk-never-forwarded" in x or x == "--api-key" for x in (*common, *prefill, *decode))
