"""Starting vLLM OpenAI servers on loopback, with or without kvfence's connector (for `kvfence proxy --launch`,
benchmarks and tests).

What it knows: the vLLM command line for one instance (`VllmSpec`: role -> `--kv-transfer-config` for
`KvfenceConnector`, or any other connector's config, or none), its environment (`VLLM_CPU_KVCACHE_SPACE` bounds the
KV cache in GiB on CPU; `PYTHONPATH` lets the vLLM process import this kvfence), a free port, the log in a file,
waiting for /health, and stopping its whole process group. Instances start in parallel (`start_all`), since each
takes most of a minute on two cores.

What it does not know: vLLM itself (it runs `python -m vllm.entrypoints.openai.api_server` with the interpreter it
is given) or what the instances serve; waiting for and stopping a started server is `kvfence.server_process`'s.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence.disagg.launcher import free_port
from kvfence.server_process import ServerProcess

CONNECTOR_MODULE = "kvfence.integrations.vllm.connector"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def kvfence_transfer_config(role: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for `KvfenceConnector` in `role` (prefill, decode or both)."""
    return {
        "kv_connector": "KvfenceConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": ROLES[role],
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": dict(extra or {}),
    }


@dataclass(frozen=True)
class VllmSpec:
    """One vLLM instance: its model and limits, its KV transfer config (None: a plain instance)."""

    label: str
    model: str
    transfer_config: dict[str, Any] | None = None
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    max_model_len: int = 2048
    block_size: int | None = None
    enforce_eager: bool = True  # no torch.compile: start-up in ~25-50 s instead of minutes
    prefix_caching: bool | None = None  # None: off with a consumer connector (it requires that), vLLM's default else
    served_model_name: str | None = None
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def args(self, host: str, port: int) -> list[str]:
        a = [
            "--model", self.model, "--host", host, "--port", str(port), "--max-model-len", str(self.max_model_len),
            "--disable-uvicorn-access-log", "--enable-request-id-headers",
        ]  # fmt: skip
        if self.served_model_name:
            a += ["--served-model-name", self.served_model_name]
        if self.block_size:
            a += ["--block-size", str(self.block_size)]
        if self.enforce_eager:
            a.append("--enforce-eager")
        caching, tc = self.prefix_caching, self.transfer_config
        if caching is None and tc is not None and tc.get("kv_role") != "kv_producer":
            caching = False
        if caching is not None:
            a.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
        if self.transfer_config is not None:
            a += ["--kv-transfer-config", json.dumps(self.transfer_config, separators=(",", ":"))]
        return [*a, *self.extra_args]


@dataclass
class VllmServer(ServerProcess):
    spec: VllmSpec
    url: str
    command: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path

    tail_lines, poll_s, grace_s = 30, 0.5, 20.0  # vLLM starts and stops slowly

    @property
    def title(self) -> str:
        return f"vLLM {self.spec.label}"

    @property
    def how(self) -> str:
        return shlex.join(self.command)


def start(spec: VllmSpec, host: str = "127.0.0.1", log_dir: str | os.PathLike[str] | None = None) -> VllmServer:
    """Start one instance (not waiting for it); its log is `<log_dir>/<label>.log`."""
    port = free_port(host)
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvfence-vllm-")) / f"{spec.label}.log"
    command = [spec.python, "-m", "vllm.entrypoints.openai.api_server", *spec.args(host, port)]
    kvfence_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (kvfence_root, env.get("PYTHONPATH", "")) if x)
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(int(spec.kv_cache_gib)), "PYTHONUNBUFFERED": "1", **spec.env})
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # "auto" pins every instance's worker to the same core
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer(spec, f"http://{host}:{port}", command, proc, log_path)


def start_all(
    specs: Sequence[VllmSpec], timeout_s: float = 600.0, log_dir: str | os.PathLike[str] | None = None
) -> list[VllmServer]:
    """Start every instance at once and wait until all are ready; on any failure all are stopped and it raises."""
    servers: list[VllmServer] = []
    try:
        for spec in specs:
            servers.append(start(spec, log_dir=log_dir))
        deadline = time.monotonic() + timeout_s
        for s in servers:
            s.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
