"""scripts/gpu_check.py without a GPU: its arguments, and that it refuses cleanly (exit 2, one line, the reason in
its results file) where CUDA is not available. What it measures on a GPU is not testable here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_default_to_every_step_and_the_issues_batches() -> None:
    gc = load()
    args = gc.parse_args([])
    assert args.steps == list(gc.STEPS) and args.batches == [1, 64, 256] and args.device == "cuda"
    args = gc.parse_args(["--steps", "oracle, faults", "--batches", "2,8", "--out", "x.json"])
    assert args.steps == ["oracle", "faults"] and args.batches == [2, 8] and args.out == Path("x.json")
    assert set(gc.STEP_FUNCS) == set(gc.STEPS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "oracle,warp"], "unknown step"),
        (["--batches", "1,x"], "comma-separated integers"),
        (["--batches", "0"], "positive integers"),
        (["--budget-s", "0"], "--budget-s must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        load().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_refuses_in_one_line_and_says_why_in_its_file(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().count("\n") == 0 and "CUDA is not available" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    results = json.loads(out.read_text())
    assert results["ok"] is False and "CUDA is not available" in results["refused"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_that_is_not_cuda_is_refused() -> None:
    gc = load()
    with pytest.raises(gc.CheckRefused, match="CUDA is not available"):
        gc.require_cuda("cuda:0")
