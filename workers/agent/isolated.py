"""A user's environment in a child process, so that a step which hangs or crashes costs the
trajectory one error observation, never the environment worker.

``IsolatedEnvironment(spec, timeout_s)`` is an ``Environment``: ``tools()`` answers what the child
reported when it loaded ``spec`` (``load_environment`` runs there: a spec that cannot be had fails
at construction, as in-process), ``step`` sends the call and its context to the child and waits
at most ``timeout_s``. Past it, the child is killed (SIGKILL) and the step is a "timeout"
observation; a child that dies is a "crashed" one; the next step starts a fresh child. An
exception the user's step raises comes back as ``EnvironmentRaised`` (``execute`` makes it a
"tool_error" observation). The child is started with ``spawn`` (no inherited locks, threads or
torch state) and is only ever given the spec's import path; the pipe carries the call, its
context and the observation's fields between this process and its own child.

The built-ins do not need it: the calculator is pure and bounded, the python tool runs its code in
the sandbox (``workers.agent.sandbox``).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from workers.agent.environments import Observation, StepContext, load_environment
from workers.agent.toolcall import ToolCall

_START_TIMEOUT_S = 60.0  # a spawned child imports the user's module before it answers


class EnvironmentRaised(Exception):  # noqa: N818 - the user's exception, as text
    """The user's ``step`` raised; the message is ``Type: message`` of what it raised."""


def _child_main(spec: str, conn: Connection) -> None:
    try:
        env = load_environment(spec)
        conn.send(("ready", tuple(env.tools())))
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    while True:
        request = conn.recv()
        if request is None:
            return
        call, context = request
        try:
            obs = env.step(call, context)
        except Exception as exc:
            conn.send(("raised", f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        if isinstance(obs, Observation):
            conn.send(("ok", (obs.text, obs.error, obs.done, obs.reward)))
        else:
            conn.send(("bad", type(obs).__name__))


class IsolatedEnvironment:
    """``spec``'s environment, stepped in a child process under ``timeout_s`` per step."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0  # children killed after a timeout or found dead
        self._tools = self._start()

    def _start(self) -> tuple[str, ...]:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_child_main, args=(self.spec, child), daemon=True,
                                 name="environment")
        proc.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            proc.kill()
            proc.join()
            raise ValueError(f"environment {self.spec!r}: the child did not start")
        kind, detail = parent.recv()
        if kind != "ready":
            proc.join()
            raise ValueError(detail)  # load_environment's message, naming env.fn
        self._proc, self._conn = proc, parent
        return detail

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None
        self.restarts += 1

    def tools(self) -> tuple[str, ...]:
        return self._tools

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send((call, context))
            if not self._conn.poll(self.timeout_s):
                self._kill()
                return Observation(f"the environment did not answer within {self.timeout_s:g}s",
                                   "timeout")
            kind, detail = self._conn.recv()
        except (EOFError, OSError):  # the child died mid-step
            self._kill()
            return Observation("the environment crashed", "crashed")
        if kind == "raised":
            raise EnvironmentRaised(detail)
        if kind == "bad":
            return Observation(f"the environment returned {detail}, not an Observation",
                               "tool_error")
        text, error, done, reward = detail
        return Observation(text, error, done, reward)

    def close(self) -> None:
        """Stop the child (a later step starts another)."""
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(timeout=2.0)
            except (OSError, BrokenPipeError):
                pass
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None
