"""`kvfence bench soak`: the verdict logic, and soaks against a launched aggregated server (short; long = slow)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.bench import launch as bl
from kvfence.bench import soak
from kvfence.bench.client import RequestResult

# ---- the verdict, without a server ---------------------------------------------------------------------------


def test_mix_parses_and_draws_every_kind_in_proportion() -> None:
    mix = soak.SoakMix.parse("normal=2,abort=1")
    assert mix == soak.SoakMix(2.0, 0.0, 1.0)
    rng = random.Random(0)
    draws = [mix.draw(rng) for _ in range(3000)]
    assert "overlength" not in draws
    assert 0.6 < draws.count("normal") / len(draws) < 0.73
    with pytest.raises(Exception, match="weights"):
        soak.SoakMix.parse("normal=1,bogus=2")


def test_judge_counts_5xx_non_400_overlength_and_integrity_failures() -> None:
    def r(kind: str, status: int | None, code: str | None = None, **kw: object) -> RequestResult:
        x = RequestResult(kind=kind, prompt_len=8, max_tokens=4, status=status, error_code=code, **kw)  # type: ignore[arg-type]
        x.completed_stream = status == 200
        return x

    results = [
        r("normal", 200, integrity={"status": "verified", "reason": None}, output_tokens=4, prompt_tokens_reported=8),
        r("normal", 200, integrity={"status": "rejected", "reason": "digest_mismatch"}, output_tokens=4),
        r("normal", 500, "engine_error"),
        r("normal", 200, output_tokens=4, prompt_tokens_reported=7),  # the server counted a different prompt
        r("overlength", 400, "context_length_exceeded"),
        r("overlength", 200),  # an over-length prompt that was served
        r("abort", 200, aborted=True),
        r("normal", None, "ReadTimeout"),
    ]
    report = soak.SoakReport("http://127.0.0.1:1", {"clients": 1})
    soak._judge(report, results)
    assert report.five_xx == 1 and report.transport_errors == 1 and report.aborted == 1
    assert report.integrity == {"verified": 1, "rejected": 1}
    assert [rec["reason"] for rec in report.integrity_failures] == ["digest_mismatch"]
    assert report.overlength_unexpected == ["8 tokens -> 200"]
    assert report.normal_unexpected == ["sent 8 tokens, usage says 7"]
    assert report.statuses["overlength"] == {"400/context_length_exceeded": 1, "200": 1}


# ---- against a launched aggregated server --------------------------------------------------------------------

SERVER_ARGS = ("--context-length", "256", "--max-total-tokens", "2048")


@pytest.fixture(scope="module")
def agg_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[bl.LaunchedServer]:
    server = bl.launch_server(
        "agg",
        model=str(tiny_llama_dir),
        server_args=SERVER_ARGS,
        ready_timeout_s=120,
        log_dir=tmp_path_factory.mktemp("soak"),
    )
    try:
        yield server
    finally:
        server.stop()


def _check(report: soak.SoakReport) -> None:
    assert report.requests.get("normal", 0) > 0 and report.requests.get("overlength", 0) > 0
    assert report.requests.get("abort", 0) > 0 and report.aborted > 0
    assert report.five_xx == 0, report.format()
    assert report.transport_errors == 0 and report.stream_errors == 0, report.format()
    assert report.overlength_unexpected == [], report.format()
    assert report.integrity_failures == [], report.format()
    assert report.baseline_pages, "the server reported no KV page numbers"
    assert report.final_pages == report.baseline_pages, report.format()
    assert max(report.max_pages.values()) > 0, "the load never used a KV page: the soak did not soak"
    assert report.rss_baseline is not None and report.rss_growth_mb is not None
    assert report.ok, report.format()


@pytest.mark.slow  # a launched server under load for seconds; the judge and the mix are unit-tested above
def test_short_soak_leaves_the_server_clean(agg_server: bl.LaunchedServer) -> None:
    report = soak.run_soak(agg_server.url, clients=4, duration_s=15, pids=agg_server.pids, sample_interval_s=0.5)
    _check(report)
    assert report.rss_source in ("server_info", "/proc")
    assert report.statuses["overlength"] == {"400/context_length_exceeded": report.requests["overlength"]}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_long_soak_16_clients_10_minutes(agg_server: bl.LaunchedServer) -> None:
    report = soak.run_soak(agg_server.url, clients=16, duration_s=600, pids=agg_server.pids, max_rss_growth_mb=256)
    print(report.format())  # with -s: the numbers of the long run
    _check(report)


# ---- disaggregated (three processes: slower to start) --------------------------------------------------------


@pytest.mark.slow
def test_disagg_soak_is_clean_and_every_response_is_verified(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with bl.launch_server("disagg", model=str(tiny_llama_dir), server_args=SERVER_ARGS, log_dir=tmp_path) as server:
        report = soak.run_soak(server.url, clients=4, duration_s=10, pids=server.pids)
    _check(report)
    assert set(report.baseline_pages) == {"prefill", "decode"}
    assert set(report.integrity) == {"verified"}


@pytest.mark.slow
def test_soak_fails_a_deployment_that_corrupts_kv_in_flight(tiny_llama_dir: Path, tmp_path: Path) -> None:
    args = (*SERVER_ARGS, "--inject-fault", "corrupt_byte")
    with bl.launch_server("disagg", model=str(tiny_llama_dir), server_args=args, log_dir=tmp_path) as server:
        report = soak.run_soak(server.url, clients=2, duration_s=5, pids=server.pids)
    assert not report.ok
    assert report.integrity_failures and {r["reason"] for r in report.integrity_failures} == {"digest_mismatch"}
    assert report.five_xx > 0
    assert report.overlength_unexpected == []  # admission still refuses over-length prompts
    assert report.final_pages == report.baseline_pages  # failed handoffs still give their pages back
