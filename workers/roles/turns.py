"""Multi-turn tool use, the rollout side: how a generation becomes a turn, and the later turns.

A trajectory is one row of the samples table; its turns are tasks of that table
(``workers.schema.turn_columns``, docs/training.md "Multi-turn trajectories")::

    rollout (turn 0, whole groups) -> env.0 -> rollout.1 -> env.1 -> ... -> rollout.{T-1}
          \\ ended here: response_* written, later cells NULL -> reward, reference, trainer

``TurnPolicy`` is the one code path of "generate a turn, decide whether it ends the trajectory"
that turn 0 (``RolloutStage`` with an agent) and ``RolloutTurnStage`` (turn t >= 1) share: the
sampling parameters of a turn (its token limit: max_new_tokens or the budget left; the tool-call
end marker as a stop token when it is one token) and the writes of its rows
(``workers.agent.trajectory.turn_writes``). A turn's write + ack is the unit of progress: a
redelivered lease whose cells a predecessor wrote keeps them (``workers.roles.loop.Parts``), so no
turn is applied twice and none is lost.

``RolloutTurnStage`` claims ``rollout.{t}`` rows one by one (not whole groups: the rows of a group
end at different turns), rebuilds each row's context (prompt + turn0 + obs0 + ...), and generates
ONE continuation per row under the version rules of ``RolloutStage`` (whose engine, weights and
lock it shares). A row whose trajectory ended earlier (a NULL cell) is acked without work.
Sampling is seeded per row by (run seed, group id, turn, policy version, row id): the rows of a
group have different contexts and each must draw its own tokens, whoever claims it, after a
redelivery too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.schema import ROW_ID, Lease
from workers.agent.toolcall import PLAIN_CALL_END, TOOL_CALL_END
from workers.agent.trajectory import (
    History,
    close_turn,
    context_ids,
    history,
    turn_limit,
    turn_reads,
    turn_writes,
)
from workers.engines.base import Generation, SamplingParams
from workers.roles.loop import Parts

if TYPE_CHECKING:
    from workers.roles.rollout import RolloutStage

TURN_READS = ("group_id", "iteration", "min_policy_version", "prompt_ids")


def marker_ids(tokenizer: Any, tool_format: str) -> tuple[int, ...]:
    """The token ids of the tool-call end marker of ``tool_format`` ("plain" | "hermes")."""
    text = PLAIN_CALL_END if tool_format == "plain" else TOOL_CALL_END
    ids = tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"the tokenizer encodes the tool-call end marker {text!r} as nothing")
    return ids


def turn_seed(run_seed: int, group_id: int, turn: int, policy_version: int, row_id: int) -> int:
    return (run_seed * 1_000_003 + group_id * 7_919 + policy_version * 104_729
            + turn * 15_485_863 + row_id * 32_452_843) % (2**31 - 1)


@dataclass(frozen=True)
class TurnPolicy:
    """The agent's knobs as a turn needs them, and the turn path turn 0 and turns t >= 1 share."""

    max_turns: int  # T: turns 0..T-1; turn T-1 always ends the trajectory
    max_total_tokens: int  # response tokens of a trajectory (turns + observations)
    max_new_tokens: int  # per turn
    marker: tuple[int, ...]  # the tool-call end marker's ids (``marker_ids``)
    # a gateway run: the turns are an agent's calls, turn 0 too is generated row by row
    # (``RolloutTurnStage`` with turn 0), and no turn ends a trajectory: the agent does
    agent_driven: bool = False

    def limit(self, hist: History) -> tuple[int, bool]:
        return turn_limit(hist, self.max_new_tokens, self.max_total_tokens)

    def params(self, base: SamplingParams, hists: History | Sequence[History]) -> SamplingParams:
        """``base`` for the next turn of ``hists``: as many new tokens as the roomiest row may
        take (each row is cut to its own limit after), and a one-token marker as a stop token
        (a longer one cannot stop the engine: the turn is cut after it, ``close_turn``)."""
        rows = [hists] if isinstance(hists, History) else list(hists)
        limit = max(self.limit(h)[0] for h in rows)
        stops = base.stop_token_ids + (self.marker if len(self.marker) == 1 else ())
        return dataclasses.replace(base, max_new_tokens=limit, stop_token_ids=stops)

    def close(self, t: int, row_ids: Sequence[int], hists: Sequence[History],
              generations: Sequence[Generation], version: int) -> Parts:
        """The writes of turn ``t``: each row's generation made a turn (``close_turn``), and the
        rows it ends assembled (``turn_writes``)."""
        items = []
        for hist, gen in zip(hists, generations, strict=True):
            limit, budget_bound = self.limit(hist)
            items.append((hist, close_turn(gen, version=version, marker=self.marker,
                                           limit=limit, budget_bound=budget_bound)))
        return Parts(tuple(turn_writes(row_ids, t, self.max_turns, items,
                                       ends=not self.agent_driven)))


class RolloutTurnStage:
    """Turn t >= 1 of every trajectory (task ``rollout.{t}``): see the module docstring."""

    whole_groups = False
    max_cuts = 0  # (a rollout worker's first stage may be this one: a gateway run's turn 0)

    def __init__(self, rollout: RolloutStage, policy: TurnPolicy, turn: int, *,
                 max_rows: int) -> None:
        first = 0 if policy.agent_driven else 1
        if not first <= turn < policy.max_turns:
            raise ValueError(f"turn must be in [{first}, {policy.max_turns}), got {turn}")
        self.rollout, self.policy, self.turn = rollout, policy, turn
        self.task = f"rollout.{turn}" if turn else "rollout"
        self.columns = (*TURN_READS, *turn_reads(turn, turn))
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> Parts:
        rows = lease.batch.to_pylist()
        live = [(row, h) for row in rows
                if (h := history(row, self.turn, self.turn)) is not None]
        self.last_tokens = 0
        if not live:  # every row ended earlier: ack, nothing to write
            return Parts()
        stage = self.rollout
        stage.ensure_version(max(row["min_policy_version"] for row, _ in live))
        with stage.engine_lock:  # the version that generates is the version the turn records
            version = stage.engine.policy_version
            seeds = tuple(turn_seed(stage.seed, row["group_id"], self.turn, version, row[ROW_ID])
                          for row, _ in live)
            params = dataclasses.replace(self.policy.params(stage.params, [h for _, h in live]),
                                         seed=seeds[0], prompt_seeds=seeds)
            contexts = [context_ids(row["prompt_ids"], h) for row, h in live]
            generations = [g[0] for g in stage.engine.generate(contexts, 1, params)]
        self.last_tokens = sum(len(g.token_ids) for g in generations)
        return self.policy.close(self.turn, [row[ROW_ID] for row, _ in live],
                                 [h for _, h in live], generations, version)


    def close(self) -> None:
        if self.turn == 0:  # a gateway run's first stage stands in for ``rollout``'s own
            self.rollout.close()


def turn_stages(rollout: RolloutStage, policy: TurnPolicy, *, max_rows: int
                ) -> list[RolloutTurnStage]:
    """The stages of turns 1..T-1, which a rollout worker serves beside ``rollout``; a gateway
    run's turn 0 too (its rows one by one), in place of ``rollout``'s own."""
    first = 0 if policy.agent_driven else 1
    return [RolloutTurnStage(rollout, policy, t, max_rows=max_rows)
            for t in range(first, policy.max_turns)]
