"""`kvfence generate`: prints the completion, and turns bad input into one line on stderr with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvfence.cli import main
from kvfence.config import EngineConfig, ModelConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prints_the_greedy_completion(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--model", str(tiny_llama_dir), "--prompt", "the cache page", "--max-tokens", "12")
    engine = LLMEngine(EngineConfig(ModelConfig(str(tiny_llama_dir))))
    (want,) = engine.generate(["the cache page"], SamplingParams(temperature=0, max_tokens=12))
    assert rc == 0
    assert out == want.text + "\n"
    assert f"+ {len(want.token_ids)} output tokens" in err and f"finish_reason={want.finish_reason}" in err


def test_same_seed_same_sampled_output(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(tiny_llama_dir), "--prompt", "hello", "--max-tokens", "16", "--temperature", "1.0"]
    a = _run(capsys, *args, "--seed", "7")
    b = _run(capsys, *args, "--seed", "7")
    c = _run(capsys, *args, "--seed", "8")
    assert a[0] == b[0] == c[0] == 0
    assert a[1] == b[1] and a[1] != c[1]


def test_chat_flag_uses_the_chat_template(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "--model", str(tiny_llama_dir), "--prompt", "hi", "--chat", "--max-tokens", "4")
    plain_rc, _, plain_err = _run(capsys, "--model", str(tiny_llama_dir), "--prompt", "hi", "--max-tokens", "4")
    assert rc == plain_rc == 0
    n_chat = int(err.split("kvfence: ")[-1].split(" prompt")[0])
    n_plain = int(plain_err.split("kvfence: ")[-1].split(" prompt")[0])
    assert n_chat > n_plain  # the template adds the role markers around the prompt


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens: must be a positive integer, got 0"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature: must be >= 0"),
        (["--prompt", "the cache " * 1200], "the context length is 2048 tokens"),
        (["--prompt", "hi", "--max-total-tokens", "512"], "raise --max-total-tokens to at least 2048"),
        (["--prompt", "hi", "--page-size", "0"], "page_size (--page-size) must be a positive integer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, out, err = _run(capsys, "--model", str(tiny_llama_dir), *argv)
    assert rc == 2 and out == ""
    assert err.startswith("kvfence: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unknown_model_directory_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"kvfence: error: model directory {tmp_path / 'nope'} does not exist\n"


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ["--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat"]:
        assert flag in out
    for flag in ["--page-size", "--max-total-tokens", "--chunked-prefill-size", "--context-length"]:
        assert flag in out
    assert "built-in tiny random model" in out


def test_no_flags_uses_the_default_model(kvfence_cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvfence generate --prompt hello` on a fresh machine: builds the default model, then generates."""
    rc, out, err = _run(capsys, "--prompt", "hello", "--max-tokens", "5")
    assert rc == 0 and out.strip()
    assert "building the built-in default model" in err
    assert (kvfence_cache_dir / "models" / "kvfence-tiny-llama" / "config.json").is_file()
    rc, out2, err2 = _run(capsys, "--prompt", "hello", "--max-tokens", "5")  # second run: no rebuild
    assert rc == 0 and out2 == out and "building" not in err2
