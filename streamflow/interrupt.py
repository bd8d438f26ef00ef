"""Ctrl-C and SIGTERM for ``streamflow run``: the first asks for a clean stop, the second forces it.

Owns: ``StopSignals``, the process's handlers for SIGINT and SIGTERM while a run is on.

Contract (the CLI's exit codes follow it, README "Stopping"):

- first SIGINT or SIGTERM: ``KeyboardInterrupt`` is raised in the main thread (wherever it is:
  warm start, start-up, the RL loop) and the signal is remembered (``signal_name``). The controller
  then stops its workers in order — each finishes its turn and releases its leases, the store node
  last — and writes ``summary.json`` with status ``interrupted``; the CLI exits 128 + the signal
  number (130 for Ctrl-C, 143 for SIGTERM), as a process killed by that signal would, and as
  torchrun and a Python program (TRL's trainers) stopped by Ctrl-C do: non-zero, so a shell
  script or scheduler never mistakes a stopped run for a finished one.
- any further signal: the stop is forced. Every callback registered with ``on_force`` runs (the
  supervisor SIGKILLs its children, skipping the grace period) and nothing is raised, so the
  controller still writes the summary.

Children never see the terminal's SIGINT (streamflow/supervisor.py starts each in its own
session), so the order of the stop is the controller's alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installed with ``with StopSignals() as stop:`` (main thread only; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.received: list[int] = []  # signals seen, in order
        self._force: list[Callable[[], None]] = []
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str | None:
        """The signal that asked for the stop ("SIGINT", "SIGTERM"), or None."""
        return signal.Signals(self.received[0]).name if self.received else None

    def on_force(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` when a second signal forces the stop; returns a remover."""
        self._force.append(callback)
        return lambda: self._force.remove(callback) if callback in self._force else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            raise KeyboardInterrupt
        sys.stderr.write("stopping now: killing the run's processes\n")
        for callback in list(self._force):
            callback()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


_current: StopSignals | None = None


def current() -> StopSignals | None:
    """The handlers of the run in progress in this process (None outside ``installed``)."""
    return _current


class installed:  # noqa: N801 - used as a context manager, like a function
    """``with installed() as stop:``: install ``StopSignals`` unless a caller already did (the
    CLI installs them before anything heavy starts; the controller again for in-process runs)."""

    def __init__(self) -> None:
        self._own: StopSignals | None = None

    def __enter__(self) -> StopSignals:
        global _current
        if _current is not None:
            return _current
        self._own = _current = StopSignals().__enter__()
        return self._own

    def __exit__(self, *exc: object) -> None:
        global _current
        if self._own is not None:
            self._own.__exit__(*exc)
            _current = None
