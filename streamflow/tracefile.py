"""The run's trace on disk: ``TRACE_SCHEMA`` (one row per (row, event)), ``TraceWriter`` (the
controller's), and what reads it back (``read_trace``, ``trace_bytes_per_row``).

Files: ``RUN/trace/part-NNNNNN.parquet`` (zstd), each complete and written at once, one per flush:
at each iteration record and when the run ends. A crash loses at most the open buffer. The
directory loads as is with ``pandas.read_parquet`` and ``pyarrow.dataset.dataset``. Row ids are
those of one store's lifetime, so a run starts its trace afresh (a resumed run too). Design:
docs/partial.md "The trace".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from workers.runtime.events import RowTrace

log = logging.getLogger("streamflow.trace")
_NAME = pa.dictionary(pa.int32(), pa.string())  # a name repeated across rows: stored once a file
RUN_TYPE = pa.struct([pa.field("start", pa.int32()), pa.field("version", pa.int64())])

TRACE_SCHEMA = pa.schema([
    pa.field("row_id", pa.uint64(), nullable=False),  # the store's row id (one store lifetime)
    pa.field("group_id", pa.int64()),  # the row's group (NULL: the batch did not carry it)
    pa.field("iteration", pa.int64()),  # the iteration whose prompts the row belongs to
    pa.field("task", _NAME, nullable=False),  # the store task ("put" for the controller's put)
    # put | claim | write | kept | ack | release | fail | fenced | consume (workers.runtime.events)
    pa.field("event", _NAME, nullable=False),
    pa.field("worker", _NAME, nullable=False),  # e.g. "rollout-0"; "controller" for put
    pa.field("lease_id", pa.int64()),  # NULL: no lease (put)
    pa.field("delivery", pa.int16()),  # the row's delivery count in that lease (1 = first)
    pa.field("t", pa.float64(), nullable=False),  # wall-clock seconds of the event
    pa.field("seconds", pa.float32()),  # write: the stage's compute time for the micro-batch
    # write / kept: the columns written (plain strings: pandas cannot convert a list of
    # dictionary values; Parquet dictionary-encodes them on disk all the same)
    pa.field("columns", pa.list_(pa.string())),
    # write: the policy version of what was written (the newest piece's); consume: the version
    # trained into
    pa.field("policy_version", pa.int64()),
    pa.field("tokens", pa.int32()),  # write: response length after it (or the piece's length)
    # write: per-token versions of the response, run-length (run i: tokens [start_i, start_i+1))
    pa.field("version_runs", pa.list_(RUN_TYPE)),
    # write: how the newest piece written ended (cut, tool, observation, stop, ...)
    pa.field("end", _NAME),
    pa.field("tool", _NAME),  # write of an environment stage: the tool called
    pa.field("tool_seconds", pa.float32()),  # its latency
    pa.field("error", pa.string()),  # the tool's error kind, a failed delivery's reason, a fence
])


def _columns(records: Iterable[RowTrace]) -> dict[str, list[Any]]:
    """The TRACE_SCHEMA columns of ``records``, one entry per (row, event); -1 / "" in a record's
    lists: NULL. Built column by column (a flush writes thousands of rows per iteration)."""
    out: dict[str, list[Any]] = {f.name: [] for f in TRACE_SCHEMA}

    def per_row(name: str, values: list, n: int, none: Any = -1) -> None:
        out[name].extend([None if v == none else v for v in values] if values else [None] * n)

    for rec in records:
        n = len(rec.row_ids)
        out["row_id"].extend(rec.row_ids)
        per_row("group_id", rec.groups, n)
        per_row("iteration", rec.iterations, n)
        per_row("delivery", rec.deliveries, n)
        per_row("policy_version", rec.versions, n)
        per_row("tokens", rec.tokens, n)
        per_row("tool", rec.tools, n, "")
        per_row("end", rec.ends, n, "")
        for name, value in (("task", rec.task), ("event", rec.event), ("worker", rec.worker),
                            ("lease_id", rec.lease_id or None), ("t", rec.t),
                            ("seconds", rec.seconds if rec.event == "write" else None),
                            ("columns", rec.columns or None)):
            out[name].extend([value] * n)
        out["version_runs"].extend(
            [[{"start": r[k], "version": r[k + 1]} for k in range(0, len(r) - 1, 2)] or None
             for r in rec.runs] if rec.runs else [None] * n)
        tools = out["tool"][-n:] if n else []
        out["tool_seconds"].extend(
            [s if tool is not None else None for s, tool in zip(rec.tool_seconds, tools,
                                                                 strict=True)]
            if rec.tool_seconds else [None] * n)
        errors = rec.tool_errors or [""] * n
        out["error"].extend([e or rec.error or None for e in errors])
    return out


def to_table(records: Iterable[RowTrace]) -> pa.Table:
    """``records`` as one TRACE_SCHEMA table."""
    columns = _columns(records)
    arrays = []
    for f in TRACE_SCHEMA:
        values = columns[f.name]
        if f.type == _NAME:
            arrays.append(pa.array(values, pa.string()).dictionary_encode())
        else:
            arrays.append(pa.array(values, f.type))
    return pa.Table.from_arrays(arrays, schema=TRACE_SCHEMA)


def clear(path: Path) -> None:
    """Remove the part files of an earlier trace in ``path`` (a retry, a resume, run.trace off)."""
    for part in path.glob("part-*.parquet") if path.is_dir() else ():
        part.unlink()


class TraceWriter:
    """Buffers ``RowTrace`` records and writes them as the next part file at each ``flush``;
    ``flush_due`` flushes only once the buffer holds ``flush_rows`` event rows or ``flush_s`` have
    passed since the last part file: a part file carries a fixed cost of footer and schema, so
    one per iteration of a small run would cost more than its rows, while a crash loses at most
    the buffer of ``flush_s`` seconds.

    Rows whose records carry no group or iteration (a stage that does not claim them) take the
    values of the row's put, kept until the row is consumed."""

    def __init__(self, path: Path, *, flush_rows: int = 65_536, flush_s: float = 30.0) -> None:
        self.path = path
        self.flush_rows, self.flush_s = flush_rows, flush_s
        self._buffered_rows = 0  # event rows in the buffer: one per (row, event)
        self._flushed_at = time.monotonic()
        clear(path)
        path.mkdir(parents=True, exist_ok=True)
        self._buffer: list[RowTrace] = []
        self._parts = 0
        self._put: dict[int, tuple[int, int]] = {}  # row id -> (group, iteration), put until consumed
        self.rows_written = 0

    def add(self, rec: RowTrace) -> None:
        if rec.event == "put":
            for i, row in enumerate(rec.row_ids):
                self._put[row] = (rec.groups[i] if rec.groups else -1,
                                  rec.iterations[i] if rec.iterations else -1)
        elif not rec.groups or not rec.iterations:
            known = [self._put.get(row, (-1, -1)) for row in rec.row_ids]
            rec.groups = rec.groups or [g for g, _ in known]
            rec.iterations = rec.iterations or [k for _, k in known]
        if rec.event == "consume":
            for row in rec.row_ids:
                self._put.pop(row, None)
        self._buffer.append(rec)
        self._buffered_rows += len(rec.row_ids)

    def flush_due(self) -> Path | None:
        """``flush`` when the buffer is big or old enough (see the class docstring)."""
        if (self._buffered_rows >= self.flush_rows
                or time.monotonic() - self._flushed_at >= self.flush_s):
            return self.flush()
        return None

    def flush(self) -> Path | None:
        """Write the buffer as the next part file (none when empty); never raises (the trace is a
        diagnostic: a full disk must not fail the run)."""
        if not self._buffer:
            return None
        records, self._buffer, self._buffered_rows = self._buffer, [], 0
        self._flushed_at = time.monotonic()
        target = self.path / f"part-{self._parts:06d}.parquet"
        try:
            table = to_table(records)
            tmp = target.with_suffix(".tmp")  # complete or absent: readers never see half a file
            pq.write_table(table, tmp, compression="zstd")
            tmp.rename(target)
        except Exception as exc:
            log.warning("trace: could not write %s: %s", target, exc)
            return None
        self._parts += 1
        self.rows_written += table.num_rows
        return target

    def close(self) -> None:
        self.flush()


def read_trace(path: str | Path) -> pa.Table:
    """Every part file of a trace directory as one TRACE_SCHEMA table."""
    parts = sorted(Path(path).glob("part-*.parquet"))
    if not parts:
        return TRACE_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(p).cast(TRACE_SCHEMA) for p in parts],
                            promote_options="none")


def trace_bytes_per_row(run_dir: str | Path) -> float:
    """Bytes of ``RUN/trace`` per row put (the trace's cost on disk; 0.0 without a trace)."""
    path = Path(run_dir) / "trace"
    parts = sorted(path.glob("part-*.parquet")) if path.is_dir() else []
    if not parts:
        return 0.0
    size = sum(p.stat().st_size for p in parts)
    rows = sum(pq.read_table(p, columns=["event"]).column("event").to_pylist().count("put")
               for p in parts)
    return size / max(rows, 1)
