"""The cost of kvfence's connector in vLLM (docs/benchmarks.md): `kvfence bench serve` against every target in one run.

Starts, in the vLLM venv this script runs in: a plain vLLM instance (the single-instance baseline), a vLLM prefill and
decode pair with `KvfenceConnector` and `kvfence proxy` over it (in this process), and, with `--nixl`, a vLLM pair with
vLLM's own NixlConnector behind a minimal two-step proxy (prefill, then decode with prefill's `kv_transfer_params`,
as vLLM's example proxy does; no verification), so the cost of 1P1D itself is measured next to kvfence's. Then, for
each concurrency, runs `kvfence bench serve` with the main venv's interpreter (`--kvfence-python`) against the single
instance (first: the ratios are to it), the pairs, and a `kvfence serve` (disagg) that bench serve launches itself,
one target at a time. Prints `uptime` before each run.

    PYTHONPATH=. /path/to/vllm-venv/bin/python scripts/vllm_bench.py --kvfence-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from kvfence.auth.keys import ENV_KEY, ClusterKey
from kvfence.config import resolve_model_dir
from kvfence.disagg.launcher import free_port
from kvfence.engine.engine_client import GenerationChunk
from kvfence.engine.sampling_params import SamplingParams
from kvfence.integrations.vllm.launch import VllmSpec, kvfence_transfer_config, start_all
from kvfence.integrations.vllm.proxy import VllmPDClient, build_client, completion_logprobs, vllm_sampling
from kvfence.models.tokenizer import Tokenizer
from kvfence.server.api import ApiSettings, build_app
from kvfence.server.launch import ServerThread

NAME = "kvfence-tiny-llama"  # every target serves the model under this name (bench serve sends one name to all)


class NixlPDClient(VllmPDClient):
    """vLLM's own P/D flow for NixlConnector, without kvfence: prefill with do_remote_decode, decode with prefill's
    kv_transfer_params, decode's stream relayed as it comes (no record, nothing verified). Benchmark baseline only."""

    async def _generate(self, rid: str, ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        nixl = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
        body = {"model": self.vllm_model, "prompt": ids, "max_tokens": 1, "kv_transfer_params": nixl}
        r = await self._client().post(f"{self.prefill_url}/v1/completions", json=body)
        if r.status_code != 200:
            yield GenerationChunk([], "", True, "error", len(ids), error=f"prefill answered {r.status_code}")
            return
        body = {"model": self.vllm_model, "prompt": ids, "stream": True, "return_token_ids": True,
                **vllm_sampling(params), "kv_transfer_params": r.json()["kv_transfer_params"]}  # fmt: skip
        n = 0
        async with self._client().stream("POST", f"{self.decode_url}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or "[DONE]" in line:
                    continue
                event: dict[str, Any] = json.loads(line[5:])
                if "error" in event:
                    yield GenerationChunk([], "", True, "error", len(ids), error=str(event["error"]))
                    return
                choice = event["choices"][0]
                tokens = list(choice.get("token_ids") or [])
                n += len(tokens)
                finish = choice.get("finish_reason")
                lps = completion_logprobs(choice.get("logprobs"), params.logprobs or 0)
                yield GenerationChunk(tokens, choice.get("text") or "", finish is not None, finish, len(ids), n, lps)
                if finish is not None:
                    return
        yield GenerationChunk([], "", True, "error", len(ids), n, error="decode's stream ended early")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvfence-python", required=True, help="the main venv's python (runs kvfence bench serve)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="32")
    ap.add_argument("--out", default=None, help="directory for JSON results and plots")
    ap.add_argument("--nixl", action="store_true", help="also a vLLM pair with NixlConnector (needs nixl installed)")
    args = ap.parse_args()
    model = resolve_model_dir(None)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    common = {"block_size": 32, "max_model_len": 2048, "kv_cache_gib": 1}
    key = ClusterKey.generate()
    keyed = {**common, "env": {ENV_KEY: key.to_hex()}}
    specs = [
        VllmSpec("single", model, None, prefix_caching=False, served_model_name=NAME, **common),  # type: ignore[arg-type]
        VllmSpec("prefill", model, kvfence_transfer_config("prefill"), **keyed),  # type: ignore[arg-type]
        VllmSpec("decode", model, kvfence_transfer_config("decode"), **keyed),  # type: ignore[arg-type]
    ]
    if args.nixl:
        for label in ("nixl-prefill", "nixl-decode"):
            tc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self,sm"}
            specs.append(VllmSpec(label, model, tc, prefix_caching=False, env=env, **common))  # type: ignore[arg-type]
    servers = start_all(specs, timeout_s=900, log_dir=out)
    single, prefill, decode = servers[:3]
    client = build_client(prefill.url, decode.url, key)
    tok = Tokenizer.from_dir(model)
    settings = ApiSettings(served_model_name=NAME, vocab_size=tok.vocab_size)
    app = build_app(client, tok, settings)
    nixl_urls: list[str] = []
    nixl_threads: list[ServerThread] = []
    if args.nixl:
        for s in servers[3:]:  # vLLM's CPU attention needs a long first prompt (docs/vllm.md, known limits)
            s_body = {"model": s.spec.model, "prompt": list(range(40, 240)), "max_tokens": 2}
            httpx.post(f"{s.url}/v1/completions", json=s_body, timeout=300)
        nclient = NixlPDClient(servers[3].url, servers[4].url, vllm_model=model, capacity=client.capacity(), key=key)
        nixl_threads.append(ServerThread(build_app(nclient, tok, settings)).start())
        nixl_urls = ["--url", f"vllm-1p1d-nixl={nixl_threads[0].url}"]
    try:
        with ServerThread(app) as proxy:
            for c in (int(x) for x in args.concurrency.split(",")):
                n = 2 * c + 8
                load = subprocess.check_output(["uptime"], text=True).strip()
                print(f"== concurrency {c}: {n} prompts; load: {load}", flush=True)
                cmd = [
                    args.kvfence_python, "-m", "kvfence", "bench", "serve",
                    "--url", f"vllm-single={single.url}", *nixl_urls, "--url", f"vllm-1p1d-kvfence={proxy.url}",
                    "--launch", "disagg", "--tokenizer", model, "--model-name", NAME,
                    "--num-prompts", str(n), "--max-concurrency", str(c), "--request-rate", "inf",
                    "--input-len", args.input_len, "--output-len", args.output_len, "--warmup", "4",
                    "--json", str(out / f"c{c}.json"),
                ]  # fmt: skip
                print("$ " + " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=False)
            print(f"load after: {subprocess.check_output(['uptime'], text=True).strip()}", flush=True)
    finally:
        client.close()
        for t in nixl_threads:
            t.stop()
        for s in servers:
            s.stop()
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
