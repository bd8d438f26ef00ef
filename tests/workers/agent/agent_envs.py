"""User environments for the tests of workers.agent.isolated: a child process imports them by
path ("agent_envs:Cls"), so they live in a light module of their own (no torch, no store)."""

from __future__ import annotations

import os
import time

from workers.agent.environments import Observation, StepContext
from workers.agent.toolcall import ToolCall


class Moody:
    """``say``: echoes ``text``; "hang" sleeps for ever, "raise" raises, "die" kills the
    process, "done" ends the trajectory with a reward."""

    def tools(self) -> tuple[str, ...]:
        return ("say",)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        text = call.arguments.get("text", "")
        if text == "hang":
            while True:
                time.sleep(3600)
        if text == "raise":
            raise ZeroDivisionError("moody")
        if text == "die":
            os._exit(3)
        if text == "done":
            return Observation("bye", done=True, reward=1.0)
        return Observation(f"{text} (turn {context.turn}, {len(context.calls)} calls before)")


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("cannot be made")
