"""Ctrl-C / SIGTERM handlers of a run: the first signal interrupts, a second forces the stop."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit import wait_until

from streamflow import interrupt
from streamflow.interrupt import StopSignals

ROOT = Path(__file__).resolve().parents[2]


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


def _interrupted_loads(path: str, seconds: float) -> None:
    """Child process: load ``path`` into a model over and over while a timer interrupts it at
    random instants, until a ValueError surfaces or ``seconds`` pass. Prints, as JSON, the names of
    the error types that surfaced and the errors ``caused`` did not name the stop. A child,
    because an interrupt cut into load_state_dict's ``no_grad`` can leave torch's grad mode off in
    the process, which would break every later test of a shared test process."""
    import torch
    from safetensors.torch import load_file

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    rng = random.Random(3)
    kinds: set[str] = set()
    uncaused: list[str] = []
    deadline = time.monotonic() + seconds
    while "ValueError" not in kinds and time.monotonic() < deadline:
        with StopSignals() as stop:
            # A timer signal lands in the main thread at any instant, as a terminal's Ctrl-C does
            # in a busy process; StopSignals' own handler takes it (it listens to SIGINT/SIGTERM).
            previous = signal.signal(signal.SIGALRM, stop._handle)
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 0.004))
                while True:
                    model.load_state_dict(load_file(path))
            except BaseException as exc:  # noqa: BLE001 - what surfaced is under test
                if not stop.caused(exc):
                    uncaused.append(repr(exc))
                kinds.add(type(exc).__name__)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
    print(json.dumps({"kinds": sorted(kinds), "uncaused": uncaused}))


def test_an_interrupt_that_c_code_turned_into_another_error_is_still_the_stop(tmp_path) -> None:
    """The handler raises wherever the main thread is. Inside safetensors' load + load_state_dict
    (what the controller's evaluator runs) C code turns about one KeyboardInterrupt in four into
    a ValueError; ``caused`` still names it the stop, so the run reports `interrupted`, not
    `failed`. An error with no signal before it is not the stop."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    path = str(tmp_path / "w.safetensors")
    save_file(model.state_dict(), path)
    with StopSignals() as stop:
        with pytest.raises(RuntimeError) as plain:
            model.load_state_dict({"0.weight": torch.zeros(3)})
        assert not stop.caused(plain.value)
    # A plain subprocess, not multiprocessing: that would leave its resource tracker running
    # under the test process, and later tests check that runs leave no child process behind.
    child = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); from tests.streamflow."
         f"test_interrupt import _interrupted_loads as f; f({path!r}, 60.0)"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    kinds, uncaused = result["kinds"], result["uncaused"]
    assert uncaused == [], f"errors after the signal that caused() did not name the stop: {uncaused}"
    assert "ValueError" in kinds, f"only {kinds} surfaced in 60 s: the case is not exercised"
    assert torch.is_grad_enabled()
