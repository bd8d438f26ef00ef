"""Ctrl-C and SIGTERM for ``streamflow run``: the first asks for a clean stop, the second forces it.

``StopSignals``: the first signal raises ``KeyboardInterrupt`` in the main thread and is
remembered (the CLI exits 128 + it); any further one runs the ``on_force`` callbacks and raises
nothing (docs/controller.md "Stopping").
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
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

    def caused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is how the stop surfaced: the ``KeyboardInterrupt`` itself, or any error
        raised once a stop signal had arrived. The handler raises wherever the main thread is, and
        C code running then may turn the ``KeyboardInterrupt`` into its own error (safetensors'
        ``load_file`` + ``load_state_dict`` raise ``ValueError: could not determine the shape of
        object type 'torch.storage.UntypedStorage'`` for about one interrupt in four)."""
        return isinstance(exc, KeyboardInterrupt) or bool(self.received)

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


_current: StopSignals | None = None  # the handlers of the run in progress in this process


@contextlib.contextmanager
def installed() -> Iterator[StopSignals]:
    """``with installed() as stop:``: install ``StopSignals`` unless a caller already did (the
    CLI installs them before anything heavy starts; the controller again for in-process runs)."""
    global _current
    if _current is not None:
        yield _current
        return
    with StopSignals() as stop:
        _current = stop
        try:
            yield stop
        finally:
            _current = None
