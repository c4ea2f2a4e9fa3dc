"""lm-evaluation-harness against `kvfence serve`: the same scores as lm-eval on transformers, same weights.

The task (tests/data/lm_eval: a multiple-choice loglikelihood task and a generate_until task over one
JSONL file) runs three times with lm-eval 0.4.13: on its `hf` model (transformers loading the tiny
random Llama's directory), and on its `local-completions` model against `kvfence serve` aggregated and
disaggregated (router + prefill + decode processes). lm-eval tokenizes with the same directory
(`tokenizer_backend=huggingface`, offline), sends token-id prompts, and scores loglikelihood from
/v1/completions with echo, logprobs=1, max_tokens=1. Metrics must be equal, every sample's
loglikelihoods equal within float32 noise and its is-greedy flag and generated text identical.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.serve import OFFLINE, kvfence_serve

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
TASKS = "kvfence_tiny_mc,kvfence_tiny_gen"


def lm_eval(out: Path, model: str, model_args: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Run lm-eval from the repository root; (aggregated results, per-task samples by doc id)."""
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASKS,
        "--include_path",
        "tests/data/lm_eval",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (results_file,) = glob.glob(str(out / "*" / "results_*.json"))
    samples = {}
    for f in glob.glob(str(out / "*" / "samples_*.jsonl")):
        task = Path(f).name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in open(f)), key=lambda s: s["doc_id"])
    return json.loads(Path(results_file).read_text())["results"], samples


@pytest.fixture(scope="module")
def hf_run(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return lm_eval(tmp_path_factory.mktemp("lm-eval-hf"), "hf", f"pretrained={tiny_llama_dir},dtype=float32")


@pytest.mark.slow  # ~1-2 min per mode: lm-eval and kvfence serve start fresh interpreters
@pytest.mark.parametrize("role", ["aggregated", "disaggregated"])
def test_lm_eval_scores_equal_transformers(role: str, tiny_llama_dir: Path, tmp_path: Path, hf_run: Any) -> None:
    flags = ("--role", "aggregated") if role == "aggregated" else ()
    with kvfence_serve(tiny_llama_dir, tmp_path / "serve.log", *flags) as url:
        args = (
            f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_llama_dir},num_concurrent=1,max_retries=1"
        )
        results, samples = lm_eval(tmp_path / "out", "local-completions", args)
    want_results, want_samples = hf_run
    for task in ("kvfence_tiny_mc", "kvfence_tiny_gen"):
        metrics = {k: v for k, v in results[task].items() if k.endswith(",none") and "stderr" not in k}
        want = {k: v for k, v in want_results[task].items() if k.endswith(",none") and "stderr" not in k}
        assert metrics == want and metrics, (task, metrics, want)
        assert len(samples[task]) == len(want_samples[task]) == 8
        for got, exp in zip(samples[task], want_samples[task], strict=True):
            if task == "kvfence_tiny_mc":
                pairs = zip(
                    got["filtered_resps"], exp["filtered_resps"], strict=True
                )  # one [logprob, is_greedy] a choice
                for (lp, greedy), (want_lp, want_greedy) in pairs:
                    assert float(lp) == pytest.approx(float(want_lp), abs=1e-4) and greedy == want_greedy
            else:
                assert got["filtered_resps"] == exp["filtered_resps"], got["doc"]
