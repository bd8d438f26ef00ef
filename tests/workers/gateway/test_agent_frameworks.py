"""An agent framework drives the gateway unmodified: the OpenAI Agents SDK (``openai-agents``)
with its own function tool runs a multi-turn tool-calling episode through the gateway's chat
completions endpoint (its only configuration: a client with the episode's ``base_url`` and
``api_key``), and the row holds exactly what the gateway fed the model and what it answered."""

from __future__ import annotations

import httpx
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from storage.schema import ROW_ID
from tests.workers.gateway.gateway_rig import SECRET, TABLE, Rig
from workers.gateway.book import episode_key


@function_tool
def calculator(expression: str) -> str:
    """Evaluate a product of two integers."""
    a, b = expression.split("*")
    return str(int(a) * int(b))


def test_the_openai_agents_sdk_runs_a_tool_episode_through_the_gateway(rig: Rig) -> None:
    set_tracing_disabled(True)  # (its traces would go to OpenAI's servers)
    row = rig.episodes()[0]
    key = episode_key(SECRET, row[ROW_ID])
    model = OpenAIChatCompletionsModel(
        model="policy", openai_client=AsyncOpenAI(base_url=rig.url(), api_key=key))
    agent = Agent(name="calculator", instructions="Use the calculator.", tools=[calculator],
                  model=model)
    result = Runner.run_sync(agent, row["agent_prompt"], max_turns=3)
    assert result.final_output == row["answer"]  # it called the tool, then answered with it
    calls = sorted((s for s in rig.served if s.row_id == row[ROW_ID]), key=lambda s: s.call)
    assert [s.call for s in calls] == [0, 1]
    reply = httpx.post(f"{rig.url()}/streamflow/end", json={"reward": 1.0},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert reply.json()["state"] == "ended"
    lease = rig.client.claim(TABLE, "reward", ("prompt_ids", "response_ids", "env_reward"), 64,
                             timeout=5.0)
    (got,) = [r for r in lease.batch.to_pylist() if r[ROW_ID] == row[ROW_ID]]
    assert got["prompt_ids"] == calls[0].fed
    assert got["response_ids"] == calls[0].turn + calls[1].fed + calls[1].turn
    assert got["env_reward"] == 1.0
