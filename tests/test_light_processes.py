"""The launcher and the router of a disaggregated deployment never load torch, transformers or numpy.

Each runs in a fresh interpreter: everything `kvfence serve --disagg` (the launcher) and `worker_main --role router`
import to parse their flags and run, and the router's thread setting, must leave `torch` and `transformers` out of
`sys.modules` (torch alone is ~200 MiB of resident memory per process, numpy 15; docs/benchmarks.md, "Memory of the
runtime"). The router's token hash packs its ids with `struct`; numpy's conversion gives the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvfence.integrity.token_hash import token_hash

ROOT = Path(__file__).resolve().parent.parent

_LAUNCHER = """
import sys
from kvfence.cli import build_parser
args = build_parser("serve").parse_args(["serve", "--disagg", "--model", "/nonexistent"])
import kvfence.commands.worker_main as w
w.launch_command_args(args)
import kvfence.disagg.launcher, kvfence.disagg.core_board, kvfence.server.launch
"""

_ROUTER = """
import sys
import kvfence.commands.worker_main as w
args = w.build_parser().parse_args(["--role", "router", "--control-port", "1"])
w.set_torch_threads("router", args.torch_threads)
import kvfence.disagg.router, kvfence.server.api, kvfence.server.role_engine, kvfence.server.startup
import kvfence.server.tool_parsers, kvfence.auth.keys, kvfence.models.heap, kvfence.disagg.messages, kvfence.auth.curve
"""

_REPORT = """
import json, os
print(json.dumps({"heavy": [m for m in ("torch", "transformers", "numpy") if m in sys.modules],
                  "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def _loaded(snippet: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", snippet + _REPORT], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_launcher_does_not_load_torch_transformers_or_numpy():
    assert _loaded(_LAUNCHER)["heavy"] == []


def test_router_does_not_load_torch_transformers_or_numpy():
    report = _loaded(_ROUTER)
    assert report["heavy"] == []
    assert report["omp"] == "1"  # its one thread, for a torch a grammar compile may load later


def test_the_check_sees_torch_when_it_is_loaded():
    assert _loaded("import sys\nimport kvfence.engine.sampler\n")["heavy"] == ["torch", "numpy"]


@pytest.mark.parametrize(
    "ids",
    [[], [0], [1, 2, 3], list(range(5000)), [2**63 - 1, -(2**63), 7], (4, 5, 6)],
)
def test_the_token_hash_packs_ids_as_numpy_does(ids: list[int]) -> None:
    expected = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(np.asarray(ids, dtype="<i8")).tobytes())
    assert token_hash(ids) == expected
    assert token_hash(np.asarray(ids, dtype=np.int64)) == expected


def test_ids_struct_cannot_pack_fail_as_numpy_does() -> None:
    with pytest.raises(OverflowError):
        token_hash([2**63])
    with pytest.raises(AssertionError):
        token_hash([[1, 2]])
