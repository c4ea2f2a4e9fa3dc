"""The core board (`disagg.core_board`): a lone busy worker runs on its share plus the idle workers' cores, two
busy workers fall back to their shares, idle claims nothing, a worker that does not borrow keeps its share;
the launcher makes the board for its workers and removes it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.disagg import launcher as launcher_module
from kvfence.disagg.core_board import MAGIC, CoreBoard, default_budget
from kvfence.disagg.launcher import BOARD_SPINCOUNT, LaunchConfig, Launcher


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _board(tmp_path: Path, slots: int, budget: int) -> Path:
    path = tmp_path / "cores"
    CoreBoard.create(path, slots, budget)
    return path


def test_a_lone_busy_worker_borrows_the_idle_workers_share_and_gives_it_back(tmp_path: Path) -> None:
    path = _board(tmp_path, 2, budget=2)
    prefill, decode = CoreBoard(path, 0, share=1), CoreBoard(path, 1, share=1, borrow=False)
    assert prefill.claim(True) == 2 and torch.get_num_threads() == 2  # decode idle: both cores
    assert prefill.claims() == [2, 0] and prefill.steps_borrowing == 1
    assert decode.claim(True) == 1  # decode turns busy: its share, whatever prefill claims
    assert prefill.claim(True) == 1 and torch.get_num_threads() == 1  # prefill sees it and drops to its share
    assert decode.claims() == [1, 1] and prefill.steps_borrowing == 1
    assert decode.claim(False) == 0 and prefill.claims() == [1, 0]
    assert prefill.claim(True) == 2 and prefill.steps_borrowing == 2
    assert prefill.claim(False) == 0 and decode.claims() == [0, 0]  # idle claims nothing


def test_two_workers_turning_busy_together_settle_on_their_shares_within_a_step(tmp_path: Path) -> None:
    path = _board(tmp_path, 2, budget=4)
    a, b = CoreBoard(path, 0, share=2), CoreBoard(path, 1, share=2)
    assert a.claim(True) == 4  # b has not claimed yet
    assert b.claim(True) == 2  # a holds 4: b keeps its share
    assert a.claim(True) == 2 and b.claim(True) == 2  # next step: both at their shares, the budget not exceeded
    assert sum(a.claims()) == 4


def test_three_workers_pool_what_the_idle_one_leaves(tmp_path: Path) -> None:
    path = _board(tmp_path, 3, budget=6)
    p0, p1, d = (CoreBoard(path, i, share=2) for i in range(3))
    assert d.claim(True) == 6
    assert d.claim(True) == 6 and p0.claim(True) == 2 and d.claim(True) == 4  # p0 took its share back
    assert p1.claim(True) == 2 and d.claim(True) == 2 and p0.claim(True) == 2
    assert p1.claim(False) == 0 and p0.claim(True) == 4 and d.claim(True) == 2


def test_close_clears_the_slot(tmp_path: Path) -> None:
    path = _board(tmp_path, 2, budget=2)
    a, b = CoreBoard(path, 0, share=1), CoreBoard(path, 1, share=1)
    assert a.claim(True) == 2
    a.close()
    assert b.claims() == [0, 0] and b.claim(True) == 2


def test_what_is_not_a_board_or_not_a_slot_of_it_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(struct.pack("=5i", 1, 2, 2, 0, 0))
    with pytest.raises(ValueError, match="not a kvfence core board"):
        CoreBoard(junk, 0, share=1)
    short = tmp_path / "short"
    short.write_bytes(struct.pack("=4i", MAGIC, 2, 2, 0))  # says two slots, holds one
    with pytest.raises(ValueError, match="not a kvfence core board"):
        CoreBoard(short, 0, share=1)
    with pytest.raises(ValueError, match="outside 0..1"):
        CoreBoard(_board(tmp_path, 2, budget=2), 2, share=1)


def test_default_budget_keeps_a_core_for_the_router_unless_the_shares_need_every_core() -> None:
    assert default_budget(2, [1, 1]) == 2
    assert default_budget(4, [1, 1]) == 3
    assert default_budget(16, [7, 7]) == 15
    assert default_budget(2, [1, 1, 1, 1]) == 4  # 2 x 2 workers on two cores: each keeps its one thread


class _FakePopen:
    """Records what the launcher would start; every child 'exits' when signalled."""

    started: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, cmd: list[str], env: dict[str, str], **_: Any) -> None:
        self.cmd, self.env, self.pid, self.returncode = cmd, env, 0, None
        _FakePopen.started.append((cmd, env))

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = 0
        return 0


def test_the_launcher_makes_a_board_for_its_workers_tells_each_its_slot_and_removes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launcher_module.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher_module, "_signal_group", lambda p, sig: None)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    _FakePopen.started = []
    launcher = Launcher(LaunchConfig(num_prefill=2, num_decode=1, core_budget=3))
    launcher.start()
    board = launcher.core_board
    assert board is not None and Path(board).exists()
    with open(board, "rb") as f:
        assert struct.unpack("=6i", f.read()) == (MAGIC, 3, 3, 0, 0, 0)  # budget 3, three worker slots, no claims
    by_slot = {cmd[cmd.index("--worker-id") + 1] if "--worker-id" in cmd else "router": (cmd, env)
               for cmd, env in _FakePopen.started}  # fmt: skip
    for slot, index in (("prefill-0", "0"), ("prefill-1", "1"), ("decode-0", "2")):
        cmd, env = by_slot[slot]
        assert cmd[cmd.index("--core-board") + 1] == board and cmd[cmd.index("--core-board-slot") + 1] == index
        assert env["GOMP_SPINCOUNT"] == str(BOARD_SPINCOUNT)
    router_cmd, router_env = by_slot["router"]
    assert "--core-board" not in router_cmd and "GOMP_SPINCOUNT" not in router_env
    launcher.stop()
    assert not Path(board).exists() and launcher.core_board is None


def test_without_a_budget_the_launcher_makes_no_board(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_module.subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(launcher_module, "_signal_group", lambda p, sig: None)
    _FakePopen.started = []
    launcher = Launcher(LaunchConfig())
    launcher.start()
    assert launcher.core_board is None and not any("--core-board" in cmd for cmd, _ in _FakePopen.started)
    launcher.stop()
