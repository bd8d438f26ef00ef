"""Riders of partial rollout: cut trajectories that go on inside the next rollout call.

Resumed in a ``resume.{j}`` call of its own, a cut row costs a re-prefill and then decode steps in
a batch of the few rows that were cut. Where a decode step costs about as much for one row as for
many (a small model, a CPU, any engine that is not batching continuously across calls), that is
about what the uncut tail would have cost, and partial rollout buys nothing. So before each
rollout call the rollout stage claims, without waiting, the rows ready for ``resume.1`` ..
``resume.{R-1}`` and generates them in the SAME call as the new prompts: the tails decode in the
steps the batch takes anyway (docs/partial.md "Riders").

A rider keeps every rule of ``workers.roles.resume``: its own seed and the draws it already used
(``part_seed``, ``done_tokens``), so under unchanged weights it draws what its uncut generation
would have; its room (``max_new_tokens`` less its tokens: the call may give it more, which
``close_segment`` cuts off); the version rule (the call's version is at least the rider's last
segment's and its ``min_policy_version``). ``resume.R`` rows never ride, since a rollout call
may be cut and segment R may not be; the worker's ``resume.{j}`` stages still serve whatever
no rollout call took. A rider lease is held by the worker's keeper, written (early writes
included) and acked here, and traced like the loop's; a failed call releases it as a failed
delivery, like the rollout lease.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.errors import LeaseExpired, UnknownLease
from storage.schema import Lease
from workers.agent.segments import Segment, continuation_ids, done_tokens, segments
from workers.engines.base import Generation
from workers.roles.loop import write_parts
from workers.runtime.faults import failure_reason

if TYPE_CHECKING:
    from workers.roles.early import EarlyCall
    from workers.roles.resume import ResumeStage

log = logging.getLogger(__name__)


@dataclass
class Ride:
    """One rider lease: its stage (``resume.{j}``) and its live rows with their segments."""

    stage: ResumeStage
    lease: Lease
    live: list[tuple[dict[str, Any], tuple[Segment, ...]]]
    done: list[int]  # tokens each live row already has
    early: EarlyCall | None = None

    @property
    def contexts(self) -> list[list[int]]:
        return [continuation_ids(row["prompt_ids"], segs) for row, segs in self.live]

    @property
    def seeds(self) -> list[int]:
        return [int(row["part_seed"]) for row, _ in self.live]

    @property
    def required_version(self) -> int:
        return max((max(row["min_policy_version"], segs[-1].version) for row, segs in self.live),
                   default=-1)


class Riders:
    """Claims the rows a rollout call takes along, and writes and acks them after it."""

    def __init__(self, client: Any, table: str, stages: Sequence[ResumeStage], *,
                 max_rows: int, keeper: Any = None, tracer: Any = None) -> None:
        self.client, self.table = client, table
        self.stages = [s for s in stages if s.j < s.rollout.max_cuts]  # resume.R never rides
        self.max_rows, self.keeper, self.tracer = max_rows, keeper, tracer
        self.rows_total = 0  # rows that rode (worker metrics, tests)

    def claim(self) -> list[Ride]:
        """Up to ``max_rows`` rows ready for the riding stages, oldest segment count first."""
        rides: list[Ride] = []
        room = self.max_rows
        for stage in self.stages:
            if room <= 0:
                break
            lease = self.client.claim(self.table, stage.task, list(stage.columns), room)
            if not lease.num_rows:
                continue
            room -= lease.num_rows
            if self.keeper is not None:
                self.keeper.hold(lease)
            if self.tracer is not None:
                self.tracer.claim(lease)
            live = [(row, segs) for row in lease.batch.to_pylist()
                    if (segs := segments(row, stage.j)) is not None]
            rides.append(Ride(stage, lease, live, [done_tokens(s) for _, s in live]))
        return rides

    def finish(self, rides: Sequence[Ride], generations: Sequence[Generation],
               version: int) -> int:
        """Write each ride's segments (rows its early writes did not write) and ack it;
        ``generations``: the rides' live rows in order. Returns the tokens the rides kept."""
        tokens, at = 0, 0
        limit = rides[0].stage.rollout.params.max_new_tokens if rides else 0
        for ride in rides:
            gens = generations[at : at + len(ride.live)]
            at += len(ride.live)
            tokens += sum(min(len(g.token_ids), limit - d) for g, d in zip(gens, ride.done,
                                                                           strict=True))
            written = ride.early.written if ride.early is not None else set()
            parts = ride.stage.segment_writes(ride.live, ride.done, version,
                                       [(i, g) for i, g in enumerate(gens) if i not in written])
            traced = None
            if self.tracer is not None and self.tracer.enabled:
                def traced(batch: Any, kept: list[int], lease: Lease = ride.lease) -> None:
                    self.tracer.write(lease, batch, kept=kept)
            try:
                write_parts(self.client, self.table, ride.lease, parts, traced)
                self.client.ack(ride.lease)
            except (LeaseExpired, UnknownLease) as exc:  # fenced: its rows go to another worker
                log.warning("rider lease %s fenced off (%s)", ride.lease.lease_id, exc)
                self._drop(ride, "fenced", str(exc))
                continue
            self._drop(ride, "ack")
            self.rows_total += ride.lease.num_rows
        return tokens

    def fail(self, rides: Sequence[Ride], error: str) -> None:
        """The call failed: hand every ride back as a failed delivery."""
        for ride in rides:
            reason = failure_reason(ride.lease.batch, error)[:500]
            try:
                self.client.release(ride.lease, error=reason)
            finally:
                self._drop(ride, "fail", reason)

    def _drop(self, ride: Ride, event: str, error: str = "") -> None:
        if self.keeper is not None:
            self.keeper.drop(ride.lease.lease_id)
        if self.tracer is not None:
            self.tracer.lease_event(event, ride.lease, error=error)


def riding_tasks(stage: Any) -> tuple[str, ...]:
    """The tasks whose rows ``stage`` (a rollout stage) takes along: none without riders."""
    riders = getattr(stage, "riders", None)
    return tuple(s.task for s in riders.stages) if riders is not None else ()
