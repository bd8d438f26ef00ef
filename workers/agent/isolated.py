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

from multiprocessing.connection import Connection
from typing import Any

from workers.agent.environments import Observation, StepContext, load_environment
from workers.agent.toolcall import ToolCall
from workers.runtime.child import ChildDied, ChildLink, ChildStartError, ChildTimeout
from workers.settings import HUB_PREFIX


def _load(spec: str) -> Any:
    """``load_environment``, or a hub taskset's environment for a hub spec
    (``workers.agent.hub.hub_spec``: ``env.fn: hub`` runs here, like any user code)."""
    if spec.startswith(HUB_PREFIX):
        from workers.agent.hub import load_hub_environment

        return load_hub_environment(spec.removeprefix(HUB_PREFIX))
    return load_environment(spec)


class EnvironmentRaised(Exception):  # noqa: N818 - the user's exception, as text
    """The user's ``step`` raised; the message is ``Type: message`` of what it raised."""


def _child_main(spec: str, conn: Connection) -> None:
    try:
        env = _load(spec)
        conn.send(("ready", tuple(env.tools())))
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone (its worker stopped without closing)
            return
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
        self._child = ChildLink(_child_main, spec, "environment")
        try:
            self._tools: tuple[str, ...] = self._child.start()
        except ChildStartError as exc:  # load_environment's message names env.fn
            raise ValueError(exc.detail or f"environment {spec!r}: the child did not start") \
                from None

    @property
    def restarts(self) -> int:  # children killed after a timeout or found dead
        return self._child.restarts

    def tools(self) -> tuple[str, ...]:
        return self._tools

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        try:
            kind, detail = self._child.ask((call, context), self.timeout_s)
        except ChildTimeout:
            return Observation(f"the environment did not answer within {self.timeout_s:g}s",
                               "timeout")
        except (ChildDied, ChildStartError):  # died mid-step, or could not come back
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
        self._child.close()
