"""End-to-end throughput of disaggregated serving with KV verification on vs off, in one run.

What it knows: how to start two deployments side by side (each a prefill and a decode
worker process over TCP, one with verification on and one with `--no-verify`), each
behind its own `Router` in this process, and how to drive them with the same seeded
batch of greedy requests, alternating rounds (on, off, on, off, ...) so drift of the
machine hits both alike. It reports requests/s and output tokens/s per round, their
medians, the overhead of verification (paired per round, in throughput and in the CPU time
the two workers used), and checks that both modes produce the same
tokens and that every request ended verified (resp. unverified).

What it does not know: HTTP (the router is called directly; the HTTP layer is the same
for both modes) or the verification itself. Note: with verification off, prefill still
builds its manifest (digests and canaries); the difference measured is decode's check.

    python -m kvfence.bench.handoff_e2e --num-requests 32 --input-len 256 --output-len 16 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfence.auth.curve import for_key as curve_keys
from kvfence.auth.keys import ENV_KEY, ClusterKey
from kvfence.disagg import messages as P
from kvfence.disagg.launcher import free_port
from kvfence.disagg.router import Router, RouterConfig
from kvfence.engine.sampling_params import SamplingParams

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Deployment:
    """A prefill + decode worker pair (child processes) registered with a Router in this process."""

    def __init__(self, model_dir: str, worker_args: list[str], verify: bool, log_dir: Path) -> None:
        self.verify = verify
        key = ClusterKey.generate()  # the workers get it in their environment, as `kvfence serve` gives it
        self.hub = P.ZmqHub("127.0.0.1", 0, curve=curve_keys(key))
        self.router = Router(self.hub, RouterConfig(handoff_deadline_s=120, request_timeout_s=600), auth=key.describe())
        base = [sys.executable, "-m", "kvfence.commands.worker_main", "--model", model_dir, *worker_args]
        base += ["--router-address", self.hub.address, "--log-level", "warning", "--exit-with-parent"]
        decode = ["--role", "decode", "--handoff-port", str(free_port())] + ([] if verify else ["--no-verify"])
        name = "on" if verify else "off"
        self.logs = [open(log_dir / f"{name}-{r}.log", "wb") for r in ("prefill", "decode")]  # noqa: SIM115
        env = {**os.environ, ENV_KEY: key.to_hex()}
        self.procs = [
            subprocess.Popen([*base, "--role", "prefill"], stdout=self.logs[0], stderr=subprocess.STDOUT, env=env),
            subprocess.Popen([*base, *decode], stdout=self.logs[1], stderr=subprocess.STDOUT, env=env),
        ]

    def cpu_seconds(self) -> float:
        """User + system CPU time the two worker processes used so far (0.0 where /proc is not available).

        Unlike wall time, this hardly moves when other jobs load the machine, so the on/off
        ratio of CPU time per round isolates the work verification adds.
        """
        total = 0.0
        for p in self.procs:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
        return total

    def wait(self) -> None:
        self.router.wait_for_workers(timeout=300)
        self.router.start()

    def close(self) -> None:
        self.router.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()


@dataclass(frozen=True)
class RoundResult:
    mode: str
    round: int
    seconds: float
    verify_seconds: float  # decode's verification time, summed over the round's handoffs (from the records)
    cpu_seconds: float  # CPU time of the prefill and decode processes during the round
    requests: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float


async def _drive(router: Router, reqs: list[tuple[str, list[int], SamplingParams]], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def one(rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], Any]:
        async with sem:
            toks: list[int] = []
            last = None
            async for chunk in router.generate(rid, prompt, sp):
                toks += chunk.token_ids
                last = chunk
            return toks, last

    results = await asyncio.gather(*[one(*r) for r in reqs])
    return {r[0]: res for r, res in zip(reqs, results, strict=True)}


def make_requests(n: int, input_len: int, output_len: int, seed: int, tag: str) -> list:
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    return [(f"{tag}-{i}", [rng.randrange(10, 2000) for _ in range(input_len)], sp) for i in range(n)]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvfence.config import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    worker_args = ["--context-length", str(args.context_length), "--max-total-tokens", str(args.max_total_tokens)]
    log_dir = Path(tempfile.mkdtemp(prefix="kvfence-bench-e2e-"))
    deps = {"verify_on": Deployment(model_dir, worker_args, True, log_dir)}
    deps["verify_off"] = Deployment(model_dir, worker_args, False, log_dir)
    rounds: list[RoundResult] = []
    outputs: dict[str, dict[int, list[list[int]]]] = {m: {} for m in deps}
    try:
        for d in deps.values():
            d.wait()
        # warm-up: one small batch per deployment (allocator, thread pools, first-touch of pages)
        for mode, d in deps.items():
            asyncio.run(_drive(d.router, make_requests(4, args.input_len, 4, 99, f"warm-{mode}"), 4))
        for r in range(args.rounds):
            order = list(deps) if r % 2 == 0 else list(reversed(deps))
            for mode in order:
                reqs = make_requests(args.num_requests, args.input_len, args.output_len, args.seed + r, f"{mode}-{r}")
                router = deps[mode].router
                seen = len(router.records)
                cpu0 = deps[mode].cpu_seconds()
                t0 = time.perf_counter()
                got = asyncio.run(_drive(router, reqs, args.concurrency))
                dt = time.perf_counter() - t0
                cpu = deps[mode].cpu_seconds() - cpu0
                verify_s = sum(rec.timings.get("verify", 0.0) for rec in router.records[seen:])
                want_status = "verified" if mode == "verify_on" else "unverified"
                bad = [rid for rid, (_, last) in got.items() if last.integrity.get("status") != want_status]
                if bad:
                    raise RuntimeError(f"{mode}: {len(bad)} requests did not end {want_status}, e.g. {got[bad[0]][1]}")
                ntok = sum(len(t) for t, _ in got.values())
                outputs[mode][r] = [got[rid][0] for rid, _, _ in reqs]
                rounds.append(RoundResult(mode, r, dt, verify_s, cpu, len(reqs), ntok, len(reqs) / dt, ntok / dt))
                print(
                    f"round {r} {mode:10s} {dt:7.2f} s  {len(reqs) / dt:7.2f} req/s  {ntok / dt:8.1f} tok/s  "
                    f"verify {1000 * verify_s:7.2f} ms  workers' CPU {cpu:6.2f} s",
                    file=sys.stderr,
                )
    finally:
        for d in deps.values():
            d.close()
    same = all(outputs["verify_on"][r] == outputs["verify_off"][r] for r in range(args.rounds))
    summary: dict[str, Any] = {}
    for mode in deps:
        mine = [x for x in rounds if x.mode == mode]
        summary[mode] = {
            "median_requests_per_s": statistics.median(x.requests_per_s for x in mine),
            "median_output_tokens_per_s": statistics.median(x.output_tokens_per_s for x in mine),
        }
    on_rounds = [x for x in rounds if x.mode == "verify_on"]
    off_rounds = [x for x in rounds if x.mode == "verify_off"]
    verify_share = statistics.median(x.verify_seconds / x.seconds for x in on_rounds)
    # each round ran both modes back to back: the ratio within a round cancels slow drift of the machine
    paired = [a.output_tokens_per_s / b.output_tokens_per_s for a, b in zip(on_rounds, off_rounds, strict=True)]
    ratio = statistics.median(paired)
    cpu_paired = [a.cpu_seconds / b.cpu_seconds for a, b in zip(on_rounds, off_rounds, strict=True) if b.cpu_seconds]
    cpu_ratio = statistics.median(cpu_paired) if cpu_paired else None
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"} | {"model": model_dir},
        "rounds": [asdict(x) for x in rounds],
        "summary": summary,
        "paired_ratios_on_over_off": paired,
        "throughput_ratio_on_over_off": ratio,
        "verification_overhead_pct": 100.0 * (1.0 - ratio),
        "verify_time_share_pct": 100.0 * verify_share,
        "paired_cpu_ratios_on_over_off": cpu_paired,
        "cpu_ratio_on_over_off": cpu_ratio,
        "identical_tokens_on_vs_off": same,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfence.bench.handoff_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--max-total-tokens", type=int, default=32768, help="each worker's KV pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run_bench(args)
    s = result["summary"]
    print(
        f"verify on : {s['verify_on']['median_requests_per_s']:.2f} req/s, "
        f"{s['verify_on']['median_output_tokens_per_s']:.1f} tok/s (median of {args.rounds})\n"
        f"verify off: {s['verify_off']['median_requests_per_s']:.2f} req/s, "
        f"{s['verify_off']['median_output_tokens_per_s']:.1f} tok/s\n"
        f"on/off throughput ratio {result['throughput_ratio_on_over_off']:.4f} (median of per-round pairs "
        f"{', '.join(f'{x:.3f}' for x in result['paired_ratios_on_over_off'])}) "
        f"(verification overhead {result['verification_overhead_pct']:+.2f}%); "
        f"decode time spent verifying: {result['verify_time_share_pct']:.3f}% of wall time (median); "
        f"identical tokens: {result['identical_tokens_on_vs_off']}"
    )
    if result["cpu_ratio_on_over_off"] is not None:
        print(
            f"workers' CPU time on/off {result['cpu_ratio_on_over_off']:.4f} (median of per-round pairs "
            f"{', '.join(f'{x:.3f}' for x in result['paired_cpu_ratios_on_over_off'])}; less sensitive to other "
            "load on the machine than throughput)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["identical_tokens_on_vs_off"] else 1


if __name__ == "__main__":
    sys.exit(main())
