"""What vLLM's own KV connectors do with the #52234 cases and kvfence's faults: the "vLLM alone" side of docs/vllm.md.

Starts a vLLM prefill and decode instance with one of vLLM's connectors on loopback (NixlConnector over NIXL's UCX
backend on CPU, or the shared-storage ExampleConnector), runs each case, and prints a markdown table: the HTTP status
the client got and whether its tokens equal a single vLLM instance's greedy output for the prompt it sent. Cases
that a connector has no handle for (ExampleConnector names no remote request or block) are reported as such, not
run. kvfence's own column is what tests/test_vllm_pd.py asserts.

    PYTHONPATH=. /path/to/vllm-venv/bin/python scripts/vllm_connector_matrix.py --connector nixl
    PYTHONPATH=. /path/to/vllm-venv/bin/python scripts/vllm_connector_matrix.py --connector example

NIXL needs the `nixl` and `nixl-cu12` wheels in the vLLM venv (`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`:
its UCX backend runs without a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvfence.config import resolve_model_dir
from kvfence.disagg.launcher import free_port
from kvfence.integrations.vllm.launch import VllmServer, VllmSpec, start_all

BLOCK = 32
LEASE_S = 6
N = 150  # prompt tokens: 5 blocks


def prompt(seed: int, n: int = N) -> list[int]:
    return [(seed * 7919 + i * 104729) % 2000 + 40 for i in range(n)]


class Run:
    def __init__(self, prefill: VllmServer, decode: VllmServer) -> None:
        self.prefill, self.decode = prefill, decode
        self.model = prefill.spec.model
        self.restarts = 0

    def complete(self, server: VllmServer, ids: list[int], max_tokens: int, params: dict | None) -> tuple[int, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as e:
            return 0, repr(e)
        return r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def solo(self, ids: list[int]) -> list[int]:
        status, body = self.complete(self.prefill, ids, 8, None)
        assert status == 200, body
        return list(body["choices"][0]["token_ids"])

    def ensure_decode(self) -> bool:
        """Restart decode if a case killed it (True when it had to)."""
        if self.healthy(self.decode):
            return False
        self.decode.stop()
        self.restarts += 1
        spec = dataclasses.replace(self.decode.spec, label=f"{self.decode.spec.label}-restart{self.restarts}")
        [self.decode] = start_all([spec], timeout_s=900, log_dir=self.decode.log_path.parent)
        self.complete(self.decode, prompt(0, 200), 2, None)
        return True

    def healthy(self, server: VllmServer) -> bool:
        try:
            return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


def outcome(run: Run, status: int, body: Any, asked: list[int], solo: list[int] | None = None) -> dict[str, Any]:
    """What the client got for prompt `asked`: status, and whether its tokens are the single instance's (`solo`, or
    the prefill instance's answer to a plain request)."""
    out: dict[str, Any] = {"status": status}
    if status == 200:
        tokens = list(body["choices"][0]["token_ids"])
        same = tokens == (solo if solo is not None else run.solo(asked))
        out["tokens"] = "equal to a single instance" if same else "DIFFERENT from a single instance"
    else:
        out["error"] = str(body)[:160]
    out["decode healthy after"] = run.healthy(run.decode)
    return out


# -- NixlConnector ----------------------------------------------------------------------------------------------------


def nixl_specs(model: str) -> list[VllmSpec]:
    def spec(label: str) -> VllmSpec:
        tc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
              "kv_load_failure_policy": "fail",
              "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}  # fmt: skip
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self,sm", "PYTHONFAULTHANDLER": "1"}
        return VllmSpec(label, model, tc, block_size=BLOCK, max_model_len=1024, prefix_caching=False, env=env)

    return [spec("nixl-prefill"), spec("nixl-decode")]


def nixl_prefill(run: Run, ids: list[int]) -> dict:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    status, body = run.complete(run.prefill, ids, 1, params)
    assert status == 200, body
    return dict(body["kv_transfer_params"])


def nixl_decode(run: Run, ids: list[int], params: dict) -> tuple[int, Any]:
    return run.complete(run.decode, ids, 8, params)


def _shift_blocks(ids: Any, by: int) -> Any:
    return [_shift_blocks(x, by) for x in ids] if isinstance(ids, list) else ids + by


def _map_blocks(ids: Any, f: Callable[[list[int]], list[int]]) -> Any:
    return (
        [f(g) if g and isinstance(g[0], int) else _map_blocks(g, f) for g in ids]
        if ids and isinstance(ids[0], list)
        else f(ids)
    )  # noqa: E501


def nixl_cases(run: Run) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    a, b, c = prompt(1), prompt(2), prompt(3)
    p = nixl_prefill(run, a)
    res["normal handoff"] = outcome(run, *nixl_decode(run, a, p), a)

    p = nixl_prefill(run, a)
    unknown = {**p, "remote_request_id": "cmpl-nobody-0"}
    res["unknown remote request id"] = outcome(run, *nixl_decode(run, a, unknown), a)
    nixl_decode(run, a, p)  # release the real one

    p = nixl_prefill(run, a)
    res["out-of-range block ids"] = outcome(
        run, *nixl_decode(run, a, {**p, "remote_block_ids": _shift_blocks(p["remote_block_ids"], 10**6)}), a
    )  # noqa: E501
    nixl_decode(run, a, p)

    p = nixl_prefill(run, a)
    nixl_decode(run, a, p)  # consumed
    res["consumed reference reused (new prompt)"] = outcome(run, *nixl_decode(run, c, p), c)

    p = nixl_prefill(run, a)
    nixl_decode(run, a, p)  # consumed: prefill frees A's blocks
    pb = nixl_prefill(run, b)  # prefill reuses them for B
    res["stale reference after prefill reused its blocks"] = outcome(run, *nixl_decode(run, a, p), a)
    nixl_decode(run, b, pb)

    p = nixl_prefill(run, a)
    time.sleep(LEASE_S + 4)
    res["lease expiry"] = outcome(run, *nixl_decode(run, a, p), a)

    p = nixl_prefill(run, [a[0]])  # the incident: prefill computed a 1-token stand-in, decode expects the prompt
    res["placeholder handoff (1-token stand-in)"] = outcome(run, *nixl_decode(run, a, p), a)

    run.ensure_decode()
    p = nixl_prefill(run, a)
    res["reordered pages"] = outcome(
        run, *nixl_decode(run, a, {**p, "remote_block_ids": _map_blocks(p["remote_block_ids"], lambda g: g[::-1])}), a
    )  # noqa: E501

    run.ensure_decode()
    p = nixl_prefill(run, a)
    res["dropped page (one block named twice)"] = outcome(
        run,
        *nixl_decode(run, a, {**p, "remote_block_ids": _map_blocks(p["remote_block_ids"], lambda g: [g[0], *g[:-1]])}),
        a,
    )  # noqa: E501
    return res


# -- ExampleConnector (shared storage) ------------------------------------------------------------------------------


def example_specs(model: str, storage: Path) -> list[VllmSpec]:
    def spec(label: str, role: str) -> VllmSpec:
        tc = {"kv_connector": "ExampleConnector", "kv_role": role, "kv_load_failure_policy": "fail",
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
        return VllmSpec(label, model, tc, block_size=BLOCK, max_model_len=1024, prefix_caching=False)

    return [spec("example-prefill", "kv_producer"), spec("example-decode", "kv_consumer")]


def example_cases(run: Run, storage: Path) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    na = {"status": "n/a", "note": "no reference to forge: KV is looked up by the prompt's own token hash"}
    for case in ("unknown remote request id", "out-of-range block ids", "consumed reference reused (new prompt)",
                 "stale reference after prefill reused its blocks", "lease expiry"):  # fmt: skip
        res[case] = dict(na)

    # the producer also loads from the storage, so the single-instance answer of a prompt is taken when it is first
    # computed (and stored), before any case tampers with its files
    solos: dict[tuple[int, ...], list[int]] = {}

    def stored(ids: list[int]) -> Path:
        before = {p.name for p in storage.iterdir()}
        status, body = run.complete(run.prefill, ids, 8, None)
        assert status == 200, body
        solos[tuple(ids)] = list(body["choices"][0]["token_ids"])
        new = [p for p in storage.iterdir() if p.name not in before]
        assert len(new) == 1, new
        return new[0]

    def fresh(seed: int) -> tuple[list[int], Path]:
        ids = prompt(seed)
        return ids, stored(ids)

    def decode(ids: list[int]) -> dict[str, Any]:
        return outcome(run, *run.complete(run.decode, ids, 8, None), ids, solos.get(tuple(ids)))

    ids, folder = fresh(10)
    res["normal handoff"] = decode(ids)

    stored([ids[0]])  # prefill computed a 1-token stand-in; decode looks the real prompt up
    ids = prompt(11)
    res["placeholder handoff (1-token stand-in)"] = decode(ids)

    run.ensure_decode()
    ids, folder = fresh(12)
    f = sorted(folder.iterdir())[0]
    data = bytearray(f.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 64):
        data[k] ^= 0x5A
    f.write_bytes(bytes(data))
    res["corrupted bytes"] = decode(ids)

    run.ensure_decode()
    ids, folder = fresh(13)
    f0, f1 = sorted(folder.iterdir())[:2]
    tmp = f0.read_bytes()
    f0.write_bytes(f1.read_bytes())
    f1.write_bytes(tmp)
    res["reordered pages (two layers swapped)"] = decode(ids)

    run.ensure_decode()
    ids, folder = fresh(14)
    other_ids, other = fresh(15)
    for f in folder.iterdir():
        shutil.copyfile(other / f.name, f)
    res["stale page (another prompt's KV)"] = decode(ids)

    run.ensure_decode()
    ids, folder = fresh(16)
    f = sorted(folder.iterdir())[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res["short write (file cut in half)"] = decode(ids)

    run.ensure_decode()
    ids, folder = fresh(17)
    sorted(folder.iterdir())[0].unlink()
    res["dropped page (one layer missing)"] = decode(ids)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=["nixl", "example"], required=True)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model = resolve_model_dir(None)
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm-matrix-{args.connector}-"))
    storage = workdir / "kv"
    storage.mkdir()
    specs = nixl_specs(model) if args.connector == "nixl" else example_specs(model, storage)
    servers = start_all(specs, timeout_s=900, log_dir=workdir)
    run = Run(*servers)
    try:
        for s in servers:
            # warm-up with a long prompt: vLLM 0.32's CPU attention kernel uses AMX without asking Linux for it, so
            # an instance whose first forward has no matmul big enough for oneDNN to ask first dies of SIGILL
            run.complete(s, prompt(0, 200), 2, None)
        res = nixl_cases(run) if args.connector == "nixl" else example_cases(run, storage)
    finally:
        for s in (*servers, run.decode):
            s.stop()
    print(f"vLLM {args.connector}: logs in {workdir}", file=sys.stderr)
    for case, o in res.items():
        what = o.get("tokens") or o.get("note") or o.get("error", "")
        print(f"| {case} | {o['status']} | {what} | decode healthy after: {o.get('decode healthy after', '-')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
