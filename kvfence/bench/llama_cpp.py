"""llama.cpp as a baseline: its build, the model's GGUF, and the numbers its tools print.

What it knows:
  - where a llama.cpp build lives: the llama.cpp tree vendored in the `llama-cpp-python`
    source package of PyPI (version LLAMA_CPP_PYTHON_VERSION), unpacked and built with
    cmake (Release, GGML_NATIVE=ON, CPU only, `nice`, -j2) into
    <cache>/llama.cpp/<version>/ (<cache> as kvfence.models.default.cache_dir), of which
    only `llama-batched-bench` and `llama-server` are built. `kvfence bench llama-cpp-setup`
    does that once, one target after the other, each stamped BUILT-<target> when it is done
    (a second run finds the stamps and does nothing; the offline timing can start as soon
    as llama-batched-bench is there, the greedy-token check needs llama-server); llama.cpp's code
    is never in this repository.
  - how to convert a kvfence model directory (config.json + safetensors + tokenizer.json)
    to a GGUF F32 with that tree's own convert_hf_to_gguf.py and its vendored gguf-py,
    cached next to the model as model-f32.llama.cpp-<version>.gguf (redone when the model
    files are newer). Our tokenizers are byte-level BPEs trained here, which the converter's
    pre-tokenizer table (a hash of the ids one fixed text encodes to) can never contain, so
    the converter runs under a small driver that answers "gpt-2" for a tokenizer.json whose
    pre-tokenizer is exactly ByteLevel with the GPT-2 regex (which llama.cpp's "gpt-2"
    pre-tokenizer implements), and leaves every other tokenizer to the converter's own check.
  - the output of llama-batched-bench (`--output-format jsonl`, and its markdown table),
    both printed by tools/batched-bench/batched-bench.cpp of that tree;
  - the command line of a llama-server with N slots on the GGUF (fp32 KV cache, 2 threads),
    and how to ask it for greedy tokens of token-id prompts (/completion with
    return_tokens), and how to compare those with ours (`agreement`).

What it does not know: how fast anything is (offline.py and serve.py time and compare);
how llama.cpp works inside. llama.cpp bans end-of-generation tokens under ignore_eos while
kvfence only stops ignoring them, so agreement is judged up to the first end-of-generation
token (see `agreement`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvfence.math_utils import round_up

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-batched-bench", "llama-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
SETUP_COMMAND = "kvfence bench llama-cpp-setup"


def _say(msg: str) -> None:
    print(f"kvfence: {msg}", file=sys.stderr, flush=True)


# ---- the build ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppBuild:
    """Where one version's source, build tree and binaries are (whether or not they exist yet)."""

    version: str
    root: Path

    @property
    def source_dir(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    def stamp(self, target: str) -> Path:
        return self.root / f"BUILT-{target}"

    def binary(self, target: str) -> Path:
        return self.build_dir / "bin" / target

    @property
    def batched_bench(self) -> Path:
        return self.binary("llama-batched-bench")

    @property
    def server(self) -> Path:
        return self.binary("llama-server")

    @property
    def converter(self) -> Path:
        return self.source_dir / "convert_hf_to_gguf.py"

    def has(self, target: str) -> bool:
        """`target` was built by a setup that finished it (stamped) and is still there."""
        return self.stamp(target).is_file() and os.access(self.binary(target), os.X_OK)

    def is_built(self, targets: Sequence[str] = TARGETS) -> bool:
        return all(self.has(t) for t in targets)


def build_location(version: str = LLAMA_CPP_PYTHON_VERSION, cache: Path | None = None) -> LlamaCppBuild:
    from kvfence.models.default import cache_dir

    return LlamaCppBuild(version, (cache or cache_dir()) / "llama.cpp" / version)


def missing_message(build: LlamaCppBuild) -> str:
    """What to print when the baseline cannot run for want of a build."""
    return (
        f"llama.cpp baseline skipped: no llama.cpp build at {build.root} (llama-cpp-python {build.version}'s "
        f"vendored tree). Build it once with `{SETUP_COMMAND}` (a pip download and a cmake build; on 2 cores "
        "this takes tens of minutes)."
    )


def find_build(version: str = LLAMA_CPP_PYTHON_VERSION, targets: Sequence[str] = TARGETS) -> LlamaCppBuild | None:
    """The build, if `targets` are built (stamped) in it."""
    build = build_location(version)
    return build if build.is_built(targets) else None


def _run_logged(cmd: Sequence[str], log_path: Path, cwd: Path | None = None) -> None:
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        rc = subprocess.run(list(cmd), cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {rc}; log {log_path}:\n{tail}")


def setup(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, say: Callable[[str], None] = _say) -> LlamaCppBuild:
    """Download, unpack and build llama.cpp (see the module docstring) unless it is already built."""
    import importlib.util

    build = build_location(version)
    if build.is_built():
        say(f"llama.cpp {version} is already built in {build.root}")
        return build
    if importlib.util.find_spec("sentencepiece") is None:  # checked before minutes of compiling, not after
        raise RuntimeError("llama.cpp's GGUF converter needs sentencepiece: pip install 'kvfence[bench]'")
    build.root.mkdir(parents=True, exist_ok=True)
    log_path = build.root / "setup.log"
    if not build.converter.is_file():
        with tempfile.TemporaryDirectory(dir=build.root) as tmp:
            say(f"downloading the llama-cpp-python {version} source package (log {log_path})")
            _run_logged(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    # only this package from source: its build dependencies (scikit-build-core, cmake, ...) come
                    # as wheels for pip's metadata step (":all:" compiled those too: 8 min instead of ~1 on 2 cores)
                    "--no-binary",
                    "llama-cpp-python",
                    "--no-deps",
                    "--quiet",
                    f"llama-cpp-python=={version}",
                    "-d",
                    tmp,
                ],
                log_path,
            )
            archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if len(archives) != 1:
                raise RuntimeError(f"pip download left {[a.name for a in Path(tmp).iterdir()]}, not one sdist")
            with tarfile.open(archives[0]) as tar:
                tar.extractall(build.root, filter="data")
        if not build.converter.is_file():
            raise RuntimeError(f"the source package has no vendored llama.cpp at {build.source_dir}")
    nice = ["nice"] if shutil.which("nice") else []
    say(f"configuring and building {', '.join(TARGETS)} in {build.build_dir} (log {log_path}; this takes a while)")
    if not (build.build_dir / "CMakeCache.txt").is_file():
        _run_logged([*nice, "cmake", "-S", str(build.source_dir), "-B", str(build.build_dir), *CMAKE_FLAGS], log_path)
    for target in TARGETS:  # one at a time, so the first is usable while the second builds
        if build.has(target):
            continue
        cmd = [*nice, "cmake", "--build", str(build.build_dir), "--config", "Release", f"-j{jobs}", "--target", target]
        _run_logged(cmd, log_path)
        if not os.access(build.binary(target), os.X_OK):
            raise RuntimeError(f"the build finished without {build.binary(target)}")
        stamp = {"version": version, "target": target, "cmake_flags": CMAKE_FLAGS}
        build.stamp(target).write_text(json.dumps(stamp, indent=1) + "\n")
        say(f"built {build.binary(target)}")
    return build


# ---- the model as GGUF -------------------------------------------------------------------------------------------

# Runs convert_hf_to_gguf.py as __main__ with one change: a BPE tokenizer whose pre-tokenizer is exactly
# ByteLevel + the GPT-2 regex is named "gpt-2" when the converter's hash table does not know it.
_CONVERT_DRIVER = r"""
import json, runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src + "/gguf-py")
sys.path.insert(0, src)
import conversion.base as base

original = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        spec = json.loads((self.dir_model / "tokenizer.json").read_text(encoding="utf-8"))
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            print("kvfence: byte-level BPE with the GPT-2 regex: tokenizer.ggml.pre = gpt-2", file=sys.stderr)
            return "gpt-2"
        raise

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_path(model_dir: str | os.PathLike[str], version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return Path(model_dir) / f"model-f32.llama.cpp-{version}.gguf"


def _model_files(model_dir: Path) -> list[Path]:
    return [p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file()]


def ensure_gguf(model_dir: str | os.PathLike[str], build: LlamaCppBuild, say: Callable[[str], None] = _say) -> Path:
    """The model's GGUF F32 (converted by `build`'s convert_hf_to_gguf.py unless a current one is there)."""
    model_dir = Path(model_dir)
    out = gguf_path(model_dir, build.version)
    if out.is_file() and all(p.stat().st_mtime <= out.stat().st_mtime for p in _model_files(model_dir)):
        return out
    if not build.converter.is_file():
        raise RuntimeError(f"no converter at {build.converter}; run `{SETUP_COMMAND}`")
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:  # the converter imports it for every Llama
        raise RuntimeError("llama.cpp's converter needs sentencepiece: pip install 'kvfence[bench]'")
    say(f"converting {model_dir} to GGUF F32 with {build.converter.name} -> {out.name}")
    tmp = out.with_name(out.name + ".tmp")
    cmd = [
        sys.executable,
        "-c",
        _CONVERT_DRIVER,
        str(build.source_dir),
        str(model_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(tmp),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_LOCAL_GGUF=""))
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {proc.returncode}):\n{tail}")
    os.replace(tmp, out)
    return out


# ---- llama-batched-bench -------------------------------------------------------------------------------------------


class BatchedBenchRow(NamedTuple):
    """One line of llama-batched-bench: pl sequences of pp prompt + tg generated tokens each."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float  # seconds to process the prompts (pl * pp tokens unless the prompt is shared)
    speed_pp: float  # prompt tokens / s
    t_tg: float  # seconds for tg decode steps of pl tokens
    speed_tg: float  # generated tokens / s
    t: float
    speed: float


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """Rows of llama-batched-bench output: its jsonl lines, or its markdown table (`|  128 |  127 |  8 | ...`)."""
    rows: list[BatchedBenchRow] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_pp"' in line:
            d = json.loads(line)
            rows.append(BatchedBenchRow(*(type_(d[f]) for f, type_ in _FIELDS)))
        elif line.startswith("|"):  # the header and the |----| rule are not numbers
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == len(_FIELDS) and _numeric(cells):
                rows.append(BatchedBenchRow(*(type_(c) for c, (_, type_) in zip(cells, _FIELDS, strict=True))))
    return rows


_FIELDS: list[tuple[str, type]] = [
    ("pp", int),
    ("tg", int),
    ("pl", int),
    ("n_kv", int),
    ("t_pp", float),
    ("speed_pp", float),
    ("t_tg", float),
    ("speed_tg", float),
    ("t", float),
    ("speed", float),
]


def _numeric(cells: list[str]) -> bool:
    try:
        [float(c) for c in cells]
    except ValueError:
        return False
    return True


def batched_bench_command(
    build: LlamaCppBuild,
    gguf: Path,
    num_prompts: int,
    input_len: int,
    decode_len: int,
    threads: int,
    kv_type: str = "f16",
    flash_attn: str = "auto",
) -> list[str]:
    """llama-batched-bench for num_prompts separate prompts of input_len tokens, then decode_len decode steps.

    kv_type / flash_attn: llama.cpp's defaults are f16 / auto (flash attention on here); f32 / off is the
    setting that computes attention in fp32 like kvfence (its slowest at batch 8 and 32 on this box).
    """
    # llama.cpp pads each sequence's context to a multiple of 256 and drops a shape that no longer fits
    # (exit 0, no row): give every sequence whole 256-token blocks, as many sequences as prompts
    ctx = num_prompts * round_up(input_len + decode_len, 256)
    return [
        str(build.batched_bench),
        "-m",
        str(gguf),
        "-c",
        str(ctx),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(input_len),
        "-ntg",
        str(decode_len),
        "-npl",
        str(num_prompts),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-ctk",
        kv_type,
        "-ctv",
        kv_type,
        "-fa",
        flash_attn,
        "--output-format",
        "jsonl",
    ]


def run_batched_bench(
    build: LlamaCppBuild,
    gguf: Path,
    num_prompts: int,
    input_len: int,
    decode_len: int,
    threads: int,
    attempts: int = 3,
    kv_type: str = "f16",
    flash_attn: str = "auto",
) -> BatchedBenchRow:
    cmd = batched_bench_command(build, gguf, num_prompts, input_len, decode_len, threads, kv_type, flash_attn)
    # Seen here with a context sized as above: about one run in five exits 0 having printed nothing at all
    # (not even its own log lines), the next identical run prints its row. Such a run is retried, up to
    # `attempts` times in all; any other failure is not.
    for _ in range(attempts):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = parse_batched_bench(proc.stdout + "\n" + proc.stderr)
        if proc.returncode != 0 or rows or proc.stdout.strip():
            break
    if proc.returncode != 0 or len(rows) != 1:  # no row: it skips a shape whose n_kv exceeds its context
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-10:])
        raise RuntimeError(f"llama-batched-bench exited {proc.returncode} with {len(rows)} result rows:\n{tail}")
    return rows[0]


# ---- llama-server ------------------------------------------------------------------------------------------------


def server_command(
    build: LlamaCppBuild,
    gguf: Path,
    *,
    host: str,
    port: int,
    parallel: int,
    context_per_slot: int,
    threads: int,
    alias: str | None = None,
    flash_attn: str = "auto",
    kv_type: str = "f32",
) -> list[str]:
    """llama-server with `parallel` slots (continuous batching), a `kv_type` KV cache (llama.cpp's -ctk/-ctv
    name: f32 by default, bf16 for a bfloat16 model), `threads` threads.

    flash_attn: llama.cpp's `-fa` ("auto" turns it on on the CPU). Its flash attention casts K and V to
    F16 whatever `-ctk/-ctv` say (src/llama-graph.cpp, build_attn_mha) and accumulates in F16, so only
    "off" computes attention in fp32 as kvfence does: greedy agreement is checked that way.
    """
    named = ["--alias", alias] if alias else []
    return [
        str(build.server),
        "-m",
        str(gguf),
        *named,
        "--host",
        host,
        "--port",
        str(port),
        "-np",
        str(parallel),
        "-c",
        str(parallel * context_per_slot),
        "-cb",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-ctk",
        kv_type,
        "-ctv",
        kv_type,
        "-fa",
        flash_attn,
        "--no-webui",
    ]


def launch_server(
    build: LlamaCppBuild,
    gguf: Path,
    *,
    parallel: int,
    context_per_slot: int,
    threads: int,
    host: str = "127.0.0.1",
    ready_timeout_s: float = 300.0,
    label: str = "llama.cpp",
    alias: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    flash_attn: str = "auto",
    kv_type: str = "f32",
) -> Any:
    """Start llama-server on a free port of `host` and wait for /health; a `launch.LaunchedServer`."""
    from kvfence.bench.launch import LaunchedServer
    from kvfence.disagg.launcher import free_port

    port = free_port(host)
    cmd = server_command(
        build,
        gguf,
        host=host,
        port=port,
        parallel=parallel,
        context_per_slot=context_per_slot,
        threads=threads,
        alias=alias,
        flash_attn=flash_attn,
        kv_type=kv_type,
    )
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvfence-bench-")) / f"{label}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    how = " ".join([build.server.name, *cmd[1:]])
    server = LaunchedServer(label, "llama.cpp", f"http://{host}:{port}", how, proc, log_path)
    server.wait_ready(ready_timeout_s)
    return server


def completion_body(prompt: list[int], n_predict: int) -> dict[str, Any]:
    """A /completion request for the greedy continuation of token ids, returning the token ids."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def greedy_tokens(url: str, prompts: Sequence[list[int]], n_predict: int, timeout_s: float = 600.0) -> list[list[int]]:
    """Greedy token ids of each prompt from a llama-server at `url`, one request at a time."""
    import httpx

    out = []
    with httpx.Client(timeout=timeout_s) as client:
        for p in prompts:
            r = client.post(f"{url}/completion", json=completion_body(p, n_predict))
            if r.status_code != 200:
                raise RuntimeError(f"llama-server /completion answered {r.status_code}: {r.text[:300]}")
            tokens = r.json().get("tokens")
            if not isinstance(tokens, list):
                raise RuntimeError("llama-server /completion returned no `tokens` (return_tokens unsupported?)")
            out.append([int(t) for t in tokens])
    return out


class Agreement(NamedTuple):
    same: int
    total: int
    first_mismatch: int | None  # index of the first request that differs


def agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]], eog_ids: frozenset[int]) -> Agreement:
    """How many requests have the same greedy tokens on both sides, up to the first end-of-generation token.

    Ours ran with ignore_eos, so it may continue past an eog token; llama-server (run
    without ignore_eos, which would ban eog tokens) stops there. Both are cut before
    their first eog token and must then be equal; llama.cpp stopping early without one
    is a mismatch.
    """
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs of ours vs {len(theirs)} of llama.cpp")

    def cut(tokens: Sequence[int]) -> tuple[list[int], bool]:
        for i, t in enumerate(tokens):
            if t in eog_ids:
                return list(tokens[:i]), True
        return list(tokens), False

    same, first = 0, None
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        (ca, a_eog), (cb, b_eog) = cut(a), cut(b)
        full_length = len(cb) == len(b) and len(b) == len(a)  # llama.cpp did not stop early
        if ca == cb and (a_eog or b_eog or full_length):
            same += 1
        elif first is None:
            first = i
    return Agreement(same, len(ours), first)


# ---- `kvfence bench llama-cpp-setup` ------------------------------------------------------------------------------


def _setup_main(args: argparse.Namespace) -> int:
    from kvfence.config import resolve_model_dir

    build = setup(args.version, jobs=args.jobs)
    for model in args.model or []:
        path = ensure_gguf(resolve_model_dir(model, _say), build)
        _say(f"GGUF: {path}")
    print(build.build_dir / "bin")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "llama-cpp-setup",
        help="build llama.cpp (llama-batched-bench, llama-server) once, for the llama.cpp baselines",
        description="Download the llama-cpp-python source package from PyPI, build its vendored llama.cpp "
        "(cmake Release, GGML_NATIVE=ON, CPU, nice, -j2) into the kvfence cache, and convert models to GGUF F32 "
        "with that tree's convert_hf_to_gguf.py. Idempotent: what is there is not redone. Prints the bin folder.",
        epilog=f"example: {SETUP_COMMAND} --model kvfence-tiny-llama --model kvfence-llama-100m",
    )
    p.add_argument(
        "--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python version (default: %(default)s)"
    )
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    p.add_argument(
        "--model", action="append", metavar="DIR|PRESET", help="also convert this model to GGUF F32 (repeatable)"
    )
    p.set_defaults(func=_setup_main)
