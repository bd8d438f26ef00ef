"""An MCP server's tools as a run's tools (workers.agent.mcp_tools), with a real server
(mcp_calculator.py) in a real process: its tools listed with their schemas (and rendered by a
chat template), a call through the environment role answered by it, its failures as error
observations, a server killed between calls or stuck in one started again, and every server
stopped by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psutil
import pytest
from test_env_stage import call, chat_tokenizer, lease, rows
from testkit import wait_until

from storage.ports import free_port
from workers.agent.environments import StepContext, execute
from workers.agent.mcp_tools import McpEnvironment
from workers.agent.toolcall import ToolCall, render_tool_call
from workers.checked import ConfigValueError
from workers.roles.environment import environment_stages, make_environment
from workers.settings import AgentSettings
from workers.tasks.word import chat_prompt_text

SERVER = Path(__file__).with_name("mcp_calculator.py")
COMMAND = (sys.executable, str(SERVER))
CTX = StepContext(prompt="p", answer="a", turn=0)
pytestmark = pytest.mark.timeout(120)


def gone(pid: int) -> bool:
    """The process exited (reaped, or a zombie waiting for its parent's reaper)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def calc(expression: str) -> str:
    return render_tool_call(ToolCall("calculator", {"expression": expression}))


@pytest.fixture
def env() -> Iterator[McpEnvironment]:
    made = McpEnvironment(command=COMMAND, timeout_s=30.0)
    try:
        yield made
    finally:
        made.close()


def test_the_servers_tools_are_listed_with_their_schemas_and_a_template_renders_them(env):
    assert env.tools() == ("calculator", "fail", "hang")
    schema = {s["function"]["name"]: s for s in env.tool_schemas()}
    calculator = schema["calculator"]
    assert calculator["type"] == "function"
    assert calculator["function"]["description"].startswith("Evaluate an arithmetic expression")
    parameters = calculator["function"]["parameters"]
    assert parameters["properties"]["expression"]["type"] == "string"
    assert parameters["required"] == ["expression"]
    tok = chat_tokenizer("{% for t in tools %}[{{ t.function.name }}: "
                         "{{ t.function.description }}]{% endfor %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    text = chat_prompt_text(tok, "1+1?", instruction=None, tools=env.tool_schemas())
    assert text.startswith("[calculator: Evaluate an arithmetic expression exactly") and (
        "[fail: Always raises.]" in text and text.endswith("1+1?"))


def test_calls_through_the_environment_role_are_answered_by_the_server():
    """make_environment starts the server; one lease of four rows: answered, the tool raised,
    a tool the server does not serve, arguments its schema refuses."""
    agent = AgentSettings(max_turns=3, max_total_tokens=1000, fn="mcp", mcp_command=COMMAND,
                          format="hermes", max_observation_tokens=200, timeout_s=30.0)
    env = make_environment(agent)
    assert isinstance(env, McpEnvironment)
    tok = chat_tokenizer(None)
    with closing(env):
        stage = environment_stages(env, tok, agent, max_cuts=0, max_rows=8)[0]
        got = rows(stage.process(lease(tok, [
            call("calculator", expression="6*7"), call("fail", reason="x"), call("nope"),
            render_tool_call(ToolCall("calculator", {"expression": 7}))])))
        pid = env.pid
        assert pid is not None and not gone(pid)
    text = {r: tok.decode(got[r]["piece1_ids"]) for r in got}
    assert text[0] == "<tool_response>\n42\n</tool_response>" and got[0]["piece1_error"] is None
    assert got[1]["piece1_error"] == "tool_error" and "fail" in text[1]
    assert got[2]["piece1_error"] == "unknown_tool"
    assert "unknown tool 'nope'; the tools are calculator, fail, hang" in text[2]
    assert got[3]["piece1_error"] == "bad_call" and "bad arguments for calculator" in text[3]
    assert {r: (tool, error) for r, (tool, _, error) in stage.last_calls.items()} == {
        0: ("calculator", None), 1: ("fail", "tool_error"), 2: ("nope", "unknown_tool"),
        3: ("calculator", "bad_call")}
    wait_until(lambda: gone(pid), timeout=10, what="the server to exit")  # closed by its PID


def test_a_tools_refusal_is_a_tool_error_with_the_servers_message(env):
    obs = execute(env, calc("1/0"), CTX)
    assert obs.error == "tool_error" and obs.text.endswith("division by zero"), obs
    assert execute(env, calc("(1+2)/4"), CTX).text == "0.75"


def test_a_server_killed_between_calls_is_started_again_for_the_next_call(env):
    assert execute(env, calc("2+2"), CTX).text == "4"
    first = env.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: gone(first), timeout=10, what="the killed server to exit")
    obs = execute(env, calc("3*3"), CTX)
    assert (obs.text, obs.error) == ("9", None)
    assert env.restarts == 1 and env.pid not in (None, first)


def test_a_call_past_the_timeout_stops_the_server_and_the_next_call_gets_a_fresh_one():
    with closing(McpEnvironment(command=COMMAND, timeout_s=1.0)) as env:
        first = env.pid
        start = time.monotonic()
        obs = execute(env, render_tool_call(ToolCall("hang", {})), CTX)
        assert obs.error == "timeout" and "within 1s" in obs.text
        assert time.monotonic() - start < 1.0 + 10.0  # the wait, then the kill by PID
        assert first is not None
        wait_until(lambda: gone(first), timeout=10, what="the stuck server to be killed")
        assert execute(env, calc("5-7"), CTX).text == "-2"
        assert env.restarts == 1


def test_close_stops_the_server_by_its_pid_and_is_final(env):
    pid = env.pid
    assert pid is not None and not gone(pid)
    env.close()
    wait_until(lambda: gone(pid), timeout=10, what="the server to exit")
    env.close()  # idempotent (every turn stage of a worker closes the one environment)
    obs = execute(env, calc("1+1"), CTX)
    assert obs.error == "crashed" and env.pid is None


def test_a_server_that_does_not_start_names_the_key_and_leaves_nothing_running():
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ConfigValueError, match="^env.mcp_command: the MCP server did not start"):
        McpEnvironment(command=(sys.executable, "-c", "import sys; sys.exit(3)"), timeout_s=5.0)
    wait_until(lambda: all(gone(p.pid) for p in psutil.Process().children()
                           if p.pid not in before), timeout=10, what="no server left")


def test_a_running_server_over_streamable_http():
    port = free_port()
    server = subprocess.Popen([*COMMAND, "--http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            assert server.poll() is None, "the HTTP server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            except OSError:
                return False
            return True

        wait_until(listening, timeout=60, what="the HTTP server to listen")
        with closing(McpEnvironment(url=f"http://127.0.0.1:{port}/mcp", timeout_s=30.0)) as env:
            assert env.tools() == ("calculator", "fail", "hang") and env.pid is None
            assert execute(env, calc("6*7"), CTX).text == "42"
            assert execute(env, render_tool_call(ToolCall("fail", {"reason": "x"})),
                           CTX).error == "tool_error"
        assert server.poll() is None  # a server someone else runs is left running
    finally:
        server.kill()
        server.wait(timeout=10)
