"""The cost of kvfence's connector in vLLM (docs/benchmarks.md): `kvfence bench serve` against three targets in one run.

Starts, in the vLLM venv this script runs in: a plain vLLM instance (the single-instance baseline), a vLLM prefill and
decode pair with `KvfenceConnector`, and `kvfence proxy` over the pair (in this process). Then, for each concurrency,
runs `kvfence bench serve` with the main venv's interpreter (`--kvfence-python`) against the single instance (first:
the ratios are to it), the proxy, and a `kvfence serve` (disagg) that bench serve launches itself, one target at a
time. Prints `uptime` before each run.

    PYTHONPATH=. /path/to/vllm-venv/bin/python scripts/vllm_bench.py --kvfence-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from kvfence.config import resolve_model_dir
from kvfence.integrations.vllm.launch import VllmSpec, kvfence_transfer_config, start_all
from kvfence.integrations.vllm.proxy import build_client
from kvfence.models.tokenizer import Tokenizer
from kvfence.server.api import ApiSettings, build_app
from kvfence.server.launch import ServerThread


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvfence-python", required=True, help="the main venv's python (runs kvfence bench serve)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--out", default=None, help="directory for JSON results and plots")
    args = ap.parse_args()
    model = resolve_model_dir(None)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    common = {"block_size": 32, "max_model_len": 2048, "kv_cache_gib": 1}
    specs = [
        VllmSpec("single", model, None, prefix_caching=False, **common),  # type: ignore[arg-type]
        VllmSpec("prefill", model, kvfence_transfer_config("prefill"), **common),  # type: ignore[arg-type]
        VllmSpec("decode", model, kvfence_transfer_config("decode"), **common),  # type: ignore[arg-type]
    ]
    servers = start_all(specs, timeout_s=900, log_dir=out)
    single, prefill, decode = servers
    client = build_client(prefill.url, decode.url)
    tok = Tokenizer.from_dir(model)
    app = build_app(client, tok, ApiSettings(served_model_name="kvfence-tiny-llama", vocab_size=tok.vocab_size))
    try:
        with ServerThread(app) as proxy:
            for c in (int(x) for x in args.concurrency.split(",")):
                n = 4 * c + 16
                load = subprocess.check_output(["uptime"], text=True).strip()
                print(f"== concurrency {c}: {n} prompts; load: {load}", flush=True)
                cmd = [
                    args.kvfence_python, "-m", "kvfence", "bench", "serve",
                    "--url", f"vllm-single={single.url}", "--url", f"vllm-1p1d-kvfence={proxy.url}",
                    "--launch", "disagg", "--tokenizer", model,
                    "--num-prompts", str(n), "--max-concurrency", str(c), "--request-rate", "inf",
                    "--input-len", args.input_len, "--output-len", args.output_len, "--warmup", "4",
                    "--json", str(out / f"c{c}.json"),
                ]  # fmt: skip
                print("$ " + " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=False)
            print(f"load after: {subprocess.check_output(['uptime'], text=True).strip()}", flush=True)
    finally:
        client.close()
        for s in servers:
            s.stop()
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
