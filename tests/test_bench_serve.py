"""`kvfence bench serve`: request building, metric arithmetic, and a short real run against a launched server."""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.bench import launch as bl
from kvfence.bench import serve as bs
from kvfence.bench.client import RequestResult, check_target

# ---- no server -------------------------------------------------------------------------------------------------


def test_length_spec_parses_fixed_and_ranges_and_refuses_nonsense() -> None:
    assert bs.LengthSpec.parse("128") == bs.LengthSpec(128, 128)
    spec = bs.LengthSpec.parse("4:9")
    rng = random.Random(0)
    draws = {spec.sample(rng) for _ in range(500)}
    assert draws == set(range(4, 10))
    for bad in ("0", "9:4", "x", "-3"):
        with pytest.raises(Exception, match="LOW:HIGH"):
            bs.LengthSpec.parse(bad)


def test_requests_are_reproducible_exact_length_and_skip_special_ids() -> None:
    kw = dict(seed=7, vocab_size=50, exclude_ids=frozenset(range(10)))
    a = bs.build_requests(30, bs.LengthSpec(5, 20), bs.LengthSpec(3, 6), **kw)
    b = bs.build_requests(30, bs.LengthSpec(5, 20), bs.LengthSpec(3, 6), **kw)
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
    assert all(len(r.prompt) == r.prompt_len and 5 <= r.prompt_len <= 20 for r in a)
    assert all(10 <= t < 50 for r in a for t in r.prompt)
    words = bs.build_requests(
        3, bs.LengthSpec(6, 6), bs.LengthSpec(1, 1), seed=0, vocab_size=None, dataset="random-words"
    )
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 for r in words)


def test_poisson_arrivals_have_the_requested_rate_and_inf_sends_at_once() -> None:
    assert bs.arrival_offsets(5, math.inf, 0) == [0.0] * 5
    t = bs.arrival_offsets(4000, 20.0, 1)
    assert t == sorted(t) and t[0] == 0.0
    mean_gap = t[-1] / (len(t) - 1)
    assert 0.045 < mean_gap < 0.055  # 1 / 20 req/s


def test_summary_follows_the_serving_benchmark_definitions() -> None:
    def result(ttft: float, latency: float, n: int) -> RequestResult:
        r = RequestResult(kind="bench", prompt_len=10, max_tokens=n, status=200, output_tokens=n, completed_stream=True)
        r.ttft, r.latency = ttft, latency
        r.itl = [(latency - ttft) / (n - 1)] * (n - 1)
        return r

    failed = RequestResult(kind="bench", prompt_len=10, max_tokens=4, status=400, error_code="context_length_exceeded")
    run = bs.TargetRun("a", "http://127.0.0.1:1", "url", duration_s=2.0)
    run.results = [result(0.1, 0.5, 5), result(0.3, 1.3, 11), failed]
    s = bs.summarize(run)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == {"400/context_length_exceeded": 1}
    assert s["request_throughput"] == pytest.approx(1.0)  # 2 completed / 2 s
    assert s["output_throughput"] == pytest.approx(8.0)  # 16 tokens / 2 s
    assert s["input_throughput"] == pytest.approx(10.0)  # failed requests' prompts do not count
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (1.3-0.3)/10
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["concurrency"] == pytest.approx(0.9)  # (0.5 + 1.3) / 2
    other = dict(s, request_throughput=0.5)
    assert bs.ratios(s, other)["request throughput (req/s)"] == pytest.approx(0.5)


def test_rounds_report_each_targets_median_the_ratio_of_medians_and_every_rounds_ratio() -> None:
    def run(label: str, throughput: float, ttft_ms: float) -> bs.TargetRun:
        r = bs.TargetRun(label, "http://127.0.0.1:1", "url", duration_s=1.0)
        r.summary = {"output_throughput": throughput, "ttft_ms": {"median": ttft_ms}}
        return r

    rounds = [
        [run("agg", 100.0, 20.0), run("disagg", 110.0, 20.0)],
        [run("agg", 80.0, 30.0), run("disagg", 100.0, 15.0)],
        [run("agg", 120.0, 10.0), run("disagg", 90.0, 40.0)],
    ]
    table = bs.format_rounds(rounds)
    assert table.startswith("median of 3 interleaved rounds")
    row = next(line for line in table.splitlines() if line.startswith("output throughput (tok/s)")).split()
    # medians 100 and 100 -> 1.00x; per round 1.10, 1.25, 0.75
    assert row[3:] == ["100.0", "100.0", "1.00x", "1.10", "1.25", "0.75"]
    ttft = next(line for line in table.splitlines() if line.startswith("TTFT median (ms)")).split()
    assert ttft[3:] == ["20.0", "20.0", "1.00x", "1.00", "0.50", "4.00"]
    tpot = next(line for line in table.splitlines() if line.startswith("TPOT median (ms)")).split()
    assert tpot[3:] == ["-", "-", "-", "-", "-", "-"]  # no numbers: said so, not made up
    assert bs.format_rounds(rounds[:1]) == ""  # one round: the round's own table says it all


def test_targets_must_be_loopback_unless_authorised() -> None:
    assert check_target("http://127.0.0.1:8000/", False) == "http://127.0.0.1:8000"
    assert check_target("http://localhost:8000", False) == "http://localhost:8000"
    with pytest.raises(ValueError, match="loopback"):
        check_target("http://10.1.2.3:8000", False)
    assert check_target("http://10.1.2.3:8000", True) == "http://10.1.2.3:8000"
    with pytest.raises(ValueError, match="http"):
        check_target("ftp://127.0.0.1", True)


def test_launch_kinds_are_flag_lists_kvfence_serve_accepts() -> None:
    from kvfence.cli import build_parser

    parsed = {kind: build_parser().parse_args(["serve", *args]) for kind, args in bl.LAUNCH_ARGS.items()}
    assert parsed["agg"].role == "aggregated" and not parsed["agg"].no_verify
    assert parsed["disagg"].role is None and not parsed["disagg"].no_verify  # no role: router + prefill + decode
    assert parsed["disagg-noverify"].role is None and parsed["disagg-noverify"].no_verify
    shapes = {k: (a.prefill_workers, a.decode_workers) for k, a in parsed.items() if k.startswith("disagg")}
    assert shapes == {
        "disagg": (1, 1),
        "disagg-noverify": (1, 1),
        "disagg-1x1": (1, 1),
        "disagg-2x1": (2, 1),
        "disagg-1x2": (1, 2),
        "disagg-2x2": (2, 2),
    }


# ---- against a launched aggregated server --------------------------------------------------------------------------

SERVER_ARGS = ("--context-length", "512", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def agg_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[bl.LaunchedServer]:
    log_dir = tmp_path_factory.mktemp("bench-serve")
    server = bl.launch_server(
        "agg", model=str(tiny_llama_dir), server_args=SERVER_ARGS, ready_timeout_s=120, log_dir=log_dir
    )
    try:
        yield server
    finally:
        server.stop()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bench_serve_cli_against_a_launched_server(
    agg_server: bl.LaunchedServer, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    bs.add_arguments(parser)
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = parser.parse_args(
        [
            *("--url", f"first={agg_server.url}", "--url", f"again={agg_server.url}"),
            *("--num-prompts", "20", "--input-len", "8:32", "--output-len", "4:12", "--max-concurrency", "8"),
            *("--request-rate", "200", "--tokenizer", str(tiny_llama_dir), "--warmup", "1"),
            *("--json", str(out_json), "--plot", str(out_png)),
        ]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "TTFT p99 (ms)" in table and "again/first" in table and "20/20" in table

    doc = json.loads(out_json.read_text())
    assert doc["baseline"] == "first" and [t["label"] for t in doc["targets"]] == ["first", "again"]
    for target in doc["targets"]:
        s = target["summary"]
        assert (s["completed"], s["failed"], s["cancelled"], s["not_sent"]) == (20, 0, 0, 0)
        assert target["eos_mode"] == "ignore_eos"
        requests = target["requests"]
        assert [r["max_tokens"] for r in requests] == [
            r.output_len
            for r in bs.build_requests(
                20, bs.LengthSpec(8, 32), bs.LengthSpec(4, 12), seed=0, vocab_size=None, dataset="random-words"
            )
        ]
        # ignore_eos works on kvfence: every request returned exactly the tokens it asked for
        assert all(r["output_tokens"] == r["max_tokens"] for r in requests)
        assert s["output_len_as_requested"] == 20
        assert s["total_output_tokens"] == sum(r["max_tokens"] for r in requests)
        assert all(r["prompt_tokens_reported"] == r["prompt_len"] for r in requests)
        assert all(0 < r["ttft"] <= r["latency"] for r in requests)
        assert all(len(r["itl"]) <= r["output_tokens"] - 1 for r in requests)
        assert s["ttft_ms"]["median"] <= s["e2e_ms"]["median"]
        assert s["request_throughput"] == pytest.approx(20 / s["duration_s"])
        assert s["output_throughput"] > 0 and s["input_throughput"] > 0
    assert doc["targets"][1]["ratios_vs_baseline"]["request throughput (req/s)"] > 0
    width, height = _png_size(out_png)
    assert width >= 400 and height >= 300


def test_bench_serve_rounds_run_every_target_each_round(
    agg_server: bl.LaunchedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    bs.add_arguments(parser)
    out_json = tmp_path / "rounds.json"
    argv = ["--url", f"a={agg_server.url}", "--url", f"b={agg_server.url}", "--num-prompts", "4", "--rounds", "2"]
    args = parser.parse_args([*argv, "--warmup", "1", "--json", str(out_json)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "## round 1/2" in out and "## round 2/2" in out and "median of 2 interleaved rounds" in out
    doc = json.loads(out_json.read_text())
    assert [[t["label"] for t in r["targets"]] for r in doc["rounds"]] == [["a", "b"], ["a", "b"]]
    assert all(t["summary"]["completed"] == 4 for r in doc["rounds"] for t in r["targets"])


@pytest.mark.slow
def test_bench_serve_launches_each_kind(tiny_llama_dir: Path) -> None:
    cfg = bs.BenchConfig(
        num_prompts=12,
        input_len=bs.LengthSpec(16, 16),
        output_len=bs.LengthSpec(8, 8),
        tokenizer_dir=str(tiny_llama_dir),
    )
    runs, skipped = bs.run_bench(cfg, launch=bl.LAUNCH_KINDS, model_dir=str(tiny_llama_dir), server_args=SERVER_ARGS)
    assert skipped == []
    assert [r.label for r in runs] == list(bl.LAUNCH_KINDS)
    assert [r.how.split()[:2] for r in runs] == [["kvfence", "serve"]] * len(runs)
    for r in runs:
        assert r.summary["completed"] == 12 and r.summary["total_output_tokens"] == 12 * 8
    statuses = {r.label: set(r.summary["integrity"]) for r in runs}
    assert statuses["disagg"] == {"verified"}
    assert statuses["disagg-noverify"] == {"unverified"}
    table = bs.format_table(runs, skipped)
    for r in runs[1:]:
        assert f"{r.label}/{runs[0].label}" in table


def test_shared_prefix_fraction_gives_every_prompt_the_same_leading_tokens() -> None:
    from kvfence.bench.serve import LengthSpec, build_requests

    reqs = build_requests(4, LengthSpec(50, 50), LengthSpec(4, 4), seed=1, vocab_size=1000, shared_prefix_fraction=0.9)
    heads = {tuple(r.prompt[:45]) for r in reqs}  # type: ignore[index]
    tails = {tuple(r.prompt[45:]) for r in reqs}  # type: ignore[index]
    assert len(heads) == 1 and len(tails) == 4 and all(len(r.prompt) == 50 for r in reqs)
    plain = build_requests(4, LengthSpec(50, 50), LengthSpec(4, 4), seed=1, vocab_size=1000)
    assert len({tuple(r.prompt[:45]) for r in plain}) == 4  # type: ignore[index]


def test_prefix_groups_give_prompt_i_the_prefix_of_group_i_mod_n() -> None:
    from kvfence.bench.serve import LengthSpec, build_requests

    one = build_requests(6, LengthSpec(50, 50), LengthSpec(4, 4), seed=1, vocab_size=1000, shared_prefix_fraction=0.9)
    reqs = build_requests(
        6, LengthSpec(50, 50), LengthSpec(4, 4), seed=1, vocab_size=1000, shared_prefix_fraction=0.9, prefix_groups=3
    )
    heads = [tuple(r.prompt[:45]) for r in reqs]  # type: ignore[index]
    assert heads[:3] == heads[3:] and len(set(heads)) == 3
    assert heads[0] == tuple(one[0].prompt[:45])  # type: ignore[index]  # group 0 is the one-group prefix
