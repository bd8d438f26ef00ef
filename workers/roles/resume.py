"""Partial rollout, the resume side: task ``resume.{j}`` continues trajectories cut j times.

A trajectory a newer policy version cut is one row of the samples table with its segments in
``part{i}_*`` (``workers.schema.part_columns``, docs/partial.md)::

    rollout (segment 0, whole groups) -> resume.1 -> resume.2 -> ... -> resume.R (never cut)
          \\ ended here: response_* + response_version_runs written, later parts NULL -> reward, trainer

``ResumeStage`` mirrors ``workers.roles.turns.RolloutTurnStage``: it claims ``resume.{j}`` rows
one by one (not whole groups: a group's rows are cut apart), acks a row whose trajectory ended
earlier (a NULL segment) without work, and generates ONE continuation per live row under the
version rules of ``RolloutStage`` (whose engine, weights, lock and watch it shares):

* the version is at least the rows' ``min_policy_version`` AND at least their last segment's: a
  resume never goes back to older weights, so the oldest token's version (``policy_version``,
  what admission counted) stays the first segment's;
* the context is prompt + every segment, the seed the row's own ``part_seed`` and
  ``done_tokens`` the tokens it has, so under unchanged weights it draws what the uncut
  generation would have; ``max_new_tokens`` is what the trajectory has left;
* a newer version cuts it again (segment j written), except in ``resume.R``.

Since one worker serves ``rollout`` and every ``resume.{j}``, one claim takes cut rows from every
rollout device's generations at once: the long tails of a step decode together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from storage.schema import ROW_ID, Lease
from workers.agent.segments import (
    Segment,
    continuation_ids,
    done_tokens,
    part_reads,
    part_writes,
    segments,
)
from workers.engines.base import FINISH_LENGTH, FINISH_STOP, Generation
from workers.roles.loop import Parts
from workers.roles.rollout import RolloutStage

RESUME_READS = ("group_id", "iteration", "min_policy_version", "prompt_ids")


def close_segment(gen: Generation, room: int, version: int) -> tuple[Segment, str]:
    """The segment a continuation is, and its finish: tokens past ``room`` (what the trajectory
    has left; a claim generates as many as its roomiest row may) never happened."""
    ids, logprobs = gen.token_ids[:room], gen.logprobs[:room]
    finish = gen.finish_reason
    if len(gen.token_ids) >= room and not (finish == FINISH_STOP and len(gen.token_ids) == room):
        finish = FINISH_LENGTH
    return Segment(list(ids), list(logprobs), version), finish


class ResumeStage:
    """Segment j >= 1 of every cut trajectory (task ``resume.{j}``): see the module docstring."""

    whole_groups = False

    def __init__(self, rollout: RolloutStage, j: int, *, max_rows: int) -> None:
        if not 1 <= j <= rollout.max_cuts:
            raise ValueError(f"resume segment must be in [1, {rollout.max_cuts}], got {j}")
        self.rollout, self.j = rollout, j
        self.task = f"resume.{j}"
        self.columns = (*RESUME_READS, *part_reads(j))
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> Parts:
        live = [(row, segs) for row in lease.batch.to_pylist()
                if (segs := segments(row, self.j)) is not None]
        self.last_tokens = 0
        if not live:  # every row ended earlier: ack, nothing to write
            return Parts()
        stage = self.rollout
        stage.ensure_version(max(max(row["min_policy_version"], segs[-1].version)
                                 for row, segs in live))
        limit = stage.params.max_new_tokens
        done = [done_tokens(segs) for _, segs in live]
        seeds = tuple(int(row["part_seed"]) for row, _ in live)
        with stage.engine_lock:  # the version that generates is the version the segment records
            version = stage.engine.policy_version
            params = dataclasses.replace(
                stage.params, max_new_tokens=max(limit - min(done), 1), seed=seeds[0],
                prompt_seeds=seeds, done_tokens=tuple(done))
            contexts = [continuation_ids(row["prompt_ids"], segs) for row, segs in live]
            cut = stage.cut_event(version, cut=self.j < stage.max_cuts)
            early = None if stage.early is None else stage.early.call(
                lease, lambda got: self.segment_writes(live, done, version, got))
            generations = [g[0] for g in stage.generate(
                contexts, 1, params, cut, early.on_done if early is not None else None)]
        self.last_tokens = sum(min(len(g.token_ids), limit - d)
                               for g, d in zip(generations, done, strict=True))
        stage.resumed_tokens_total += self.last_tokens
        written = early.written if early is not None else set()
        return self.segment_writes(live, done, version,
                            [(i, g) for i, g in enumerate(generations) if i not in written])

    def segment_writes(self, live: list[tuple[dict[str, Any], tuple[Segment, ...]]], done: list[int],
                version: int, got: list[tuple[int, Generation]]) -> Parts:
        """The writes of segment j for the live rows at positions ``got`` (their continuation
        each): cut again, or ended."""
        if not got:
            return Parts()
        stage = self.rollout
        items = [(live[i][1], *close_segment(g, stage.params.max_new_tokens - done[i], version))
                 for i, g in got]
        rows = [live[i][0] for i, _ in got]
        writes = part_writes([r[ROW_ID] for r in rows], self.j, stage.max_cuts, items)
        return stage.parts(writes, {r[ROW_ID]: r["prompt_ids"] for r in rows},
                           {r[ROW_ID]: r["group_id"] for r in rows})


def resume_stages(rollout: RolloutStage, *, max_rows: int) -> list[ResumeStage]:
    """The stages of segments 1..R, which a rollout worker serves beside ``rollout``."""
    return [ResumeStage(rollout, j, max_rows=max_rows) for j in range(1, rollout.max_cuts + 1)]
