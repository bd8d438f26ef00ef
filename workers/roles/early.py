"""Early writes of partial rollout: rows a generate call finished, written under the lease while
the call's other rows still generate (docs/partial.md "Early writes").

Without them, a finished row waits for its call to return, and a call returns when its longest
row ends or a newer version cuts it: the trainer, waiting on iteration k's last rows, may wait on
a call that shares them with much longer rows. The engine reports each finished row
(``Interruptible``'s ``on_done``, from the generating thread, which is the stage loop's: the
loop's client is used from its own thread only); ``EarlyWrites`` buffers them and writes at most
once every ``every_s`` under the lease, with no ack. The ack still rides the loop's next claim.
Safe because a write makes its rows ready downstream without the ack, and a redelivered lease
keeps the cells a predecessor wrote (``workers.roles.loop.write_parts``): a row's content is the
same whoever writes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from storage.schema import Lease
from workers.engines.base import Generation
from workers.roles.loop import Parts, write_parts


class EarlyCall:
    """One generate call's early writes: ``on_done`` for the engine, ``written`` after."""

    def __init__(self, owner: EarlyWrites, lease: Lease,
                 rows: Callable[[list[tuple[int, Generation]]], Parts]) -> None:
        self.owner, self.lease, self.rows = owner, lease, rows
        self.pending: list[tuple[int, Generation]] = []
        self.written: set[int] = set()  # row positions in the lease written here
        self.last = owner.clock()

    def on_done(self, position: int, generation: Generation) -> None:
        self.pending.append((position, generation))
        if self.owner.clock() - self.last >= self.owner.every_s:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        got, self.pending = self.pending, []
        tracer = self.owner.tracer  # the run's trace (workers.runtime.trace): written rows, kept

        def traced(batch: Any, kept: list[int]) -> None:
            assert tracer is not None
            tracer.write(self.lease, batch, kept=kept)

        write_parts(self.owner.client, self.owner.table, self.lease, self.rows(got),
                    traced if tracer is not None and tracer.enabled else None)
        self.written.update(p for p, _ in got)
        self.owner.rows_total += len(got)
        self.last = self.owner.clock()


class EarlyWrites:
    def __init__(self, client: Any, table: str, *, every_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, tracer: Any = None) -> None:
        self.client, self.table, self.every_s, self.clock = client, table, every_s, clock
        self.tracer = tracer  # workers.runtime.trace.Tracer (None: no trace)
        self.rows_total = 0  # rows written early (a worker's counter)

    def call(self, lease: Lease, rows: Callable[[list[tuple[int, Generation]]], Parts]
             ) -> EarlyCall:
        """``rows(finished)``: the Parts that end the rows at those lease positions."""
        return EarlyCall(self, lease, rows)
