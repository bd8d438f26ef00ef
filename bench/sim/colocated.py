"""Colocated stage turns (``sync``): one claimer feeds every device of a host, a turn at a time.

In the colocated baseline every device does every stage and the stages take turns: all of
iteration k is generated, then scored, then given reference log-probs, then trained. A turn is a
barrier, so a device pulling its own micro-batches (a ``StageLoop`` per device: one claim and one
write+ack per micro-batch) buys nothing that a local queue does not, and costs 2 x devices store
requests bunched at every turn boundary, which one store node serves one at a time: the fixed
real milliseconds that made colocated ``sync`` the one mode below 0.9 of its bound at time scale
25 (docs/performance.md, "Where the engine loses"). So, like the trainer's rank 0
(``TrainerGroup``) and a single-controller framework dispatching a stage's batch to its worker
group, ``ColocatedTurns`` leases a turn's rows in chunks of one micro-batch per device, the
devices take micro-batches from a local queue the instant they are free (greedy list scheduling
in release order, exactly what the bound assumes), and each lease is written and acked in one
request once every micro-batch cut from it is done. A turn of R rows costs
2 x ceil(R / (devices x max_rows)) requests instead of 2 x R / max_rows.

Lifecycle of a lease within a turn: claimed (claimer) -> cut into micro-batches, queued ->
each processed by some device -> its last micro-batch done: results concatenated, write+ack
(claimer) -> consumed. A turn returns only once every row of the iteration for that task is
written and acked, so the next stage's inputs are all ready when it starts (no two stages
overlap). A device that raises fails the turn: the exception is re-raised by ``turn`` and its
lease is left to expire (redelivered), as a crashed worker's would.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import Lease


@dataclasses.dataclass
class _Piece:
    lease: Lease  # the micro-batch: the claimed lease with ``batch`` cut to its rows (same id)
    out: pa.RecordBatch | None = None


class ColocatedTurns:
    """``devices`` threads that process whatever stage's micro-batches the current turn queues.

    ``stages[role][device]`` is that device's stage object for the role (``process(lease)`` ->
    the columns to write, as for ``StageLoop``); all stages of a role share task, columns,
    ``whole_groups`` and ``max_rows``. ``client`` is used by the thread that calls ``turn`` only.
    """

    def __init__(
        self,
        client: Any,
        table: str,
        stages: dict[str, dict[str, Any]],
        devices: list[str],
        *,
        claim_timeout_s: float = 5.0,
    ) -> None:
        self.client, self.table, self.stages, self.devices = client, table, stages, devices
        self.claim_timeout_s = claim_timeout_s
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, _Piece]] = collections.deque()
        self._done: list[int] = []  # lease ids whose every piece is processed
        self._open: dict[int, tuple[Lease, list[_Piece]]] = {}  # lease id -> lease, its pieces
        self._left: dict[int, int] = {}  # lease id -> pieces not yet processed
        self._error: BaseException | None = None
        self._stop = False
        self.requests = 0  # store requests made by turns (claims + write+acks)
        self.micro_batches = 0
        self._threads = [
            threading.Thread(target=self._device, args=(d,), daemon=True, name=d) for d in devices
        ]
        for t in self._threads:
            t.start()

    # -- the claimer (the caller of ``turn``) -----------------------------------------------------
    def turn(self, role: str, rows: int) -> None:
        """Run ``role`` over ``rows`` rows (every row of the iteration for that task, all ready),
        returning once all are written and acked."""
        some = next(iter(self.stages[role].values()))
        chunk = len(self.devices) * some.max_rows
        claimed = acked = 0
        while acked < rows:
            claiming = claimed < rows
            with self._cond:
                if not claiming:  # everything is queued: wait for a finished lease to write
                    self._cond.wait_for(lambda: self._done or self._error is not None)
                if self._error is not None:
                    raise RuntimeError(f"colocated {role} turn failed") from self._error
                done, self._done = self._done, []
            for lease_id in done:
                acked += self._write(lease_id)
            if claiming and not done:
                claimed += self._claim(role, some, min(chunk, rows - claimed))

    def _claim(self, role: str, stage: Any, max_rows: int) -> int:
        lease = self.client.claim(
            self.table,
            stage.task,
            list(stage.columns),
            max_rows,
            whole_groups=stage.whole_groups,
            timeout=self.claim_timeout_s,
        )
        self.requests += 1
        if lease.num_rows == 0:
            raise TimeoutError(
                f"colocated {role} turn: no ready rows in {self.claim_timeout_s}s (a stage's "
                "inputs must all be written before its turn)"
            )
        batch = lease.batch
        if stage.whole_groups:  # micro-batches of whole groups, in group order
            batch = batch.take(pc.sort_indices(batch.column("group_id")))
        pieces = [
            _Piece(dataclasses.replace(lease, batch=batch.slice(i, stage.max_rows)))
            for i in range(0, batch.num_rows, stage.max_rows)
        ]
        with self._cond:
            self._open[lease.lease_id] = (lease, pieces)
            self._left[lease.lease_id] = len(pieces)
            self._queue.extend((role, p) for p in pieces)
            self._cond.notify_all()
        return lease.num_rows

    def _write(self, lease_id: int) -> int:
        with self._cond:
            lease, pieces = self._open.pop(lease_id)
            del self._left[lease_id]
        out = pa.Table.from_batches([p.out for p in pieces])  # every piece is done
        self.client.write(self.table, lease, out, ack=True)
        self.requests += 1
        return lease.num_rows

    # -- the devices ------------------------------------------------------------------------------
    def _device(self, name: str) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                role, piece = self._queue.popleft()
            try:
                out = self.stages[role][name].process(piece.lease)
            except BaseException as exc:  # the turn fails; the lease expires and is redelivered
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                piece.out = out
                self.micro_batches += 1
                lease_id = piece.lease.lease_id
                self._left[lease_id] -= 1
                if self._left[lease_id] == 0:
                    self._done.append(lease_id)
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
