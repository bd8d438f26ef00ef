"""Agents the gateway runs of tests/streamflow/test_agent_run.py name in ``agent.fn``: written
against the OpenAI SDK as a user would, deterministic given the answers they get (an agent run
again after its worker died repeats its calls exactly, which the gateway answers from the row)."""

from __future__ import annotations

from openai import APIStatusError, OpenAI


def two_calls(base_url: str, api_key: str, prompt: str, answer: str) -> float:
    """Asks, then asks again after a user message, whatever the model said: every episode is two
    calls (the built-in model seldom writes a tool call by itself). Enough retries to outlast a
    gateway restart. Reward: shorter final answers score more (a signal the tiny model has)."""
    llm = OpenAI(base_url=base_url, api_key=api_key, max_retries=12)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    content = ""
    for follow_up in (" ", None):
        try:
            reply = llm.chat.completions.create(model="policy", messages=messages)
        except APIStatusError as exc:  # out of tokens, or an episode ended before a re-run
            if exc.status_code in (400, 409):
                break
            raise
        message = reply.choices[0].message
        content = message.content or ""
        if follow_up is None:
            break
        messages += [message.model_dump(exclude_none=True),
                     {"role": "user", "content": follow_up}]
    return 1.0 / (1.0 + len(content))
