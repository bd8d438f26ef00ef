"""One spawned child process and the pipe to it, for user code that may hang or crash.

``ChildLink(target, arg, name)`` starts ``target(arg, conn)`` with ``spawn`` (no inherited locks,
threads or torch state; the child gets an import path, never a pickled function) and waits for
its first message: ``("ready", detail)`` or ``(kind, message)`` for a load failure. Then ``ask``
sends one request and waits at most a deadline for the answer; ``kill`` ends the child at once
(the next request starts a fresh one), ``close`` asks it to stop (``None``) and reaps it. Used by
the reward runner (``workers.tasks.verifiers``) and user environments (``workers.agent.isolated``).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 60.0  # a spawned child imports the user's module before it answers


class ChildStartError(Exception):
    """The child reported that it could not load what it was given (``detail``, its message),
    or said nothing within ``START_TIMEOUT_S`` (``detail`` None)."""

    def __init__(self, detail: str | None) -> None:
        super().__init__(detail or "the child did not start")
        self.detail = detail


class ChildTimeout(Exception):  # noqa: N818 - a deadline passed, not a failure of this code
    """No answer within the deadline; the child was killed."""


class ChildDied(Exception):  # noqa: N818
    """The child died while it held a request; it is gone."""


class ChildLink:
    def __init__(self, target: Callable[[str, Connection], None], arg: str, name: str) -> None:
        self.target, self.arg, self.name = target, arg, name
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0  # children killed after a timeout or found dead

    def start(self) -> Any:
        """Start the child; returns the detail of its ``ready`` (ChildStartError otherwise)."""
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=self.target, args=(self.arg, child), daemon=True,
                                 name=self.name)
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            proc.kill()
            proc.join()
            raise ChildStartError(None)
        kind, detail = parent.recv()
        if kind != "ready":
            proc.join()
            raise ChildStartError(detail)
        self._proc, self._conn = proc, parent
        return detail

    def ask(self, request: Any, timeout_s: float) -> Any:
        """The child's answer to ``request`` (a child is started first if none runs).
        ChildTimeout past ``timeout_s``, ChildDied when it dies meanwhile: the child is then
        killed, and counted in ``restarts``."""
        if self._conn is None:
            self.start()
        assert self._conn is not None
        try:
            self._conn.send(request)
            if self._conn.poll(max(0.0, timeout_s)):
                return self._conn.recv()
        except (EOFError, OSError) as exc:  # BrokenPipeError is an OSError
            self.kill()
            raise ChildDied(type(exc).__name__) from exc
        self.kill()
        raise ChildTimeout(f"no answer within {timeout_s:g}s")

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None or self._conn is not None:
            self.restarts += 1
        self._proc, self._conn = None, None

    def close(self) -> None:
        """Ask the child to stop (``None``), then reap it; a later request starts another."""
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(timeout=2.0)
            except OSError:
                pass
        restarts = self.restarts
        self.kill()
        self.restarts = restarts  # a polite stop is not a restart
