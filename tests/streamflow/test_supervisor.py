"""``free_port``: ports for children are picked below the kernel's ephemeral range, free, and
never handed out twice by one process. Stopping: children are out of the terminal's process
group, nothing restarts once ``stop_all`` began, and ``kill_all`` forces the stop."""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time

import pytest
from testkit import wait_until

from storage import ports
from storage.ports import _ephemeral_low, free_port
from streamflow.supervisor import RestartPolicy, Supervisor

NO_RESTARTS = RestartPolicy(max_restarts=0)


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

        monkeypatch.setattr(ports.random, "SystemRandom", Scripted)
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


# -- stopping: children out of the terminal's reach, no restart once stopping, forced stop --------

_IGNORE_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ignoring SIGTERM', flush=True); time.sleep(60)")


def _sleeper(sup: Supervisor, name: str, code: str = "import time; time.sleep(60)"):
    child = sup.start(name, "rollout", [sys.executable, "-c", code], threads=1)
    child.mark_ready()
    return child


def test_children_run_in_their_own_session(tmp_path) -> None:
    """The terminal's Ctrl-C goes to the foreground process group: children must not be in it."""
    sup = Supervisor(tmp_path, NO_RESTARTS)
    try:
        child = _sleeper(sup, "rollout-0")
        assert os.getpgid(child.popen.pid) != os.getpgid(0)
        assert os.getsid(child.popen.pid) == child.popen.pid
    finally:
        sup.stop_all(grace_s=5)


def test_nothing_is_restarted_once_the_stop_began(tmp_path) -> None:
    sup = Supervisor(tmp_path, policy=RestartPolicy(max_restarts=3, backoff_s=0.0))
    child = _sleeper(sup, "rollout-0")
    first = child.popen
    sup.stop_all(grace_s=5)  # exits by SIGTERM: non-zero, after it was ready
    for _ in range(3):  # checks at different moments (time passing is the point): none restarts
        assert sup.check() is None
        time.sleep(0.01)
    assert child.popen is first and child.restarts == 0 and first.poll() is not None


def test_kill_all_cuts_the_grace_period_short(tmp_path) -> None:
    """A second Ctrl-C: children that would take the whole grace period are killed at once."""
    sup = Supervisor(tmp_path, NO_RESTARTS)
    children = [_sleeper(sup, f"rollout-{i}", _IGNORE_TERM) for i in range(2)]
    store = sup.start("store-0", "store", [sys.executable, "-c", _IGNORE_TERM], threads=1)
    for child in [*children, store]:  # each has installed SIG_IGN (it says so in its log)
        wait_until(lambda c=child: "ignoring SIGTERM" in c.log_path.read_text(), timeout=30,
                   what=f"{child.name} to ignore SIGTERM")
    timer = threading.Timer(1.0, sup.kill_all)
    timer.start()
    t0 = time.monotonic()
    called = []
    sup.stop_all(grace_s=30, between=lambda: called.append(1))
    timer.join()
    assert time.monotonic() - t0 < 10
    assert called == []  # a forced stop does not read the store's counts
    assert all(c.popen.poll() is not None for c in [*children, store])
