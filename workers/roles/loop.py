"""The streaming loop every stateless stage shares: claim -> compute -> write (+ack).

Each claim carries the previous turn's write+ack (one round trip per micro-batch); a stage that
raises hands its rows back as a failed delivery, ``HandBack`` hands them back and goes on; a store
node down is waited out. A stage whose rows write different column sets returns ``Parts``: written
under the lease at once (a predecessor's cells kept), acked with the next claim. ``serve_stages``
runs one worker over several tasks. A stage maps a lease to its writes and nothing more; a
batching one (``process_all``: several leases in one call, rows reported as they finish) gets
the loop's ``workers.roles.riding.Riding``, which claims the rows that ride along and writes rows
early. Each turn leaves its trace (``workers.runtime.trace``: claim,
writes, kept, ack, release/fail, fenced) when the run traces rows. Lease lifecycle and shutdown:
docs/training.md "The stage loop"; ``Parts``: "Trajectories".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import pyarrow as pa

from storage.errors import (
    LeaseExpired,
    Unavailable,
    UnknownLease,
    UnknownTable,
)
from storage.schema import Lease
from workers.roles.riding import Riding
from workers.runtime import cores
from workers.runtime.events import EventSender, Span
from workers.runtime.faults import failure_reason
from workers.runtime.leases import HandBack, LeaseKeeper, Parts, write_parts
from workers.runtime.trace import Tracer

log = logging.getLogger(__name__)


class Stage(Protocol):
    task: str  # the store task this stage consumes
    columns: tuple[str, ...]  # columns to claim (row_id is always added by the store)
    whole_groups: bool
    max_rows: int

    def process(self, lease: Lease) -> pa.RecordBatch | Parts:
        """The columns to write for the lease's rows: ``row_id`` plus this stage's columns."""
        ...


class Batching(Stage, Protocol):
    """A stage that can generate for several leases in one call (``workers.roles.riding``)."""

    along: tuple[str, ...]  # tasks whose ready rows may ride along its calls (first stage only)
    early_s: float | None  # the longest a finished row waits for its write; None: no early writes

    def process_all(self, leases: Sequence[Lease], early: Any = None
                    ) -> list[pa.RecordBatch | Parts]:
        """One result per lease, in order; ``early(i, parts)``: rows of lease i as they finish
        (the result holds them too: the loop leaves out what it wrote early)."""
        ...


def iteration_of(batch: pa.RecordBatch) -> int:
    """The iteration of a batch's rows, -1 when they are mixed or unknown."""
    if "iteration" not in batch.schema.names or batch.num_rows == 0:
        return -1
    values = set(batch.column("iteration").to_pylist())
    return values.pop() if len(values) == 1 else -1


class StageLoop:
    """The streaming turn: each claim also carries the previous turn's write+ack (a fenced one is
    dropped and the worker goes on); ``flush`` writes the last result on a clean stop."""

    def __init__(self, client: Any, table: str, stage: Stage, *, worker: str, role: str,
                 events: EventSender, keeper: LeaseKeeper | None = None,
                 session: Any = None, riding: Riding | None = None) -> None:
        self.client, self.table, self.stage = client, table, stage
        # a batching stage's riders and early writes (workers.roles.riding); None: plain
        self.riding = riding
        self.worker, self.role, self.events, self.keeper = worker, role, events, keeper
        # storage.coordinator_session.ConsumerSession: claim from owned shards (+ steal), and
        # report throughput for the balancer; None: claim from any shard.
        self.session = session
        self._prev: tuple[Lease, pa.RecordBatch | None] | None = None
        self.tracer = Tracer.of(events, worker)
        self._prev_seconds = 0.0  # the carried result's compute time, and tool calls (its trace)
        self._prev_calls: Any = None

    def turn(self, timeout_s: float, wake: Sequence[str] = ()) -> int:
        """Ack the previous result, claim and process the next rows; returns rows processed
        (-1: the stage handed its rows back, see ``HandBack``; more are waiting). ``wake``:
        other tasks whose ready rows end the claim's wait (an empty turn)."""
        prev, self._prev = self._prev, None
        sent = time.time()  # a carried write+ack is applied when this claim arrives
        if prev is not None and prev[1] is not None:  # traced before the claim's long wait (a
            self._trace_write(prev[0], prev[1], sent)  # kill in it must not lose the write)
        columns, kw = list(self.stage.columns), {
            "whole_groups": self.stage.whole_groups, "timeout": timeout_s,
            "ack": prev[0] if prev else None, "write": prev[1] if prev else None}
        if wake:
            kw["wake"] = list(wake)
        try:
            if self.session is not None:
                lease = self.session.claim(self.client, columns, self.stage.max_rows, **kw)
            else:
                lease = self.client.claim(self.table, self.stage.task, columns,
                                          self.stage.max_rows, **kw)
        except (LeaseExpired, UnknownLease) as exc:
            if getattr(exc, "acked", False):
                raise
            log.warning("%s: result for lease %s fenced off (%s); its rows go to another consumer",
                        self.worker, prev[0].lease_id if prev else None, exc)
            if prev is not None:
                self.tracer.lease_event("fenced", prev[0], t=sent, error=str(exc))
            return 0
        except (Unavailable, UnknownTable) as exc:
            # node down or restarting: the carried result was applied or its rows come back
            log.warning("%s: store unavailable (%s); retrying", self.worker, exc)
            time.sleep(0.5)
            return 0
        if prev is not None:
            self.tracer.lease_event("ack", prev[0], t=sent)
        if lease.num_rows == 0:
            return 0
        self.tracer.claim(lease)
        start = time.time()
        try:
            keep = self.keeper.keep(lease) if self.keeper is not None else contextlib.nullcontext()
            with keep, cores.busy():  # this host's thread budget, shared by phase
                out = (self.stage.process(lease) if self.riding is None
                       else self.riding.process(self.stage, lease))
        except HandBack as back:
            reason = failure_reason(lease.batch, back.error) if back.error else None
            self.client.release(lease, error=reason[:500] if reason else None)
            self.tracer.lease_event("fail" if reason else "release", lease, error=reason or "")
            return -1  # nothing processed, but rows are waiting: a draining caller goes on
        except BaseException as exc:
            try:
                reason = failure_reason(lease.batch, f"{self.role}: {type(exc).__name__}: {exc}")
                self.client.release(lease, error=reason[:500])
                self.tracer.lease_event("fail", lease, error=reason)
            finally:
                raise
        seconds, calls = time.time() - start, getattr(self.stage, "last_calls", None)
        if isinstance(out, Parts):  # written now; the ack rides on the next claim
            def traced(batch: pa.RecordBatch, kept: list[int]) -> None:
                self.tracer.write(lease, batch, seconds=seconds, kept=kept, calls=calls)

            try:
                write_parts(self.client, self.table, lease, out,
                            traced if self.tracer.enabled else None)
            except (LeaseExpired, UnknownLease) as exc:
                log.warning("%s: parts of lease %s fenced off (%s)", self.worker,
                            lease.lease_id, exc)
                self.tracer.lease_event("fenced", lease, error=str(exc))
                return 0
            self._prev = (lease, None)
        else:
            self._prev = (lease, out)
        self._prev_seconds, self._prev_calls = seconds, calls
        if self.session is not None:
            self.session.record(lease.num_rows, time.time() - start)
        tokens = int(getattr(self.stage, "last_tokens", 0))
        self.events.send(Span(self.role, self.worker, start, time.time(),
                              iteration_of(lease.batch), lease.num_rows, tokens))
        return lease.num_rows

    def _trace_write(self, lease: Lease, out: pa.RecordBatch, t: float) -> None:
        """The carried result, sent at ``t`` (a refused one is followed by "fenced", not "ack")."""
        self.tracer.write(lease, out, seconds=self._prev_seconds, t=t, calls=self._prev_calls)

    def flush(self) -> None:
        """Write+ack the last result (clean stop): a stop causes no redelivery."""
        if self._prev is not None:
            prev, self._prev = self._prev, None
            lease, out = prev
            t = time.time()
            if out is None:
                self.client.ack(lease)
            else:
                self._trace_write(lease, out, t)
                self.client.write(self.table, lease, out, ack=True)
            self.tracer.lease_event("ack", lease, t=t)


def serve_stage(client: Any, table: str, stage: Stage, stop: threading.Event, *, worker: str,
                role: str, events: EventSender, timeout_s: float,
                keeper: LeaseKeeper | None = None, session: Any = None) -> int:
    """Run turns until ``stop`` is set, then flush; returns the rows processed."""
    loop = StageLoop(client, table, stage, worker=worker, role=role, events=events,
                     keeper=keeper, session=session)
    total = 0
    while not stop.is_set():
        total += max(loop.turn(timeout_s), 0)
    loop.flush()
    return total


def serve_stages(client: Any, table: str, stages: Sequence[Stage], stop: threading.Event, *,
                 worker: str, role: str, events: EventSender, timeout_s: float,
                 keeper: LeaseKeeper | None = None) -> int:
    """One worker serving several tasks (the tasks that continue a row with a piece): one
    ``StageLoop`` per stage, taken in turn. A round looks at every stage without waiting. After a
    round that found nothing, the next one starts with a claim that waits up to ``timeout_s`` for
    its stage's rows OR any other stage's (the claim's ``wake``), so an idle worker neither spins
    nor sits on one task's wait while another has rows. A batching stage (``process_all``; a
    partial run's rollout stages) gets the loop's ``Riding``: the first stage's ``along`` tasks
    ride its calls, and in a round where it found rows of its own those tasks are not claimed
    by their own loops, so a cut row waits for the next call rather than going on alone, unless
    no rows of the first stage are waiting. Stops and flushes like ``serve_stage``."""
    columns = {s.task: tuple(s.columns) for s in stages}
    along = tuple(getattr(stages[0], "along", ()))
    tracer = Tracer.of(events, worker)

    def riding(stage: Stage, ride: tuple[str, ...]) -> Riding | None:
        early = getattr(stage, "early_s", None)
        if not hasattr(stage, "process_all") or (not ride and early is None):
            return None
        return Riding(client, table, {t: columns[t] for t in ride}, max_rows=stage.max_rows,
                      early_s=early, keeper=keeper, tracer=tracer)

    loops = [StageLoop(client, table, s, worker=worker, role=role, events=events, keeper=keeper,
                       riding=riding(s, along if i == 0 else ()))
             for i, s in enumerate(stages)]
    others = [[o.task for o in stages if o is not s] for s in stages]
    total, wait = 0, 0.0
    while not stop.is_set():
        got = first = 0
        for i, loop in enumerate(loops):
            # only a round's first claim waits: a later one would hold up rows found before it
            if i > 0 and first and loop.stage.task in along:
                continue
            n = max(loop.turn(wait, others[i]) if i == 0 and wait else loop.turn(0.0), 0)
            got += n
            if i == 0:
                first = n
        total += got
        wait = 0.0 if got else timeout_s
    for loop in loops:
        loop.flush()
    return total
