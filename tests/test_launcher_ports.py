"""The ports a disaggregated launcher picks: every process of a deployment gets a port of its own."""

from __future__ import annotations

import socket

import pytest

from kvfence.disagg.launcher import LaunchConfig, Launcher, free_ports


def test_free_ports_are_distinct_and_avoid_the_taken_ones() -> None:
    taken = free_ports(3)
    ports = free_ports(20, taken=taken)
    assert len(set(ports)) == 20
    assert not set(ports) & set(taken)


def test_a_launcher_never_gives_two_processes_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # An OS that hands the last closed port out again (Linux does, under port pressure): picked one at a time,
    # the router's HTTP and control ports came out equal and the router could not listen.
    real_bind = socket.socket.bind
    last: list[int] = []

    def bind_reusing_the_last_closed_port(self: socket.socket, address: tuple[str, int]) -> None:
        if address[1] == 0 and last:
            try:
                real_bind(self, (address[0], last[-1]))
                return
            except OSError:
                pass  # still held: the OS picks
        real_bind(self, address)
        last.append(self.getsockname()[1])

    monkeypatch.setattr(socket.socket, "bind", bind_reusing_the_last_closed_port)
    launcher = Launcher(LaunchConfig(num_prefill=2, num_decode=3))
    ports = [launcher.ports.http, launcher.ports.control, *launcher.ports.handoff]
    assert len(ports) == 5 and len(set(ports)) == 5, ports


def test_given_ports_are_kept_and_never_picked_again() -> None:
    http, control = free_ports(2)
    launcher = Launcher(LaunchConfig(num_decode=2, http_port=http, control_port=control))
    assert (launcher.ports.http, launcher.ports.control) == (http, control)
    assert not set(launcher.ports.handoff) & {http, control} and len(set(launcher.ports.handoff)) == 2
