"""The answer to a tool call, as the environment role (``workers.roles.environment``) and the
multi-turn evaluator (``workers.tasks.evaluate``) both make it: run the call in the configured
environment, format the observation, tokenise it as the model must read it, cut it to its bound,
and say whether it ends the trajectory.

``execute`` turns every failure of the call or of a user's environment into an error
observation: the python tool runs in the sandbox, the calculator in-process and bounded, a user's
environment in a child process killed past ``env.timeout_s`` (``workers.agent.isolated``); a call
to a tool outside ``env.tools`` is an "unknown_tool" observation. The observation is formatted
(hermes form with a chat template: in the template's tool-message turn,
``workers.agent.toolcall.chat_wrapping``), tokenised with the model's tokenizer and its text cut
so that the whole fits ``max_observation_tokens`` (the turn wrapping is never cut: the model must
go on as the assistant).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from workers.agent.environments import (
    BUILTIN_ENVIRONMENTS,
    Environment,
    Observation,
    PythonEnvironment,
    StepContext,
    execute,
    load_environment,
)
from workers.agent.isolated import IsolatedEnvironment
from workers.agent.pieces import END_BUDGET, FINISH_DONE, History
from workers.agent.toolcall import (
    ToolCall,
    format_observation,
    observation_markers,
    parse_tool_call,
)
from workers.models.tokenizer import decode_response, encode_text
from workers.settings import HUB, AgentSettings

log = logging.getLogger(__name__)


def observe(env: Environment, tokenizer: Any, prompt: str, answer: str, hist: History, *,
            plain: bool, max_observation_tokens: int, max_total_tokens: int,
            on_call: Callable[[float, str | None], None] | None = None,
            allowed: tuple[str, ...] = (), wrapping: tuple[str, str] | None = None
            ) -> tuple[Observation, list[int], str | None]:
    """The answer to the call that ended ``hist``'s last turn, as the environment role and the
    multi-turn evaluator (``workers.tasks.evaluate``) both make it: the observation, its ids
    (formatted, tokenised, cut to ``max_observation_tokens``) and the trajectory's
    finish_reason if it ends here ("done", or "budget": no room left for a model token), else
    None. ``on_call(seconds, error)`` times the call itself; ``allowed``: ``env.tools``;
    ``wrapping``: the chat template's tool-message turn (``chat_wrapping``; None: bare block)."""
    texts = [decode_response(tokenizer, t.ids) for t in hist.turns()]
    calls = tuple(c for c in (parse_tool_call(x, plain=plain) for x in texts[:-1])
                  if isinstance(c, ToolCall))
    context = StepContext(prompt, answer, len(texts) - 1, calls)
    start = time.perf_counter()
    obs = execute(env, texts[-1], context, plain=plain, allowed=allowed)
    if on_call is not None:
        on_call(time.perf_counter() - start, obs.error)
    ids = observation_ids(tokenizer, obs.text, plain, wrapping, max_observation_tokens)
    end = None
    if obs.done:
        end = FINISH_DONE
    elif hist.length() + len(ids) >= max_total_tokens:  # no room for a model token
        end = END_BUDGET
    return obs, ids, end


def observation_ids(tokenizer: Any, text: str, plain: bool, wrapping: tuple[str, str] | None,
                    max_tokens: int) -> list[int]:
    """The formatted observation's ids, cut to ``max_tokens``. The markers around it (the chat
    template's tool-message turn, or the bare block) are the template's own tokens; the text is
    a tool's output, so it is encoded as ordinary text (``encode_text``): whatever it spells, it
    never becomes a control token, so it cannot end the tool message or open a forged turn. With
    a chat template's ``wrapping`` only the text is cut, the turn wrapping is kept whole."""
    if plain:  # no markers: the whole piece is text
        return encode_text(tokenizer, format_observation(text, plain=True))[:max_tokens]
    before, after = (encode_markers(tokenizer, m) for m in observation_markers(False, wrapping))
    body = encode_text(tokenizer, text)
    if wrapping is None:
        return (before + body + after)[:max_tokens]
    return before + body[:max(max_tokens - len(before) - len(after), 0)] + after


def encode_markers(tokenizer: Any, markers: str) -> list[int]:
    """Ids of the template's own markers (written by us, never by a tool): its control strings
    become its control tokens."""
    return [int(i) for i in tokenizer(markers, add_special_tokens=False)["input_ids"]]


def make_environment(agent: AgentSettings) -> Environment:
    """The configured environment; the python tool with the configured sandbox limits; "mcp":
    the MCP server's tools (its server started here, once: ``workers.agent.mcp_tools``); "hub":
    env.hub's tools, in a child like any user code (``workers.agent.hub``)."""
    if agent.fn == "mcp":
        from workers.agent.mcp_tools import McpEnvironment  # the mcp SDK: only where it is used

        return McpEnvironment(command=agent.env.mcp_command, url=agent.env.mcp_url,
                              timeout_s=agent.timeout_s)
    if agent.fn == HUB:
        from workers.agent.hub import hub_spec

        return IsolatedEnvironment(hub_spec(agent.env.hub), agent.timeout_s)
    if agent.fn == "python":
        from workers.agent.sandbox import memory_plan

        limits = agent.sandbox.limits()
        log.info("python tool sandbox: %s", memory_plan(limits).describe())
        return PythonEnvironment(limits=limits)
    if agent.fn in BUILTIN_ENVIRONMENTS:  # pure and bounded: in-process
        return load_environment(agent.fn)
    return IsolatedEnvironment(agent.fn, agent.timeout_s)  # user code may hang
