"""``free_port``: ports for children are picked below the kernel's ephemeral range, free, and
never handed out twice by one process."""

from __future__ import annotations

import random
import socket

import pytest

from streamflow import supervisor
from streamflow.supervisor import _ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # none handed out twice, though none is bound yet
    for port in ports:
        assert 10_000 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # what the child will do


def test_free_port_skips_a_port_that_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket() as probe:  # a port free now, below 32768
            for spare in range(20_000, 30_000):
                try:
                    probe.bind(("127.0.0.1", spare))
                    break
                except OSError:
                    continue
        picks = iter([busy, spare])

        class Scripted(random.Random):
            def randrange(self, *_args: int) -> int:  # type: ignore[override]
                return next(picks)

        monkeypatch.setattr(supervisor.random, "SystemRandom", Scripted)
        # The range is widened so that the bound port is a candidate; it is skipped.
        assert free_port(ephemeral_low=65_000) == spare


def test_free_port_falls_back_to_the_kernel_when_no_room_below_the_range() -> None:
    port = free_port(ephemeral_low=10_500)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert port >= _ephemeral_low()  # the kernel's pick (bind(0)), not one below the range


def test_ephemeral_low_reads_the_kernel_setting(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert _ephemeral_low(str(f)) == 40000
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
