"""Ctrl-C / SIGTERM handlers of a run: the first signal interrupts, a second forces the stop."""

from __future__ import annotations

import os
import signal

import pytest
from testkit import wait_until

from streamflow import interrupt
from streamflow.interrupt import StopSignals


def _deliver(stop: StopSignals, sig: int) -> None:
    """Send ``sig`` to this process and return once ``stop``'s handler has seen it (it runs in
    the main thread at the next bytecode; the first one raises KeyboardInterrupt from here)."""
    seen = len(stop.received)
    os.kill(os.getpid(), sig)
    wait_until(lambda: len(stop.received) > seen, timeout=5, what=f"the handler of {sig!r}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_interrupts_second_forces(sig: int) -> None:
    forced = []
    previous = signal.getsignal(sig)
    with StopSignals() as stop:
        stop.on_force(lambda: forced.append(1))
        with pytest.raises(KeyboardInterrupt):
            _deliver(stop, sig)
        assert stop.signal_name == signal.Signals(sig).name and forced == []
        _deliver(stop, sig)  # forcing raises nothing: the caller still writes its summary
        _deliver(stop, signal.SIGINT)
        assert forced == [1, 1]
    assert signal.getsignal(sig) is previous


def test_installed_is_shared_by_nested_users() -> None:
    with interrupt.installed() as outer:
        with interrupt.installed() as inner:
            assert inner is outer and interrupt._current is outer
        assert interrupt._current is outer
    assert interrupt._current is None


def test_removed_force_callback_is_not_called() -> None:
    forced = []
    with StopSignals() as stop:
        remove = stop.on_force(lambda: forced.append(1))
        remove()
        with pytest.raises(KeyboardInterrupt):
            _deliver(stop, signal.SIGINT)
        _deliver(stop, signal.SIGINT)
    assert forced == []
