"""Task ``rollout.{k}``: continue a row with model piece k, and the stages of a rollout worker.

A row goes on with a model piece after an observation (the next turn) or after a cut (the same
turn, with the newest weights); both are one operation, ``RolloutStage.process_all``, whose
engine, weights, lock and version rules every ``ContinueStage`` shares. It claims rows one by one
(not whole groups: the rows of a group go on differently) and generates ONE continuation per row::

    rollout (piece 0, whole groups) -> [env.1 | rollout.1] -> [env.2 | rollout.2] -> ...
          \\ ended: response_* written, later piece cells NULL -> reward, reference, trainer

A row whose trajectory ended earlier is never delivered (the store skips it on its NULL gate;
one that comes anyway is acked untouched). A piece's write + ack is the unit of progress: a
redelivered lease whose cells a predecessor wrote keeps them (``workers.runtime.leases.Parts``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from storage.schema import Lease
from workers.agent.piece_rows import piece_reads
from workers.roles.rollout import EarlySink, RolloutStage
from workers.runtime.leases import Parts
from workers.schema import ROLLOUT_READS, piece_of, piece_tasks

EARLY_WRITES_S = 0.1  # partial rollout: the longest a finished row waits for its write


class ContinueStage:
    """Model piece k >= 1 of every trajectory (task ``rollout.{k}``): see the module docstring."""

    whole_groups = False
    along: tuple[str, ...] = ()  # (only a worker's first stage takes rows along)

    def __init__(self, rollout: RolloutStage, k: int, *, max_rows: int) -> None:
        if k < 1:
            raise ValueError(f"a continuation writes piece k >= 1, got {k}")
        self.rollout, self.piece = rollout, k
        self.task = f"rollout.{k}"
        self.columns = (*ROLLOUT_READS, *piece_reads(k))
        self.max_rows = max_rows

    @property
    def last_tokens(self) -> int:
        return self.rollout.last_tokens

    @property
    def early_s(self) -> float | None:
        return self.rollout.early_s

    def process(self, lease: Lease) -> pa.RecordBatch | Parts:
        return self.rollout.process_all([lease])[0]

    def process_all(self, leases: Sequence[Lease], early: EarlySink | None = None
                    ) -> list[pa.RecordBatch | Parts]:
        return self.rollout.process_all(leases, early)


def rollout_stages(first: RolloutStage) -> list[RolloutStage | ContinueStage]:
    """The stages a rollout worker serves: ``first`` (piece 0) and a ``ContinueStage`` per
    ``rollout.{k}`` task of the table (one continuation per row, so a claim takes as many rows
    as a piece-0 claim generates). Partial rollout: ``first``'s calls take the rows ready for
    every ``rollout.{k}`` along (docs/partial.md "Riders") and every stage writes rows as they
    finish (``early_s``); the loop does both (``workers.roles.riding``)."""
    rules = first.rules
    tasks = [t.name for t in piece_tasks(rules.max_turns, rules.max_cuts,
                                         gateway=rules.agent_driven)
             if t.name.startswith("rollout.")]
    rest = [ContinueStage(first, piece_of(t), max_rows=first.max_rows) for t in tasks]
    if rules.max_cuts:
        first.along = tuple(s.task for s in rest)
        first.early_s = EARLY_WRITES_S
    return [first, *rest]
