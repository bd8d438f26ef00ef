"""Multi-turn trajectories as rows of the samples table: the pure functions every turn task shares.

A trajectory's state lives in its row (``workers.schema.turn_columns``): ``turn{t}_*`` is the
model's turn t, written by ``rollout`` (t = 0) or ``rollout.{t}``; ``obs{t}_*`` the environment's
answer to it, written by ``env.{t}``. This module owns what those tasks compute from a row, with no
store and no model: the history read back from a claimed row, the context the next turn is
generated from, how a generation becomes a turn (cut after the tool-call end marker, cut at the
remaining token budget, its finish), whether that ends the trajectory, the assembled
single-turn-compatible columns, and the write batches of one turn's rows.

Invariants:

* The written turn/obs cells of a row are a prefix of turn0, obs0, turn1, obs1, ...: whoever ends
  a trajectory writes the assembled columns, ``env_reward`` (the environment's final reward, else
  NULL) and NULL in every later turn/obs cell in the SAME write, so each later turn task finds the row ready, reads a NULL, and acks it untouched. A NULL
  cell (``turn{t}_ids``, ``turn{t}_finish``, ``obs{t}_ids``) therefore means "ended before this".
* ``response_ids`` = turn0 + obs0 + turn1 + ... + the last turn; ``response_loss_mask`` is 1 on
  model tokens and 0 on observation tokens; ``response_logprobs`` is 0.0 on observation tokens.
* ``policy_version`` is turn 0's version, the oldest (versions only grow): the trainer counts a
  trajectory as stale as its oldest token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from storage.schema import ROW_ID
from workers.engines.base import FINISH_STOP, Generation
from workers.schema import ENV_REWARD_FIELD, SAMPLES_SCHEMA, turn_columns

FINISH_TOOL = "tool"  # the turn ended in a tool call (its end marker is the turn's last token)
FINISH_BUDGET = "budget"  # max_total_tokens cut the turn, or left no room for the observation
FINISH_DONE = "done"  # the environment ended the trajectory (Observation.done)
ASSEMBLED = ("response_ids", "response_logprobs", "response_loss_mask", "policy_version",
             "finish_reason")


@dataclass(frozen=True)
class Turn:
    """One model turn of a trajectory."""

    ids: list[int]  # [L_t] model tokens, the tool-call end marker or stop token included
    logprobs: list[float]  # [L_t] behaviour log-probs
    version: int  # policy version that generated it
    finish: str  # FINISH_TOOL | "stop" | "length" | FINISH_BUDGET


@dataclass(frozen=True)
class History:
    """A trajectory so far: turns 0..k-1 and the observations that answered them (k or k-1)."""

    turns: tuple[Turn, ...] = ()
    observations: tuple[tuple[int, ...], ...] = ()  # [O_t] each

    def length(self) -> int:
        """Response tokens so far (what ``max_total_tokens`` bounds)."""
        return sum(len(t.ids) for t in self.turns) + sum(len(o) for o in self.observations)

    def with_turn(self, turn: Turn) -> History:
        return History((*self.turns, turn), self.observations)

    def with_observation(self, ids: Sequence[int]) -> History:
        return History(self.turns, (*self.observations, tuple(ids)))


@dataclass(frozen=True)
class Assembled:
    """The single-turn-compatible columns of an ended trajectory (``ASSEMBLED``)."""

    response_ids: list[int]  # [L]
    response_logprobs: list[float]  # [L], 0.0 at observation tokens
    response_loss_mask: list[int]  # [L], 1 model token, 0 observation token
    policy_version: int
    finish_reason: str


def turn_reads(turns: int, observations: int) -> tuple[str, ...]:
    """The columns of turns 0..turns-1 and observations 0..observations-1 (what a turn task
    claims to rebuild the history)."""
    names: list[str] = []
    for t in range(turns):
        names += [f"turn{t}_ids", f"turn{t}_logprobs", f"turn{t}_version", f"turn{t}_finish"]
    return (*names, *(f"obs{t}_ids" for t in range(observations)))


def history(row: Mapping[str, Any], turns: int, observations: int) -> History | None:
    """The history in a claimed row (a ``to_pylist`` dict with ``turn_reads(turns,
    observations)``); None when a cell of it is NULL: the trajectory has ended."""
    got: list[Turn] = []
    for t in range(turns):
        ids, finish = row[f"turn{t}_ids"], row[f"turn{t}_finish"]
        if ids is None or finish is None:
            return None
        got.append(Turn(list(ids), list(row[f"turn{t}_logprobs"]),
                        int(row[f"turn{t}_version"]), finish))
    obs = [row[f"obs{t}_ids"] for t in range(observations)]
    if any(o is None for o in obs):
        return None
    return History(tuple(got), tuple(tuple(o) for o in obs))


def context_ids(prompt: Sequence[int], hist: History) -> list[int]:
    """prompt + turn0 + obs0 + turn1 + ...: what the next turn is generated from."""
    out = list(prompt)
    for i, turn in enumerate(hist.turns):
        out += turn.ids
        if i < len(hist.observations):
            out += hist.observations[i]
    return out


def marker_end(ids: Sequence[int], marker: Sequence[int]) -> int | None:
    """The index just past the first occurrence of ``marker`` in ``ids``; None without one."""
    m = len(marker)
    if m == 0:
        return None
    for i in range(len(ids) - m + 1):
        if list(ids[i:i + m]) == list(marker):
            return i + m
    return None


def close_turn(gen: Generation, *, version: int, marker: Sequence[int], limit: int,
               budget_bound: bool) -> Turn:
    """The turn a generation is. Tokens past ``limit`` (this turn's share: max_new_tokens or the
    budget left) never happened; the turn ends just after the first tool-call end ``marker``
    (an engine that cannot stop on a multi-token marker generates past it: those tokens and their
    log-probs are dropped). ``budget_bound``: ``limit`` is the budget's, not max_new_tokens'."""
    ids, logprobs = list(gen.token_ids[:limit]), list(gen.logprobs[:limit])
    end = marker_end(ids, marker)
    if end is not None:
        return Turn(ids[:end], logprobs[:end], version, FINISH_TOOL)
    if gen.finish_reason == FINISH_STOP and len(gen.token_ids) <= limit:
        return Turn(ids, logprobs, version, FINISH_STOP)
    return Turn(ids, logprobs, version, FINISH_BUDGET if budget_bound else "length")


def turn_limit(hist: History, max_new_tokens: int, max_total_tokens: int) -> tuple[int, bool]:
    """(tokens the next turn may generate, whether the budget rather than max_new_tokens set it).
    At least 1: a turn task is only reached while the budget has room (``env.{t}`` ends a
    trajectory whose observation would leave none)."""
    left = max_total_tokens - hist.length()
    return max(min(max_new_tokens, left), 1), left < max_new_tokens


def turn_end(turn: Turn, t: int, max_turns: int) -> str | None:
    """The trajectory's finish_reason if turn ``t`` ends it (no tool call, or the last turn
    allowed: "tool" then says it was out of turns), None when the environment answers next."""
    if turn.finish != FINISH_TOOL:
        return turn.finish
    return FINISH_TOOL if t == max_turns - 1 else None


def assemble(hist: History, finish_reason: str) -> Assembled:
    """The ended trajectory's response: turns and observations concatenated, in order."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for i, turn in enumerate(hist.turns):
        ids += turn.ids
        logprobs += turn.logprobs
        mask += [1] * len(turn.ids)
        if i < len(hist.observations):
            obs = hist.observations[i]
            ids += obs
            logprobs += [0.0] * len(obs)
            mask += [0] * len(obs)
    return Assembled(ids, logprobs, mask, hist.turns[0].version, finish_reason)


# ----------------------------------------------------------------------------- write batches
def _types(max_turns: int) -> dict[str, pa.DataType]:
    return {f.name: f.type for f in (*SAMPLES_SCHEMA, *turn_columns(max_turns), ENV_REWARD_FIELD)}


def later_columns(max_turns: int, t: int) -> tuple[str, ...]:
    """The turn/obs columns after turn t (obs t onwards): NULL once the trajectory ends at t."""
    names = [f.name for f in turn_columns(max_turns)]
    first = f"obs{t}_ids" if t < max_turns - 1 else None
    return tuple(names[names.index(first):]) if first else ()


def _batch(row_ids: Sequence[int], values: dict[str, list[Any]],
           types: dict[str, pa.DataType]) -> pa.RecordBatch:
    arrays = {ROW_ID: pa.array(row_ids, pa.uint64())}
    arrays.update({name: pa.array(v, types[name]) for name, v in values.items()})
    return pa.RecordBatch.from_pydict(arrays)


def _ended(max_turns: int, t: int, items: Sequence[tuple[History, str]],
           override: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The assembled columns of trajectories ending at turn/obs t, NULL in every later cell and
    in ``env_reward`` (``override``: cells this write sets itself)."""
    done = [assemble(h, reason) for h, reason in items]
    values: dict[str, list[Any]] = {name: [getattr(a, name) for a in done] for name in ASSEMBLED}
    values.update({name: [None] * len(items) for name in later_columns(max_turns, t)})
    values[ENV_REWARD_FIELD.name] = [None] * len(items)
    values.update(override)
    return values


def turn_writes(row_ids: Sequence[int], t: int, max_turns: int,
                items: Sequence[tuple[History, Turn]], *, ends: bool = True
                ) -> list[pa.RecordBatch]:
    """The writes of model turn ``t`` for rows ``row_ids`` (their history before the turn, and the
    turn): rows that go on write ``turn{t}_*``; rows the turn ends write it with the assembled
    columns and the NULL fill. One batch per column set (a batch holds one set for all rows).
    ``ends`` False (a gateway run): no turn ends its trajectory, the agent does
    (``episode_end_writes``)."""
    types = _types(max_turns)

    def cells(turns: Sequence[Turn]) -> dict[str, list[Any]]:
        return {f"turn{t}_ids": [x.ids for x in turns],
                f"turn{t}_logprobs": [x.logprobs for x in turns],
                f"turn{t}_version": [x.version for x in turns],
                f"turn{t}_finish": [x.finish for x in turns]}

    going, ending = [], []
    for rid, (hist, turn) in zip(row_ids, items, strict=True):
        reason = turn_end(turn, t, max_turns) if ends else None
        (going if reason is None else ending).append((rid, hist.with_turn(turn), turn, reason))
    out = []
    if going:
        out.append(_batch([g[0] for g in going], cells([g[2] for g in going]), types))
    if ending:
        values = _ended(max_turns, t, [(e[1], e[3]) for e in ending],
                        cells([e[2] for e in ending]))
        out.append(_batch([e[0] for e in ending], values, types))
    return out


def observation_writes(row_ids: Sequence[int], t: int, max_turns: int,
                       items: Sequence[tuple[History, list[int], str | None, str | None]],
                       rewards: Sequence[float | None] | None = None) -> list[pa.RecordBatch]:
    """The writes of observation ``t``. Each item: (history through turn t, the observation's
    ids, its error kind, the trajectory's finish_reason if the environment ends it here, else
    None); ``rewards``: each item's ``Observation.reward`` (written as ``env_reward`` when the
    row ends here). An ending row's observation is not appended: ``obs{t}_ids`` is NULL, its
    error kept."""
    rewards = list(rewards) if rewards is not None else [None] * len(items)
    types = _types(max_turns)
    going = [(rid, it) for rid, it in zip(row_ids, items, strict=True) if it[3] is None]
    ending = [(rid, it, r) for rid, it, r in zip(row_ids, items, rewards, strict=True)
              if it[3] is not None]
    out = []
    if going:
        out.append(_batch([g[0] for g in going], {
            f"obs{t}_ids": [g[1][1] for g in going],
            f"obs{t}_error": [g[1][2] for g in going]}, types))
    if ending:
        values = _ended(max_turns, t, [(e[1][0], str(e[1][3])) for e in ending],
                        {f"obs{t}_error": [e[1][2] for e in ending],
                         ENV_REWARD_FIELD.name: [e[2] for e in ending]})
        out.append(_batch([e[0] for e in ending], values, types))
    return out


def episode_end_writes(row_id: int, t: int, max_turns: int, hist: History,
                       reward: float | None) -> list[pa.RecordBatch]:
    """A gateway run's end of a trajectory after model turn ``t`` (``hist`` through it), when its
    agent returned: the assembled columns (finish_reason: the last turn's), ``env_reward`` =
    the agent's reward (None: the run's verifier scores it) and NULL in every later cell."""
    values = _ended(max_turns, t, [(hist, hist.turns[-1].finish)],
                    {ENV_REWARD_FIELD.name: [reward]})
    return [_batch([row_id], values, _types(max_turns))]
