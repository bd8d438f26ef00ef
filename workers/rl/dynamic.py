"""Dynamic sampling (DAPO): which groups of a claim the trainer trains, and which it only acks.

A group whose rewards are all equal carries no learning signal: its group-relative advantages
are zero, so with dynamic sampling on it is acked untrained (consumed, never redelivered) and the
controller puts more prompts (``streamflow.provision``). Owns the zero-variance test
(``zero_variance_groups``, pure) and ``GroupFilter``, the trainer's per-iteration tally of kept,
filtered and surplus groups; whether it is on: ``GrpoSettings.dynamic`` (docs/training.md
"Dynamic sampling").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from workers.runtime.events import SamplingReport


def zero_variance_groups(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The sorted ids of the groups whose rewards are all equal (exactly: a reward that differs
    in its last bit is a signal, however weak). A group of one row has no variance either."""
    rewards, groups = np.asarray(rewards, np.float64), np.asarray(groups)
    ids, where = np.unique(groups, return_inverse=True)
    low = np.full(len(ids), np.inf)
    high = np.full(len(ids), -np.inf)
    np.minimum.at(low, where, rewards)
    np.maximum.at(high, where, rewards)
    return ids[low == high]


@dataclass
class Tally:
    """The groups of one iteration the trainer has seen (each counted once: redelivered rows
    are dropped before the filter)."""

    informative: int = 0  # groups with reward variance, trained
    filtered: int = 0  # zero-variance groups, acked untrained (dynamic sampling on)
    surplus: int = 0  # groups with variance past the step's need, acked untrained
    zero_variance: int = 0  # zero-variance groups seen (counted with dynamic sampling off too)

    @property
    def seen(self) -> int:
        return self.informative + self.filtered + self.surplus


class GroupFilter:
    """The trainer's filter: ``split`` one iteration's rows of whole groups into the rows to train
    and the rows only to ack; ``step_fields`` the iteration's counts for its step report.

    Invariant (dynamic sampling on): at most ``groups_per_step`` groups of an iteration are kept,
    so a step trains exactly that many once they are in. Kept groups are taken in group-id order
    within a claim. Each change is sent as a ``SamplingReport`` (cumulative counts): the
    controller's cue for a top-up (``streamflow.provision``)."""

    def __init__(self, enabled: bool, groups_per_step: int,
                 send: Callable[[Any], None] = lambda r: None) -> None:
        self.enabled, self.groups_per_step, self.send = enabled, groups_per_step, send
        self._tallies: dict[int, Tally] = {}

    @classmethod
    def for_trainer(cls, settings: Any, send: Callable[[Any], None]) -> GroupFilter:
        """The filter of a trainer worker's record (``workers.config.TrainerWorkerConfig``)."""
        return cls(settings.grpo.dynamic,
                   settings.rows_per_iteration // settings.group_size, send)

    def split(self, iteration: int, rows: pa.RecordBatch) -> tuple[pa.RecordBatch,
                                                                     pa.RecordBatch | None]:
        """(rows to train, rows only to ack or None) of ``rows``, whole groups of ``iteration``."""
        if rows.num_rows == 0:
            return rows, None
        groups = rows.column("group_id").to_numpy()
        zero = zero_variance_groups(rows.column("reward").to_numpy(zero_copy_only=False), groups)
        tally = self._tallies.setdefault(iteration, Tally())
        tally.zero_variance += len(zero)
        if not self.enabled:
            tally.informative += len(np.unique(groups)) - len(zero)
            return rows, None
        varied = np.setdiff1d(np.unique(groups), zero)  # sorted: kept in group-id order
        room = max(self.groups_per_step - tally.informative, 0)
        keep = varied[:room]
        tally.informative += len(keep)
        tally.filtered += len(zero)
        tally.surplus += len(varied) - len(keep)
        self.send(SamplingReport(iteration, tally.informative, tally.filtered, tally.surplus))
        kept = np.isin(groups, keep)
        if kept.all():
            return rows, None
        return rows.filter(pa.array(kept)), rows.filter(pa.array(~kept))

    def step_fields(self, iteration: int) -> dict[str, Any]:
        """The ``StepReport`` fields of ``iteration`` (stepped now); forgets it and older ones."""
        tally = self._tallies.get(iteration, Tally())
        self._tallies = {k: t for k, t in self._tallies.items() if k > iteration}
        groups = tally.informative + tally.zero_variance if not self.enabled else tally.seen
        return {"filtered_groups": tally.filtered, "surplus_groups": tally.surplus,
                "zero_variance_rate": tally.zero_variance / groups if groups else 0.0}
