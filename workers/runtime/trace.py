"""The worker side of the run's trace: ``Tracer`` turns what a stage did to a lease into
``RowTrace`` records (one per event and micro-batch) sent over the worker's report socket.

Generic over the stages: what a write means for each row is read from the columns the batch
carries (``write_facts``), so a new stage or column chain needs no change here. A tracer made with
``enabled=False`` (run.trace: false) sends nothing and reads nothing. Format and reading:
docs/partial.md "The trace".
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import ROW_ID, Lease
from workers.runtime.events import RowTrace

log = logging.getLogger(__name__)
# the pieces a trajectory is written in: piece0 < piece1 < ... (workers.agent.piece_rows)
_PIECE = re.compile(r"^piece(\d+)_(ids|version|end)$")
RUNS_COLUMN = "response_version_runs"
# (tool, seconds, error kind or None) of the call a stage executed for a row
ToolCallFacts = tuple[str, float, str | None]


def _ints(column: pa.Array | None, n: int) -> list[int | None]:
    return column.to_pylist() if column is not None else [None] * n


def write_facts(batch: pa.RecordBatch
                ) -> tuple[list[int], list[int], list[list[int]], list[str]]:
    """Per row of a written batch: (policy version of what it wrote, tokens, version runs, end).

    * version: the newest piece's ``piece{k}_version`` written non-NULL for the row, else
      ``policy_version``; -1 when the batch has none;
    * tokens: ``len(response_ids)`` when written non-NULL, else the newest ``piece{k}_ids``
      length; -1 when none;
    * runs: ``response_version_runs`` flattened (start, version, start, ...), or ``[0,
      policy_version]`` for a response written without any piece column (single-turn, uncut);
      [] when not known. A row with runs and no piece version written: version = its newest run's;
    * end: the newest ``piece{k}_end`` written non-NULL (how the piece ended: "cut", "tool",
      "observation", ...), "" when none.

    Each list is [] when no row has the fact (nothing to send)."""
    n, names = batch.num_rows, batch.schema.names
    col = {name: batch.column(name) for name in names}
    chains: dict[str, list[tuple[int, pa.Array]]] = {"ids": [], "version": [], "end": []}
    for name in names:
        m = _PIECE.match(name)
        if m:
            chains[m.group(2)].append((int(m.group(1)), col[name]))
    for chain in chains.values():
        chain.sort(key=lambda kv: kv[0])

    def newest(chain: list[tuple[int, pa.Array]], value: Any = None) -> list[Any]:
        out: list[Any] = [None] * n
        for _, column in chain:  # later pieces overwrite earlier ones
            values = (pc.list_value_length(column) if value == "length" else column).to_pylist()
            for i, v in enumerate(values):
                if v is not None:
                    out[i] = v
        return out

    policy = _ints(col.get("policy_version"), n)
    newest_version = newest(chains["version"])
    version = [v if v is not None else p for v, p in zip(newest_version, policy, strict=True)]
    lengths = newest(chains["ids"], "length")
    if "response_ids" in col:
        for i, length in enumerate(pc.list_value_length(col["response_ids"]).to_pylist()):
            if length is not None:
                lengths[i] = length
    runs: list[list[int]] = [[] for _ in range(n)]
    if RUNS_COLUMN in col:
        for i, row_runs in enumerate(col[RUNS_COLUMN].to_pylist()):
            runs[i] = [x for r in row_runs or () for x in (r["start"], r["version"])]
    elif "response_ids" in col and not chains["ids"] and not chains["version"]:
        for i, (length, p) in enumerate(zip(lengths, policy, strict=True)):
            if length is not None and p is not None:
                runs[i] = [0, p]
    for i, row_runs in enumerate(runs):  # an ended trajectory: its newest run's
        if row_runs and newest_version[i] is None:
            version[i] = row_runs[-1]
    ends = [e or "" for e in newest(chains["end"])]
    return (_known(version), _known(lengths), runs if any(runs) else [],
            ends if any(ends) else [])


def _known(values: list[int | None]) -> list[int]:
    return [-1 if v is None else int(v) for v in values] if any(
        v is not None for v in values) else []


def _column(batch: pa.RecordBatch, name: str) -> list[int]:
    if name not in batch.schema.names:
        return []
    values = batch.column(name).to_pylist()
    return [-1 if v is None else int(v) for v in values]


class Tracer:
    """Builds and sends one worker's ``RowTrace`` records; every method is a no-op when off.

    Invariant: a record's per-row lists follow its ``row_ids`` (``RowTrace.check``)."""

    def __init__(self, send: Callable[[Any], None] | None, worker: str, *,
                 enabled: bool) -> None:  # enabled: run.trace
        self._send, self.worker = send, worker
        self.enabled = bool(enabled and send is not None)

    @classmethod
    def of(cls, events: Any, worker: str) -> Tracer:
        """The tracer of a stage loop: on when its report sender says so (``EventSender.trace``;
        a wrapped sender forwards the attribute)."""
        return cls(events.send, worker, enabled=bool(getattr(events, "trace", False)))

    def _emit(self, event: str, lease: Lease, batch: pa.RecordBatch | None = None, *,
              t: float | None = None, **fields: Any) -> None:
        """One record of ``lease``'s rows (or ``batch``'s, a subset of them). The trace is a
        diagnostic: a record that cannot be built is logged and dropped, never fails the work."""
        try:
            self._build_and_send(event, lease, batch, t, fields)
        except Exception as exc:
            log.warning("%s: no trace of %s (lease %s): %s", self.worker, event, lease.lease_id,
                        exc)

    def _build_and_send(self, event: str, lease: Lease, batch: pa.RecordBatch | None,
                        t: float | None, fields: dict[str, Any]) -> None:
        rows = lease.batch if batch is None else batch
        row_ids = rows.column(ROW_ID).to_pylist()
        deliveries = dict(zip(lease.batch.column(ROW_ID).to_pylist(),
                              _column(lease.batch, "deliveries"), strict=False))
        info = lease.batch if batch is None else _facts_of(lease.batch, row_ids)
        self._send(RowTrace(
            event=event, task=lease.task, worker=self.worker,
            t=time.time() if t is None else t, row_ids=[int(r) for r in row_ids],
            lease_id=int(lease.lease_id),
            deliveries=[deliveries.get(r, -1) for r in row_ids] if deliveries else [],
            groups=_column(info, "group_id"), iterations=_column(info, "iteration"), **fields))

    def claim(self, lease: Lease) -> None:
        if self.enabled and lease.num_rows:
            self._emit("claim", lease)

    def lease_event(self, event: str, lease: Lease, rows: pa.RecordBatch | None = None, *,
                    t: float | None = None, error: str = "") -> None:
        """ack | release | fail | fenced of every row of ``lease`` (or of ``rows``, some of its
        rows)."""
        if self.enabled and lease.num_rows and (rows is None or rows.num_rows):
            self._emit(event, lease, rows, t=t, error=error[:500])

    def write(self, lease: Lease, batch: pa.RecordBatch, *, seconds: float = 0.0,
              t: float | None = None, kept: Iterable[int] = (),
              calls: Mapping[int, ToolCallFacts] | None = None) -> None:
        """The batch written under ``lease`` (``row_id`` + columns); ``kept``: indexes of its rows
        whose cells a predecessor had written (recorded as "kept", not as written); ``calls``:
        the tool call the stage executed per row id."""
        if not self.enabled or batch.num_rows == 0:
            return
        try:
            self._write(lease, batch, seconds, t, set(kept), calls)
        except Exception as exc:  # as in _emit: never fails the work
            log.warning("%s: no trace of a write (lease %s): %s", self.worker, lease.lease_id, exc)

    def _write(self, lease: Lease, batch: pa.RecordBatch, seconds: float, t: float | None,
               kept: set[int], calls: Mapping[int, ToolCallFacts] | None) -> None:
        columns = [c for c in batch.schema.names if c != ROW_ID]
        if kept:
            mask = pa.array([i in kept for i in range(batch.num_rows)])
            self._emit("kept", lease, batch.filter(mask), t=t, columns=columns)
            batch = batch.filter(pc.invert(mask))
            if batch.num_rows == 0:
                return
        versions, tokens, runs, ends = write_facts(batch)
        fields: dict[str, Any] = {"versions": versions, "tokens": tokens, "runs": runs,
                                  "ends": ends}
        if calls:
            found = [calls.get(int(r)) for r in batch.column(ROW_ID).to_pylist()]
            fields["tools"] = [c[0] if c else "" for c in found]
            fields["tool_seconds"] = [c[1] if c else 0.0 for c in found]
            fields["tool_errors"] = [(c[2] or "") if c else "" for c in found]
        self._emit("write", lease, batch, t=t, seconds=seconds, columns=columns, **fields)

    def consume(self, lease: Lease, rows: pa.RecordBatch, version: int, *,
                columns: tuple[str, ...] = ()) -> None:
        """``rows`` of ``lease`` trained into policy ``version``."""
        if self.enabled and rows.num_rows:
            self._emit("consume", lease, rows, columns=list(columns),
                       versions=[int(version)] * rows.num_rows)


def _facts_of(batch: pa.RecordBatch, row_ids: list[int]) -> pa.RecordBatch:
    """The rows of ``batch`` with ``row_ids``, in that order (group and iteration of a subset)."""
    index = {r: i for i, r in enumerate(batch.column(ROW_ID).to_pylist())}
    return batch.take(pa.array([index[r] for r in row_ids], pa.int64()))


def put_trace(row_ids: Iterable[int], rows: pa.RecordBatch, *, t: float | None = None,
              worker: str = "controller") -> RowTrace:
    """The controller's record of a put: the new rows with their group and iteration."""
    return RowTrace(event="put", task="put", worker=worker, t=time.time() if t is None else t,
                    row_ids=[int(r) for r in row_ids], groups=_column(rows, "group_id"),
                    iterations=_column(rows, "iteration"))
