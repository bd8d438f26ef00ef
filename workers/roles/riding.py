"""What the loop does around a stage that generates for several leases in one call: it claims the
rows that ride along, and writes rows as they finish (partial rollout; docs/partial.md "Riders",
"Early writes"). The stage only maps leases to their writes (``process_all``).

Riders: resumed in a call of its own, a cut row costs a re-prefill and then decode steps in a
batch of the few rows that were cut; where a decode step costs about as much for one row as for
many (a small model, a CPU, any engine that does not batch continuously across calls), that is
about what the uncut tail would have cost. So before each call of the worker's first stage the
loop claims, without waiting, the rows ready for the stage's ``along`` tasks (``rollout.{k}``, at
most a claim's rows) and hands their leases to the same call. A rider lease is held by the
worker's keeper, written (its early writes too) and acked here after the call, traced like the
loop's; a failed call releases it as a failed delivery, like the loop's own lease.

Early writes: a call returns when its longest row ends or a newer version cuts it, so without
more a finished row waits for its call's longest. The stage reports the writes of each finished
row (from the generating thread, the loop's: its client is used from its own thread only); they
are buffered and written under their lease at most once every ``early_s``, with no ack, and left
out of the lease's final write. Safe because a write makes its rows ready downstream without the
ack, and a redelivered lease keeps the cells a predecessor wrote: a row's content is the same
whoever writes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.errors import LeaseExpired, UnknownLease
from storage.schema import ROW_ID, Lease
from workers.runtime.faults import failure_reason
from workers.runtime.leases import Parts, write_parts

log = logging.getLogger(__name__)


class Riding:
    """The loop's side of one batching stage (see the module docstring). ``along``: task ->
    the columns its rows are claimed with; ``early_s``: None, no early writes."""

    def __init__(self, client: Any, table: str, along: Mapping[str, tuple[str, ...]], *,
                 max_rows: int, early_s: float | None, keeper: Any = None, tracer: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.table, self.along = client, table, dict(along)
        self.max_rows, self.early_s, self.clock = max_rows, early_s, clock
        self.keeper, self.tracer = keeper, tracer
        self.rows_total = 0  # rows that rode (tests, worker logs)
        self.early_rows_total = 0  # rows written early

    def process(self, stage: Any, lease: Lease) -> pa.RecordBatch | Parts:
        """``stage.process_all`` over ``lease`` and the riders; the riders written and acked,
        the lease's writes returned (less its rows written early) for the loop to write."""
        riders = self._claim()
        leases = [lease, *riders]
        early = _Early(self, leases) if self.early_s is not None else None
        try:
            results = stage.process_all(leases, early.add if early is not None else None)
        except BaseException as exc:
            self._fail(riders, f"rollout: {type(exc).__name__}: {exc}")
            raise
        written = early.written if early is not None else [set() for _ in leases]
        for rider, result, rows in zip(riders, results[1:], written[1:], strict=True):
            self._finish(rider, _without(result, rows))
        return _without(results[0], written[0])

    def _claim(self) -> list[Lease]:
        riders: list[Lease] = []
        room = self.max_rows
        for task, columns in self.along.items():
            if room <= 0:
                break
            lease = self.client.claim(self.table, task, list(columns), room)
            if not lease.num_rows:
                continue
            room -= lease.num_rows
            if self.keeper is not None:
                self.keeper.hold(lease)
            if self.tracer is not None:
                self.tracer.claim(lease)
            riders.append(lease)
        return riders

    def _finish(self, lease: Lease, result: pa.RecordBatch | Parts) -> None:
        parts = result if isinstance(result, Parts) else Parts((result,))
        try:
            write_parts(self.client, self.table, lease, parts, self.traced(lease))
            self.client.ack(lease)
        except (LeaseExpired, UnknownLease) as exc:  # fenced: its rows go to another worker
            log.warning("rider lease %s fenced off (%s)", lease.lease_id, exc)
            self._drop(lease, "fenced", str(exc))
            return
        self._drop(lease, "ack")
        self.rows_total += lease.num_rows

    def _fail(self, riders: Sequence[Lease], error: str) -> None:
        for lease in riders:
            reason = failure_reason(lease.batch, error)[:500]
            try:
                self.client.release(lease, error=reason)
            finally:
                self._drop(lease, "fail", reason)

    def _drop(self, lease: Lease, event: str, error: str = "") -> None:
        if self.keeper is not None:
            self.keeper.drop(lease.lease_id)
        if self.tracer is not None:
            self.tracer.lease_event(event, lease, error=error)

    def traced(self, lease: Lease) -> Callable[[pa.RecordBatch, list[int]], None] | None:
        if self.tracer is None or not self.tracer.enabled:
            return None
        return lambda batch, kept: self.tracer.write(lease, batch, kept=kept)


class _Early:
    """One call's early writes: ``add`` for the stage, ``written`` (row ids per lease) after."""

    def __init__(self, owner: Riding, leases: list[Lease]) -> None:
        self.owner, self.leases = owner, leases
        self.pending: list[list[pa.RecordBatch]] = [[] for _ in leases]
        self.written: list[set[int]] = [set() for _ in leases]
        self.last = owner.clock()

    def add(self, position: int, parts: Parts | pa.RecordBatch) -> None:
        self.pending[position] += parts.batches if isinstance(parts, Parts) else [parts]
        assert self.owner.early_s is not None
        if self.owner.clock() - self.last >= self.owner.early_s:
            self.flush()

    def flush(self) -> None:
        for i, lease in enumerate(self.leases):
            if not self.pending[i]:
                continue
            batches, self.pending[i] = _merged(self.pending[i]), []
            write_parts(self.owner.client, self.owner.table, lease, Parts(batches),
                        self.owner.traced(lease))
            rows = {r for b in batches for r in b.column(ROW_ID).to_pylist()}
            self.written[i] |= rows
            self.owner.early_rows_total += len(rows)
        self.last = self.owner.clock()


def _merged(batches: list[pa.RecordBatch]) -> tuple[pa.RecordBatch, ...]:
    """One batch per column set (rows reported one by one write in few requests)."""
    by_set: dict[tuple[str, ...], list[pa.RecordBatch]] = {}
    for b in batches:
        by_set.setdefault(tuple(b.schema.names), []).append(b)
    return tuple(pa.Table.from_batches(bs).combine_chunks().to_batches()[0]
                 for bs in by_set.values())


def _without(result: pa.RecordBatch | Parts, rows: set[int]) -> pa.RecordBatch | Parts:
    """``result`` less the rows in ``rows`` (written early)."""
    if not rows:
        return result
    batches = result.batches if isinstance(result, Parts) else (result,)
    kept = []
    for b in batches:
        keep = pc.invert(pc.is_in(b.column(ROW_ID), pa.array(sorted(rows), pa.uint64())))
        b = b.filter(keep)
        if b.num_rows:
            kept.append(b)
    return Parts(tuple(kept))
