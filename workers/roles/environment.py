"""The environment role: answers the tool call that ended a model turn (tasks ``env.{t}``).

One ``EnvironmentStage`` per turn t < T-1; one worker serves all of them
(``workers.roles.loop.serve_stages``). For each claimed row whose turn t ended in a tool call it
decodes the turn, builds the ``StepContext`` from the row (prompt, answer, turn, the calls of the
earlier turns: the environment keeps no state, the row does), runs ``execute`` (which turns every
failure of the call or of a user's environment into an error observation; the python tool runs in
the sandbox, the calculator in-process and bounded, a user's environment in a child process killed
past ``env.timeout_s``: ``workers.agent.isolated``, an MCP server's tools through the one server
the worker started: ``workers.agent.mcp_tools``; a call to a tool outside ``env.tools`` is an
"unknown_tool" observation), formats the observation (hermes form with a chat template: in the
template's tool-message turn, ``workers.agent.toolcall.chat_wrapping``), tokenises it with the
model's tokenizer and cuts its text so that the whole fits ``max_observation_tokens`` (the turn
wrapping is never cut: the model must go on as the assistant). Then either

* it writes ``obs{t}_ids`` / ``obs{t}_error``, which makes the row ready for ``rollout.{t+1}``; or
* it ENDS the trajectory, when the environment says done ("done") or the observation would leave
  no room in ``max_total_tokens`` for another model token ("budget"): the observation is not
  appended, and the assembled response columns, NULL in every later turn/obs cell and
  ``env_reward`` (the done observation's ``reward``, or NULL) are written in the same write
  (``workers.agent.trajectory.observation_writes``).

A row whose turn t did not call a tool (the trajectory ended at or before turn t: ``turn{t}_finish``
is not "tool", or NULL) is acked without work. A redelivered lease keeps the cells its predecessor
wrote (``workers.roles.loop.Parts``). The tool, latency and error kind of each call are kept
per row (``last_calls``) for the run's trace (``workers.runtime.trace``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from storage.schema import ROW_ID, Lease
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
from workers.agent.toolcall import (
    ToolCall,
    chat_wrapping,
    format_observation,
    observation_markers,
    parse_tool_call,
)
from workers.agent.trajectory import (
    FINISH_BUDGET,
    FINISH_DONE,
    FINISH_TOOL,
    History,
    observation_writes,
    turn_reads,
)
from workers.agent.trajectory import history as read_history
from workers.config import EnvironmentWorkerConfig
from workers.models.tokenizer import decode_response, encode_text
from workers.roles.loop import Parts
from workers.settings import HUB, AgentSettings

log = logging.getLogger(__name__)

ENV_READS = ("group_id", "iteration", "prompt_ids", "answer")


class EnvironmentStage:
    """The observations of turn ``turn`` (task ``env.{turn}``): see the module docstring."""

    whole_groups = False

    def __init__(self, env: Environment, tokenizer: Any, turn: int, *, max_turns: int,
                 max_total_tokens: int, max_observation_tokens: int, plain: bool,
                 max_rows: int, tools: tuple[str, ...],
                 on_call: Callable[[float, str | None], None] | None = None) -> None:
        if not 0 <= turn < max_turns - 1:
            raise ValueError(f"turn must be in [0, {max_turns - 1}), got {turn}")
        self.env, self.tokenizer, self.turn = env, tokenizer, turn
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.max_observation_tokens, self.plain = max_observation_tokens, plain
        self.tools = tools  # env.tools: the tools the model may call (empty: all served)
        self.wrapping = None if plain else chat_wrapping(tokenizer)
        self.task = f"env.{turn}"
        self.columns = (*ENV_READS, *turn_reads(turn + 1, turn))
        self.max_rows = max_rows
        self.last_tokens = 0
        # row id -> (tool, seconds, error kind or None) of the calls of the last lease (its trace)
        self.last_calls: dict[int, tuple[str, float, str | None]] = {}
        # (seconds, error kind or None) of each call executed: the worker's metrics
        self.on_call = on_call or (lambda seconds, error: None)

    def process(self, lease: Lease) -> Parts:
        row_ids, items, rewards = [], [], []
        self.last_calls = {}
        for row in lease.batch.to_pylist():
            hist = read_history(row, self.turn + 1, self.turn)
            if hist is None or hist.turns[-1].finish != FINISH_TOOL:
                continue  # ended at or before this turn: its later cells are written (NULL)
            call = parse_tool_call(decode_response(self.tokenizer, hist.turns[-1].ids),
                                   plain=self.plain)
            tool = call.name if isinstance(call, ToolCall) else "(malformed call)"

            def timed(seconds: float, error: str | None, row_id: int = row[ROW_ID],
                      tool: str = tool) -> None:
                self.last_calls[row_id] = (tool, seconds, error)
                self.on_call(seconds, error)

            obs, ids, end = observe(self.env, self.tokenizer, decode_response(
                self.tokenizer, row["prompt_ids"]), row["answer"] or "", hist, plain=self.plain,
                max_observation_tokens=self.max_observation_tokens,
                max_total_tokens=self.max_total_tokens, on_call=timed,
                allowed=self.tools, wrapping=self.wrapping)
            row_ids.append(row[ROW_ID])
            items.append((hist, ids, obs.error, end))
            rewards.append(obs.reward if obs.done else None)
        self.last_tokens = sum(len(it[1]) for it in items if it[3] is None)
        return Parts(tuple(observation_writes(row_ids, self.turn, self.max_turns, items,
                                              rewards)))

    def close(self) -> None:
        """Close the environment (a user's child, an MCP server); the stages of a worker share
        one, so each may close it: an environment's ``close`` is idempotent."""
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


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
    texts = [decode_response(tokenizer, t.ids) for t in hist.turns]
    calls = tuple(c for c in (parse_tool_call(x, plain=plain) for x in texts[:-1])
                  if isinstance(c, ToolCall))
    context = StepContext(prompt, answer, len(hist.turns) - 1, calls)
    start = time.perf_counter()
    obs = execute(env, texts[-1], context, plain=plain, allowed=allowed)
    if on_call is not None:
        on_call(time.perf_counter() - start, obs.error)
    ids = observation_ids(tokenizer, obs.text, plain, wrapping, max_observation_tokens)
    end = None
    if obs.done:
        end = FINISH_DONE
    elif hist.length() + len(ids) >= max_total_tokens:  # no room for a model token
        end = FINISH_BUDGET
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
    the MCP server's tools (its server started here, once: ``workers.agent.mcp_tools``)."""
    if agent.fn == "mcp":
        from workers.agent.mcp_tools import McpEnvironment  # the mcp SDK: only where it is used

        return McpEnvironment(command=agent.env.mcp_command, url=agent.env.mcp_url,
                              timeout_s=agent.timeout_s)
    if agent.fn == "python":
        from workers.agent.sandbox import memory_plan

        limits = agent.sandbox.limits()
        log.info("python tool sandbox: %s", memory_plan(limits).describe())
        return PythonEnvironment(limits=limits)
    if agent.fn in BUILTIN_ENVIRONMENTS:  # pure and bounded: in-process
        return load_environment(agent.fn)
    if agent.fn == HUB:  # env.hub's tools, in the child like any user code
        from workers.agent.hub import hub_spec

        return IsolatedEnvironment(hub_spec(agent.env.hub), agent.timeout_s)
    return IsolatedEnvironment(agent.fn, agent.timeout_s)  # user code may hang


def environment_stages(env: Environment, tokenizer: Any, agent: AgentSettings, *,
                       max_rows: int, on_call: Callable[[float, str | None], None] | None = None
                       ) -> list[EnvironmentStage]:
    """One stage per ``env.{t}`` task (t < max_turns - 1); ``on_call(seconds, error)`` after each
    executed call (``workers.runtime.metrics.WorkerMetrics.tool_call``)."""
    return [EnvironmentStage(env, tokenizer, t, max_turns=agent.max_turns,
                             max_total_tokens=agent.max_total_tokens,
                             max_observation_tokens=agent.max_observation_tokens,
                             plain=agent.env.plain, max_rows=max_rows, on_call=on_call,
                             tools=agent.env.tools)
            for t in range(agent.max_turns - 1)]


def build_environment(cfg: EnvironmentWorkerConfig,
                      on_call: Callable[[float, str | None], None] | None = None
                      ) -> list[EnvironmentStage]:
    from workers.models.local import load_tokenizer  # (imports torch: only a real worker needs it)

    if cfg.agent.max_turns < 2:
        raise ValueError(f"an environment worker needs rollout.max_turns >= 2, got "
                         f"{cfg.agent.max_turns}: a single-turn run has no tool calls to answer")
    return environment_stages(make_environment(cfg.agent), load_tokenizer(cfg.model_path),
                              cfg.agent, max_rows=cfg.rows_per_claim, on_call=on_call)
