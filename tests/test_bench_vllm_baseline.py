"""bench offline's vLLM baseline and contention load: the python lookup, the dtype choice, the busy loops."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfence.bench import vllm_baseline
from kvfence.bench.contention import BusyLoad
from kvfence.bench.offline import Result, format_contention
from kvfence.errors import KvfenceError


def test_vllm_python_without_flag_or_env_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_baseline.VENV_ENV, raising=False)
    with pytest.raises(KvfenceError, match="--vllm-python"):
        vllm_baseline.vllm_python(None)


def test_vllm_python_comes_from_the_venv_env(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    venv = os.fspath(tmp_path)
    os.makedirs(os.path.join(venv, "bin"))
    py = os.path.join(venv, "bin", "python")
    os.symlink(sys.executable, py)
    monkeypatch.setenv(vllm_baseline.VENV_ENV, venv)
    assert vllm_baseline.vllm_python(None) == py


def test_vllm_python_that_is_not_a_file_is_refused() -> None:
    with pytest.raises(KvfenceError, match="not an executable"):
        vllm_baseline.vllm_python("/nonexistent/bin/python")


def test_best_dtype_is_bf16_only_with_native_bf16() -> None:
    assert vllm_baseline.best_dtype(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert vllm_baseline.best_dtype(frozenset({"amx_bf16"})) == "bfloat16"
    assert vllm_baseline.best_dtype(frozenset({"avx2", "avx512f"})) == "float32"


def test_vllm_threads_are_pinned_to_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's "auto" binding keeps a core for its scheduler (one thread on 2 cores); the bench lists CPUs instead."""
    monkeypatch.setattr(vllm_baseline.os, "sched_getaffinity", lambda pid: {5, 2, 3, 7})
    assert vllm_baseline.omp_threads_bind(2) == "2,3"
    assert vllm_baseline.omp_threads_bind(0) == "2,3,5,7"
    assert vllm_baseline.omp_threads_bind(9) == "2,3,5,7"


def test_busy_load_runs_and_ends_its_processes() -> None:
    with BusyLoad(2) as load:
        procs = list(load.procs)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)


def test_contention_table_reports_each_systems_loss() -> None:
    def res(name: str, seconds: float) -> Result:
        return Result(name, seconds, 1, 10, 100, [[1]])

    quiet = [res("kvfence", 1.0), res("vllm float32", 2.0)]
    loaded = {"kvfence": res("kvfence", 4.0), "vllm float32": res("vllm float32", 4.0)}
    table = format_contention(quiet, loaded)
    assert "4.00x" in table.splitlines()[2]  # kvfence: 100 -> 25 tok/s
    assert "2.00x" in table.splitlines()[3] and "1.00x" in table.splitlines()[3]  # vllm: 50 -> 25; ours/vllm loaded


def test_cli_shortens_openmp_spinning_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfence import cli

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main([]) == 2  # no subcommand: help
    assert os.environ["GOMP_SPINCOUNT"] == str(cli.SPINCOUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    cli.main([])
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.main([])
    assert "GOMP_SPINCOUNT" not in os.environ


def test_bench_serve_sends_each_url_its_own_model_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfence.bench import serve as bs
    from kvfence.bench.client import ServerFacts

    names = {"http://127.0.0.1:1": "kvfence-tiny-llama", "http://127.0.0.1:2": "other-served-name"}
    asked: list[str | None] = []
    sent: list[tuple[str, str]] = []

    async def facts(url: str, model: str | None) -> ServerFacts:
        asked.append(model)
        return ServerFacts(names[url], 4096, None, 1000, None)

    async def run_target(label: str, url: str, requests: object, cfg: object, model: str, kind: str) -> object:
        sent.append((url, model))
        return bs.TargetRun(label, url, kind)

    monkeypatch.setattr(bs, "_facts", facts)
    monkeypatch.setattr(bs, "run_target", run_target)
    cfg = bs.BenchConfig(num_prompts=1)
    runs, skipped = bs.run_bench(cfg, urls=[("a", "http://127.0.0.1:1"), ("b", "http://127.0.0.1:2")], log=print)
    assert not skipped and len(runs) == 2
    assert asked == [None, None]  # no --model-name: each server is asked for its own
    assert sent == list(names.items())


@pytest.mark.parametrize(
    ("flags", "asked", "want"),
    [
        (frozenset({"avx512f"}), None, "float32"),  # vLLM's auto would make the float32 model bf16, emulated
        (frozenset({"avx512f", "avx512_bf16"}), None, "bfloat16"),
        (frozenset({"avx512f"}), "bfloat16", "bfloat16"),
    ],
)
def test_bench_serve_launches_vllm_at_its_fastest_dtype_here_unless_told(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], asked: str | None, want: str
) -> None:
    from kvfence.bench import serve as bs
    from kvfence.integrations.vllm import launch as vllm_launch

    started: list[list[str]] = []

    class Server:
        def wait_ready(self, timeout: float) -> None:
            pass

    def start(spec: vllm_launch.VllmSpec) -> Server:
        started.append(spec.args("127.0.0.1", 1))
        return Server()

    monkeypatch.setattr(vllm_launch, "start", start)
    monkeypatch.setattr(vllm_baseline, "cpu_flags", lambda: flags)
    monkeypatch.setenv("KVFENCE_VLLM_VENV", "/nonexistent-venv")
    bs._launch_vllm(bs.BenchConfig(num_prompts=1), None, 1.0, sys.executable, asked)
    (argv,) = started
    assert argv[argv.index("--dtype") + 1] == want and argv.count("--dtype") == 1


def _session(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_wait_quiet_waits_out_a_busy_tail_then_sees_idle() -> None:
    busy_then_sleep = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(60)"
    p = _session(busy_then_sleep)
    try:
        q = vllm_baseline.wait_quiet(p.pid, limit=10.0, window=0.25)
        assert q.idle and 1.0 <= q.waited < 5.0, q
        assert vllm_baseline.session_cpu_seconds(p.pid) >= 1.0  # its busy second is counted
    finally:
        p.kill()
        p.wait()


def test_wait_quiet_gives_up_on_a_session_that_stays_busy() -> None:
    p = _session("while True: pass")
    try:
        q = vllm_baseline.wait_quiet(p.pid, limit=0.6, window=0.2)
        assert not q.idle and q.waited >= 0.6, q
    finally:
        p.kill()
        p.wait()


def test_session_cpu_seconds_is_zero_for_a_session_with_no_process() -> None:
    assert vllm_baseline.session_cpu_seconds(2**22 + 12345) == 0.0


def test_a_paused_worker_uses_no_cpu_until_resumed() -> None:
    """pause/resume stop and continue the worker's whole session (its process group), as the bench does while
    another system's timed run goes."""
    w = object.__new__(vllm_baseline.VllmWorker)  # the process handling only, without starting vLLM
    w.proc = _session("while True: pass")  # type: ignore[assignment]
    w._paused = False
    try:
        w.pause()
        time.sleep(0.1)  # a stop takes effect at the next scheduling point
        before = vllm_baseline.session_cpu_seconds(w.proc.pid)
        time.sleep(0.5)
        assert vllm_baseline.session_cpu_seconds(w.proc.pid) - before < 0.05
        w.resume()
        before = vllm_baseline.session_cpu_seconds(w.proc.pid)
        time.sleep(0.5)
        assert vllm_baseline.session_cpu_seconds(w.proc.pid) - before > 0.2
    finally:
        w.resume()
        w.proc.kill()
        w.proc.wait()


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for vLLM's python: it ignores the worker script and runs the shell `body`."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def _worker(python: str, timeout_s: float) -> vllm_baseline.VllmWorker:
    return vllm_baseline.VllmWorker(python, "/no/model", "float32", 64, 1, 1, timeout_s=timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_that_never_answers_is_killed_with_its_children(tmp_path: Path) -> None:
    """vLLM's front process alive but silent (its engine process hung or dead): the start fails after the
    timeout, and every process of the worker's group is gone, the children it started included."""
    pid_file = tmp_path / "child.pid"
    python = _fake_python(tmp_path, f"sleep 600 & echo $! > {pid_file}; exec sleep 600")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"gave no answer in 0.5 s \(--vllm-timeout-s\)"):
        _worker(python, 0.5)
    assert time.monotonic() - t0 < 5
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:  # killed; reaped by init
        time.sleep(0.05)
    assert not _alive(child)


def test_a_run_that_never_answers_fails_after_the_timeout(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, f"echo '{vllm_baseline._MARK}{{\"ready\": true}}'; exec sleep 600")
    w = _worker(python, 0.5)
    with pytest.raises(RuntimeError, match="gave no answer"):
        w.run([[1, 2, 3]], 4)
    assert w.proc.poll() is not None
    w.close()  # after the kill: nothing left to stop, and no error


def test_a_worker_that_exits_says_its_code(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "echo 'vLLM chatter on stdout'; exit 3")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        _worker(python, 30)


def test_a_worker_answers_after_its_chatter(tmp_path: Path) -> None:
    answer = f'{vllm_baseline._MARK}{{"seconds": 0.25, "outputs": [[7, 8]]}}'
    ready = f'{vllm_baseline._MARK}{{"ready": true}}'
    python = _fake_python(tmp_path, f"echo noise; echo '{ready}'; read line; echo more noise; echo '{answer}'; read x")
    w = _worker(python, 30)
    got = w.run([[1, 2]], 2)
    assert got == vllm_baseline.VllmRun(0.25, [[7, 8]])
    w.close()


def test_an_answer_that_is_not_json_fails_at_once_with_it(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, f"echo '{vllm_baseline._MARK}{{not json'; exec sleep 600")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="answered .*not json"):
        _worker(python, 30)
    assert time.monotonic() - t0 < 10  # not after the 30 s timeout


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_the_vllm_timeout_must_be_a_positive_number(value: str) -> None:
    import argparse

    from kvfence.bench.offline import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["offline", "--vllm-timeout-s", "0.5"]).vllm_timeout_s == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["offline", "--vllm-timeout-s", value])
