"""The handoff benchmark runs end to end on tiny sizes and registers as `bench handoff`."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvfence.bench.handoff import check_device, format_table, register, run_handoff_bench
from kvfence.errors import KvfenceError


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_bench_runs_on_tiny_sizes_and_reports_ratios(processes: bool) -> None:
    r = run_handoff_bench(
        num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16, repeats=1, processes=processes,
        verbose=False,
    )  # fmt: skip
    assert r["total_bytes"] == 16 * 2 * 2 * 4 * 2 * 16 * 2
    assert r["mode"] == ("two processes" if processes else "two threads")
    assert all(v > 0 for v in r["gb_per_s"].values())
    assert r["tcp_vs_raw"] > 0 and r["verify_vs_transfer"] > 0
    table = format_table(r)
    assert "raw socket copy (baseline)" in table and "x raw throughput" in table


def test_device_paths_on_cpu_pools_use_mlh62_and_time_both_digests() -> None:
    r = run_handoff_bench(
        num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, repeats=1, processes=False,
        verbose=False, device_paths=True,
    )  # fmt: skip
    assert r["digest_algorithm"] == "mlh62" and r["device"] == "cpu (device paths)"
    assert {"digest_xxh3_64", "digest_mlh62", "verify_xxh3_64", "verify_mlh62"} <= set(r["seconds"])
    assert r["mlh_vs_xxh3_digest"] > 0
    assert "digests only, mlh62" in format_table(r) and "verify on decode, xxh3_64" in format_table(r)


def test_a_device_this_machine_lacks_is_refused_in_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(KvfenceError, match="no CUDA device is available"):
        check_device("cuda")
    with pytest.raises(KvfenceError, match="not a torch device"):
        check_device("nonsense")


def test_register_adds_a_handoff_parser() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["handoff", "--num-pages", "8", "--repeats", "1", "--threads"])
    assert args.bench == "handoff" and args.num_pages == 8 and args.threads and callable(args.func)
