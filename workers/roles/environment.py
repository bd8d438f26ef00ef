"""The environment role: answers the tool call that ended a model turn (tasks ``env.{k}``).

One ``EnvironmentStage`` per ``env.{k}`` task of the table (``workers.schema.piece_tasks``: piece
k is an observation); one worker serves all of them (``workers.roles.loop.serve_stages``). For
each claimed row whose last piece ended in a tool call it decodes the turn (its model pieces
joined: a cut may have split it), builds the ``StepContext`` from the row (prompt, answer, turn,
the calls of the earlier turns: the environment keeps no state, the row does) and makes the
observation (``workers.agent.observe.observe``: the call run, formatted, tokenised, cut to
``max_observation_tokens``). Then either

* it writes the observation as piece k, which makes the row ready for ``rollout.{k+1}``; or
* it ENDS the trajectory, when the environment says done ("done") or the observation would leave
  no room in ``max_total_tokens`` for another model token ("budget"): the observation is not
  appended (its error kept), and the assembled response columns, NULL in every later piece cell
  and ``env_reward`` (the done observation's ``reward``, or NULL) are written in the same write
  (``workers.agent.piece_rows.piece_writes``).

The store delivers a row to ``env.{k}`` only when its piece k-1 handed it to the environment; one
that comes otherwise is acked untouched. A redelivered lease keeps the cells its predecessor wrote
(``workers.runtime.leases.Parts``). The tool, latency and error kind of each call are kept per row
(``last_calls``) for the run's trace (``workers.runtime.trace``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from storage.schema import ROW_ID, Lease
from workers.agent.environments import Environment
from workers.agent.observe import make_environment, observe
from workers.agent.piece_rows import Step, piece_reads, piece_writes, read_history
from workers.agent.pieces import END_TOOL, TO_MODEL, observation
from workers.agent.toolcall import ToolCall, chat_wrapping, parse_tool_call
from workers.config import EnvironmentWorkerConfig
from workers.models.tokenizer import decode_response
from workers.runtime.leases import Parts
from workers.schema import piece_bound, piece_of, piece_tasks
from workers.settings import AgentSettings

ENV_READS = ("group_id", "iteration", "prompt_ids", "answer")


class EnvironmentStage:
    """The observations of piece ``piece`` (task ``env.{piece}``): see the module docstring."""

    whole_groups = False

    def __init__(self, env: Environment, tokenizer: Any, piece: int, *, bound: int,
                 max_total_tokens: int, max_observation_tokens: int, plain: bool,
                 max_rows: int, tools: tuple[str, ...],
                 on_call: Callable[[float, str | None], None] | None = None) -> None:
        if not 1 <= piece < bound:
            raise ValueError(f"an observation is piece k in [1, {bound}), got {piece}")
        self.env, self.tokenizer, self.piece, self.bound = env, tokenizer, piece, bound
        self.max_total_tokens = max_total_tokens
        self.max_observation_tokens, self.plain = max_observation_tokens, plain
        self.tools = tools  # env.tools: the tools the model may call (empty: all served)
        self.wrapping = None if plain else chat_wrapping(tokenizer)
        self.task = f"env.{piece}"
        self.columns = (*ENV_READS, *piece_reads(piece))
        self.max_rows = max_rows
        self.last_tokens = 0
        # row id -> (tool, seconds, error kind or None) of the calls of the last lease (its trace)
        self.last_calls: dict[int, tuple[str, float, str | None]] = {}
        # (seconds, error kind or None) of each call executed: the worker's metrics
        self.on_call = on_call or (lambda seconds, error: None)

    def process(self, lease: Lease) -> Parts:
        steps = []
        self.last_calls = {}
        for row in lease.batch.to_pylist():
            hist = read_history(row, self.piece)
            if hist is None or hist.pieces[-1].end != END_TOOL:
                continue  # not the environment's to continue (ended, or the model's)
            text = decode_response(self.tokenizer, hist.turns()[-1].ids)
            call = parse_tool_call(text, plain=self.plain)
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
            piece = observation(ids, obs.error) if end is None else observation(ids, obs.error,
                                                                                end)
            steps.append(Step(row[ROW_ID], hist, piece, end or TO_MODEL,
                              obs.reward if obs.done else None))
        self.last_tokens = sum(len(s.piece.ids) for s in steps if not s.ends and s.piece)
        return Parts(tuple(piece_writes(self.piece, self.bound, steps)))

    def close(self) -> None:
        """Close the environment (a user's child, an MCP server); the stages of a worker share
        one, so each may close it: an environment's ``close`` is idempotent."""
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


def environment_stages(env: Environment, tokenizer: Any, agent: AgentSettings, *,
                       max_cuts: int, max_rows: int,
                       on_call: Callable[[float, str | None], None] | None = None
                       ) -> list[EnvironmentStage]:
    """One stage per ``env.{k}`` task of the table (``max_cuts``: partial rollout's bound, 0
    none); ``on_call(seconds, error)`` after each executed call
    (``workers.runtime.metrics.WorkerMetrics.tool_call``)."""
    bound = piece_bound(agent.max_turns, max_cuts)
    return [EnvironmentStage(env, tokenizer, piece_of(t.name), bound=bound,
                             max_total_tokens=agent.max_total_tokens,
                             max_observation_tokens=agent.max_observation_tokens,
                             plain=agent.env.plain, max_rows=max_rows, on_call=on_call,
                             tools=agent.env.tools)
            for t in piece_tasks(agent.max_turns, max_cuts) if t.name.startswith("env.")]


def build_environment(cfg: EnvironmentWorkerConfig,
                      on_call: Callable[[float, str | None], None] | None = None
                      ) -> list[EnvironmentStage]:
    from workers.models.local import load_tokenizer  # (imports torch: only a real worker needs it)

    if cfg.agent.max_turns < 2:
        raise ValueError(f"an environment worker needs rollout.max_turns >= 2, got "
                         f"{cfg.agent.max_turns}: a single-turn run has no tool calls to answer")
    return environment_stages(make_environment(cfg.agent), load_tokenizer(cfg.model_path),
                              cfg.agent, max_cuts=cfg.cuts.max_cuts,
                              max_rows=cfg.rows_per_claim, on_call=on_call)
