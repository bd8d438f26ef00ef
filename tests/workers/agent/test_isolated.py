"""A user's environment in a child process: answers like in-process, and a step that hangs,
raises or kills its process is an error observation, after which the next step works."""

from __future__ import annotations

from contextlib import closing

import pytest

from workers.agent.environments import StepContext, execute
from workers.agent.isolated import IsolatedEnvironment
from workers.agent.observe import make_environment
from workers.agent.toolcall import ToolCall, render_tool_call
from workers.settings import AgentSettings

CTX = StepContext(prompt="p", answer="a", turn=2, calls=(ToolCall("say", {"text": "x"}),))


def say(text: str) -> str:
    return render_tool_call(ToolCall("say", {"text": text}))


def test_steps_answer_and_failures_become_observations() -> None:
    with closing(IsolatedEnvironment("agent_envs:Moody", timeout_s=2.0)) as env:
        assert env.tools() == ("say",)
        assert execute(env, say("hi"), CTX).text == "hi (turn 2, 1 calls before)"
        done = execute(env, say("done"), CTX)
        assert (done.text, done.done, done.reward) == ("bye", True, 1.0)
        hung = execute(env, say("hang"), CTX)
        assert hung.error == "timeout" and env.restarts == 1
        raised = execute(env, say("raise"), CTX)
        assert raised.error == "tool_error" and "ZeroDivisionError: moody" in raised.text
        died = execute(env, say("die"), CTX)
        assert died.error == "crashed" and env.restarts == 2
        assert execute(env, say("again"), CTX).text.startswith("again")  # a fresh child


def test_a_spec_that_cannot_be_had_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="cannot be made"):
        IsolatedEnvironment("agent_envs:Broken", timeout_s=1.0)


def test_the_role_isolates_user_environments_only() -> None:
    user = make_environment(AgentSettings(max_turns=2, fn="agent_envs:Moody",
                                          timeout_s=1.0))
    with closing(user):
        assert isinstance(user, IsolatedEnvironment) and user.timeout_s == 1.0
    assert not isinstance(make_environment(AgentSettings(max_turns=2)), IsolatedEnvironment)
