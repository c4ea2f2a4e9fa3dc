"""The llama.cpp baseline: its output parsing, agreement rule, commands, the missing-build path, one real run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from kvfence.bench import llama_cpp as lc
from kvfence.bench import serve as bs
from kvfence.cli import main

# Lines in the formats tools/batched-bench/batched-bench.cpp prints (its LOG calls for the markdown header,
# rule and rows, and for --output-format jsonl), taken from tools/batched-bench/README.md of llama-cpp-python
# 0.3.36's vendored llama.cpp.
MARKDOWN = """
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, is_tg_separate = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.108 |  1186.64 |    3.079 |    41.57 |    3.187 |    80.32 |
|   128 |    128 |    8 |   2048 |    0.751 |  1363.27 |    7.344 |   139.43 |    8.095 |   252.99 |
"""
JSONL = (
    '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": 99, '
    '"n_threads": 8, "n_threads_batch": 8, "pp": 128, "tg": 128, "pl": 1, "n_kv": 256, "t_pp": 0.233810, '
    '"speed_pp": 547.453064, "t_tg": 3.503684, "speed_tg": 36.532974, "t": 3.737494, "speed": 68.495094}'
)


def test_markdown_rows_parse_and_header_and_rule_do_not() -> None:
    rows = lc.parse_batched_bench(MARKDOWN)
    assert [(r.pp, r.tg, r.pl, r.n_kv) for r in rows] == [(128, 128, 1, 256), (128, 128, 8, 2048)]
    assert rows[1].t_pp == pytest.approx(0.751) and rows[1].speed_tg == pytest.approx(139.43)


def test_jsonl_line_parses_among_log_lines() -> None:
    (row,) = lc.parse_batched_bench(f"llama_context: constructing\n{JSONL}\nmain: done\n")
    assert (row.pp, row.tg, row.pl) == (128, 128, 1)
    assert row.t_pp == pytest.approx(0.23381) and row.speed == pytest.approx(68.495094)


def test_agreement_counts_equal_tokens_up_to_end_of_generation() -> None:
    eog = frozenset({2})
    ours = [[5, 6, 7], [5, 2, 9], [5, 6, 7], [8, 8, 8]]
    theirs = [[5, 6, 7], [5], [5, 6], [8, 8, 1]]
    # equal; equal before eog (llama.cpp stopped at it); llama.cpp stopped early without eog; last token differs
    assert lc.agreement(ours, theirs, eog) == lc.Agreement(same=2, total=4, first_mismatch=2)


def test_agreement_refuses_different_request_counts() -> None:
    with pytest.raises(ValueError, match="2 outputs of ours vs 1"):
        lc.agreement([[1], [2]], [[1]], frozenset())


def test_commands_use_llama_cpp_defaults_or_fp32_kv_the_threads_and_the_workload_shape(tmp_path: Path) -> None:
    build = lc.build_location(cache=tmp_path)
    bench = lc.batched_bench_command(build, tmp_path / "m.gguf", 8, 128, 127, 2)
    flags = dict(zip(bench[1::2], bench[2::2], strict=False))
    assert bench[0].endswith("bin/llama-batched-bench")
    # 255 tokens a sequence, in whole 256-token blocks
    assert (flags["-npp"], flags["-ntg"], flags["-npl"], flags["-c"]) == ("128", "127", "8", str(8 * 256))
    assert (flags["-t"], flags["-tb"], flags["-ctk"], flags["-ctv"], flags["-fa"]) == ("2", "2", "f16", "f16", "auto")
    same = lc.batched_bench_command(build, tmp_path / "m.gguf", 8, 128, 127, 2, kv_type="f32", flash_attn="off")
    same_flags = dict(zip(same[1::2], same[2::2], strict=False))
    assert (same_flags["-ctk"], same_flags["-ctv"], same_flags["-fa"]) == ("f32", "f32", "off")
    server = lc.server_command(
        build, tmp_path / "m.gguf", host="127.0.0.1", port=1234, parallel=4, context_per_slot=300, threads=2
    )
    assert server[0].endswith("bin/llama-server")
    assert server[server.index("-np") + 1] == "4" and server[server.index("-c") + 1] == "1200"
    assert server[server.index("-fa") + 1] == "auto"  # llama.cpp's own default: serving is timed at its best
    fp32 = lc.server_command(
        build, tmp_path / "m.gguf", host="h", port=1, parallel=1, context_per_slot=8, threads=2, flash_attn="off"
    )
    assert fp32[fp32.index("-fa") + 1] == "off"  # the agreement check's attention in fp32, as kvfence's
    assert (fp32[fp32.index("-ctk") + 1], fp32[fp32.index("-ctv") + 1]) == ("f32", "f32")
    bf16 = lc.server_command(
        build, tmp_path / "m.gguf", host="h", port=1, parallel=1, context_per_slot=8, threads=2, kv_type="bf16"
    )
    assert (bf16[bf16.index("-ctk") + 1], bf16[bf16.index("-ctv") + 1]) == ("bf16", "bf16")


def test_setup_does_nothing_when_already_built(kvfence_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = lc.build_location()
    (build.build_dir / "bin").mkdir(parents=True)
    for target in lc.TARGETS:
        build.binary(target).write_text("#!/bin/sh\n")
        build.binary(target).chmod(0o755)
    assert lc.find_build() is None  # binaries without the stamp of a finished setup do not count
    build.stamp("llama-batched-bench").write_text("{}")
    assert lc.find_build(targets=["llama-batched-bench"]) == build and lc.find_build() is None
    build.stamp("llama-server").write_text("{}")

    def no_subprocess(*a: object, **k: object) -> None:
        raise AssertionError("setup ran a command although the build is there")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    said: list[str] = []
    assert lc.setup(say=said.append) == build and lc.find_build() == build
    assert said == [f"llama.cpp {lc.LLAMA_CPP_PYTHON_VERSION} is already built in {build.root}"]


def test_offline_without_a_build_says_how_to_make_one_and_still_runs(
    tiny_llama_dir: Path, kvfence_cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "offline", "--model", str(tiny_llama_dir), "--num-prompts", "2", "--input-len", "4"]
    assert main([*argv, "--output-len", "3", "--repeats", "1", "--baselines", "llama.cpp"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp baseline skipped: no llama.cpp build at" in out and lc.SETUP_COMMAND in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"(kvfence|llama\.cpp)\s+\d", line)]
    assert rows == ["kvfence"]  # the table has our row and no llama.cpp row


@pytest.mark.parametrize(
    "bad, message",
    [(["--dtype", "bfloat16"], "compares float32"), (["--output-len", "1"], "--output-len >= 2")],
)
def test_offline_llama_cpp_bad_arguments_exit_2(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], bad: list[str], message: str
) -> None:
    rc = main(["bench", "offline", "--model", str(tiny_llama_dir), "--baselines", "llama.cpp", *bad])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_serve_accepts_the_llama_cpp_kind_and_skips_it_without_a_build(
    tiny_llama_dir: Path, kvfence_cache_dir: Path
) -> None:
    assert bs._launch_list("agg,llama.cpp") == ["agg", "llama.cpp"]
    cfg = bs.BenchConfig(num_prompts=2, tokenizer_dir=str(tiny_llama_dir))
    runs, skipped = bs.run_bench(cfg, launch=["llama.cpp"], model_dir=str(tiny_llama_dir), log=lambda m: None)
    assert runs == [] and len(skipped) == 1
    label, reason = skipped[0]
    assert label == "llama.cpp" and lc.SETUP_COMMAND in reason


def test_setup_subcommand_is_registered() -> None:
    from kvfence.cli import build_parser

    args = build_parser().parse_args(["bench", "llama-cpp-setup", "--model", "kvfence-tiny-llama"])
    assert args.func is lc._setup_main and args.model == ["kvfence-tiny-llama"] and args.jobs == 2


@pytest.mark.slow
def test_real_llama_cpp_agrees_with_kvfence_on_the_tiny_model(make_model) -> None:
    """Needs `kvfence bench llama-cpp-setup` to have run (in the real cache): converts, benches, compares."""
    build = lc.find_build()
    if build is None:
        pytest.skip(lc.missing_message(lc.build_location()))
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports it: pip install 'kvfence[bench]'")
    import httpx

    from kvfence.bench.offline import _prompts, run_kvfence
    from kvfence.config import EngineConfig, ModelConfig
    from kvfence.engine.llm_engine import LLMEngine

    model_dir = make_model()
    gguf = lc.ensure_gguf(model_dir, build)
    row = lc.run_batched_bench(build, gguf, 2, 16, 7, 2)
    assert (row.pp, row.tg, row.pl) == (16, 7, 2) and row.speed_pp > 0 and row.speed_tg > 0

    engine = LLMEngine(EngineConfig(ModelConfig(str(model_dir))))
    prompts = _prompts(4, 16, engine.vocab_size, seed=0)
    ours = run_kvfence(engine, prompts, 8)
    text = "The cache pages are verified by digest 1234, twice!"
    with lc.launch_server(build, gguf, parallel=1, context_per_slot=64, threads=2, ready_timeout_s=120) as server:
        theirs = lc.greedy_tokens(server.url, prompts, 8)
        tokenized = httpx.post(f"{server.url}/tokenize", json={"content": text}).json()["tokens"]
    assert lc.agreement(ours.outputs, theirs, frozenset(engine.tokenizer.eos_token_ids)).same == 4
    assert tokenized == engine.tokenizer.encode(text, add_special_tokens=False)  # the "gpt-2" pre-tokenizer fits
    assert os.access(build.server, os.X_OK)


def test_offline_reports_a_failed_llama_cpp_repeat_and_keeps_going(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfence.bench import offline

    class NoServer:
        def has(self, target: str) -> bool:
            return False

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("llama-batched-bench exited 0 with 0 result rows:\nlast log line")

    monkeypatch.setattr(lc, "find_build", lambda **k: NoServer())
    monkeypatch.setattr(lc, "ensure_gguf", lambda *a: tiny_llama_dir / "m.gguf")
    monkeypatch.setattr(offline, "run_llama_cpp", fails)
    argv = ["bench", "offline", "--model", str(tiny_llama_dir), "--num-prompts", "2", "--input-len", "4"]
    assert main([*argv, "--output-len", "3", "--repeats", "2", "--baselines", "llama.cpp"]) == 0
    out = capsys.readouterr().out
    assert f"{offline.LLAMA_DEFAULTS}, repeat 1: llama-batched-bench exited 0 with 0 result rows: | last log" in out
    assert f"{offline.LLAMA_SAME_MATH}, repeat 2:" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"(kvfence|llama\.cpp)\s+\d", line)]
    assert rows == ["kvfence"]


def _fake_batched_bench(tmp_path: Path, outputs: list[str]) -> lc.LlamaCppBuild:
    """A build whose llama-batched-bench prints outputs[i] on its i-th run (exit 0), then the last one again."""
    build = lc.LlamaCppBuild("test", tmp_path)
    script = build.batched_bench
    script.parent.mkdir(parents=True)
    for i, text in enumerate(outputs):
        (tmp_path / f"out{i}").write_text(text)
    script.write_text(
        "#!/bin/sh\n"
        f'd="{tmp_path}"; n=$(cat "$d/count" 2>/dev/null || echo 0); echo $((n + 1)) > "$d/count"\n'
        f'[ -f "$d/out$n" ] || n={len(outputs) - 1}; cat "$d/out$n"\n'
    )
    script.chmod(0o755)
    return build


def test_a_batched_bench_run_that_prints_nothing_is_retried(tmp_path: Path) -> None:
    build = _fake_batched_bench(tmp_path, ["", "", JSONL])
    row = lc.run_batched_bench(build, tmp_path / "m.gguf", 1, 128, 128, 2)
    assert row.speed_tg == pytest.approx(36.532974)
    assert (tmp_path / "count").read_text().strip() == "3"


def test_a_batched_bench_run_that_prints_no_row_is_not_retried_forever(tmp_path: Path) -> None:
    build = _fake_batched_bench(tmp_path, ["", "main: skipped a shape\n"])
    with pytest.raises(RuntimeError, match="0 result rows"):
        lc.run_batched_bench(build, tmp_path / "m.gguf", 1, 128, 128, 2)
    assert (tmp_path / "count").read_text().strip() == "2"  # a run that printed something is an answer
