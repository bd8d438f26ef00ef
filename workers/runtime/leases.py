"""What a worker holds and writes under a lease: the ``LeaseKeeper`` that renews held leases,
``Parts`` (a stage's writes in several column sets) and ``write_parts``, ``HandBack``, and
``with_row_ids``. Every stage and every loop (``workers.roles.loop``) shares them; below the
roles, so an engine's stage (``workers.engines.simulated``) uses them too. Lease lifecycle:
docs/training.md "The stage loop".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from storage.errors import CellAlreadyWritten
from storage.schema import ROW_ID, Lease

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Extends held leases at half their lifetime from a background thread (a heartbeat: a frozen
    process stops it too). ``client_factory`` gives the thread its own client (docs/training.md)."""

    def __init__(self, client_factory: Callable[[], Any], *, tick_s: float = 0.25) -> None:
        self._factory = client_factory
        self._tick_s = tick_s
        self._leases: dict[int, list] = {}  # lease_id -> [lease, lifetime, deadline]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, lease: Lease) -> None:
        """Keep renewing ``lease`` until ``drop``."""
        lifetime = max(lease.deadline - time.time(), 0.5)
        with self._lock:
            self._leases[lease.lease_id] = [lease, lifetime, lease.deadline]

    def drop(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    @contextlib.contextmanager
    def keep(self, lease: Lease) -> Iterator[None]:
        self.hold(lease)
        try:
            yield
        finally:
            self.drop(lease.lease_id)

    def _run(self) -> None:
        client = self._factory()
        try:
            while not self._stop.wait(self._tick_s):
                now = time.time()
                with self._lock:
                    due = [e for e in self._leases.values() if e[2] - now < e[1] / 2]
                for entry in due:
                    try:
                        entry[2] = client.extend(entry[0])
                    except Exception as exc:  # expired already: the write will be fenced anyway
                        log.warning("could not extend lease %s: %s", entry[0].lease_id, exc)
                        entry[2] = float("inf")
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class HandBack(Exception):  # noqa: N818 - a control-flow signal, not an error of the worker
    """Raised by ``Stage.process``: hand the rows back and go on; ``error=None``: cleanly (not a
    delivery), a text: as a failed delivery with that reason."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__(error or "hand back")
        self.error = error


@dataclass(frozen=True)
class Parts:
    """What a stage returns when its rows write different column sets (a piece: rows that end
    their trajectory write more than rows that go on): one batch (``row_id`` + columns)
    per set, none or several. The loop writes them under the lease, then acks it with the next
    claim. A cell a predecessor already wrote (a redelivered lease whose holder wrote and died
    before its ack) keeps the predecessor's value: that row's write is skipped, never repeated."""

    batches: tuple[pa.RecordBatch, ...] = ()


def write_parts(client: Any, table: str, lease: Lease, parts: Parts,
                on_write: Callable[[pa.RecordBatch, list[int]], None] | None = None) -> int:
    """Write each batch under ``lease`` (no ack); returns the rows whose cells a predecessor had
    written already (kept). A batch refused with CellAlreadyWritten (all or nothing) is written
    again one row at a time, skipping exactly the rows already written. ``on_write(batch,
    kept)`` after each batch: the indexes of its rows kept (the trace)."""
    kept = 0
    for batch in parts.batches:
        skipped: list[int] = []
        try:
            client.write(table, lease, batch)
        except CellAlreadyWritten:
            for i in range(batch.num_rows):
                try:
                    client.write(table, lease, batch.slice(i, 1))
                except CellAlreadyWritten:
                    skipped.append(i)
        kept += len(skipped)
        if on_write is not None:
            on_write(batch, skipped)
    if kept:
        log.warning("lease %s: %d rows were written by a predecessor; kept its cells",
                    lease.lease_id, kept)
    return kept


def with_row_ids(lease: Lease, columns: dict[str, pa.Array]) -> pa.RecordBatch:
    arrays = {ROW_ID: lease.batch.column(ROW_ID), **columns}
    return pa.RecordBatch.from_pydict(arrays)
