"""`kvfence bench offline`: a short real run prints one row per system with ratios, and bad arguments exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfence.cli import main


def test_short_run_prints_every_system_with_a_ratio(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "offline", "--model", str(tiny_llama_dir), "--num-prompts", "3", "--input-len", "6"]
    rc = main([*argv, "--output-len", "5", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "3 requests x (6 prompt + 5 output) tokens" in out and "kvfence kernels " in out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()[3:]}
    assert set(rows) == {"kvfence", "transformers generate", "transformers generate_batch"}
    for name in ("transformers generate", "transformers generate_batch"):
        ratio, same = rows[name].split()[-2:]
        assert re.fullmatch(r"\d+\.\d\dx", ratio) and float(ratio[:-1]) > 0
        assert re.fullmatch(r"\d/3", same)
    assert rows["kvfence"].split()[1] == "3"  # requests column


def test_unpacked_baseline_is_our_engine_on_f_linear(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "offline", "--model", str(tiny_llama_dir), "--num-prompts", "2", "--input-len", "5"]
    assert main([*argv, "--output-len", "4", "--repeats", "1", "--baselines", "unpacked"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("kvfence, F.linear projections")]
    assert row.split()[-1] == "2/2"  # same greedy tokens: only the kernel differs


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--baselines", "sglang"], "unknown baseline"),
        (["--contention", "-1"], "--contention"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], bad: list[str], message: str
) -> None:
    rc = main(["bench", "offline", "--model", str(tiny_llama_dir), *bad])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
