"""StoreNode: the in-process, single-threaded, non-blocking state machine of one store node.

Owns the node's tables (``num_shards`` ``Shard``s each) and live leases; every verb validates
its whole input before mutating anything. Ids and contract choices: docs/store-protocol.md."""

from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from storage._validate import as_batch, check_columns, group_order, validate_spec
from storage.errors import (
    BadRequest,
    SchemaMismatch,
    StoreFull,
    TableExists,
    UnknownRows,
    UnknownTable,
    UnknownTask,
)
from storage.leases import NodeLeases
from storage.persist import TableStore
from storage.persist_root import MAX_EPOCH, discover, next_epoch
from storage.queues import LeaseRec
from storage.schema import META_COLUMNS, ROW_ID, TableSpec, TableStats, split_row_ids
from storage.shard import Shard

LEASE_COUNTER_BITS = 32

log = logging.getLogger(__name__)


def _random_epoch() -> int:
    """The epoch of a node without a persistence root (module-level so a test can force it)."""
    return random.SystemRandom().randrange(1, MAX_EPOCH + 1)


class NodeEvents(Protocol):
    """Hooks the server's metrics implement; called synchronously after each state change."""

    def on_put(self, table: str, shard_id: int, rows: int, nbytes: int) -> None: ...
    def on_write(self, table: str, shard_id: int, nbytes: int) -> None: ...
    def on_claim(self, table: str, task: str, shard_id: int, rows: int) -> None: ...
    def on_ack(self, table: str, task: str, shard_id: int, rows: int) -> None: ...
    def on_redeliver(self, table: str, task: str, shard_id: int, rows: int) -> None: ...
    def on_dead(self, table: str, task: str, shard_id: int, rows: int, reason: str) -> None: ...
    def on_lease_expired(self, table: str, task: str, shard_id: int, leases: int) -> None: ...


class NullEvents(NodeEvents):
    """NodeEvents that ignores everything (the protocol's methods do nothing)."""


@dataclass
class _Table:
    spec: TableSpec
    shards: dict[int, Shard]
    col_index: dict[str, int]
    task_index: dict[str, int]
    store: TableStore | None = None
    claim_cols: dict[tuple, tuple] = field(default_factory=dict)  # see NodeLeases._claim_columns
    claim_plans: dict[tuple, tuple] = field(default_factory=dict)  # see NodeLeases._claim_plan

    def rows(self) -> int:
        return sum(s.num_alive for s in self.shards.values())

    def nbytes(self) -> int:
        return sum(s.bytes for s in self.shards.values())


class StoreNode(NodeLeases):
    """One store node's tables, shards and leases. Not thread-safe: one caller thread."""

    def __init__(
        self, node_index: int = 0, num_shards: int = 1, *, clock: Callable[[], float] = time.time,
        events: NodeEvents | None = None, persist_root: str | os.PathLike | None = None,
    ) -> None:
        if not 0 <= node_index < 256:
            raise BadRequest(f"node_index: {node_index} not in [0, 256)")
        if not 1 <= num_shards <= 256:
            raise BadRequest(f"num_shards: {num_shards} not in [1, 256]")
        self.node_index = node_index
        self.shard_ids = [(node_index << 8) | i for i in range(num_shards)]
        self.clock = clock
        self.events: NodeEvents = events if events is not None else NullEvents()
        self.persist_root = None if persist_root is None else os.path.abspath(persist_root)
        self._tables: dict[str, _Table] = {}
        self._leases: dict[int, tuple[_Table, Shard, LeaseRec]] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._expired: OrderedDict[int, None] = OrderedDict()
        self.recovered: dict[str, int] = {}  # tables recovered at start -> their rows
        if self.persist_root is not None:
            os.makedirs(self.persist_root, exist_ok=True)
        self._new_epoch()
        if self.persist_root is not None:
            for spec in discover(self.persist_root):
                self.create_table(spec)
                tb = self._tables[spec.name]
                rows = self.recovered[spec.name] = tb.rows()
                log.info("table %s recovered from %s: %d rows", spec.name, tb.store.path, rows)

    def _new_epoch(self) -> None:
        root = self.persist_root
        epoch = _random_epoch() if root is None else next_epoch(root, self.node_index)
        if not 1 <= epoch <= MAX_EPOCH:
            raise ValueError(f"lease epoch {epoch} is out of range")
        self.epoch, self._lease_counter = epoch, 0

    def _next_lease_id(self) -> int:
        if self._lease_counter + 1 >= 1 << LEASE_COUNTER_BITS:
            self._new_epoch()  # counter exhausted: a new incarnation (ids still never repeat)
        self._lease_counter += 1
        return (self.epoch << LEASE_COUNTER_BITS) | self._lease_counter

    # ----------------------------------------------------------------------------- tables
    def create_table(self, spec: TableSpec) -> None:
        validate_spec(spec)
        existing = self._tables.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return
            raise TableExists(f"table {spec.name!r} exists with a different spec")
        tb = _Table(spec=spec, shards={sid: Shard(sid, spec) for sid in self.shard_ids},
                    col_index={n: i for i, n in enumerate(spec.schema.names)},
                    task_index={t.name: i for i, t in enumerate(spec.tasks)})
        if self.persist_root is not None:
            tb.store = TableStore(spec, self.persist_root, self.node_index)
            tb.store.recover(tb.shards)
        self._tables[spec.name] = tb

    def drop_table(self, name: str) -> None:
        tb = self._table(name)
        for lid in [lid for lid, e in self._leases.items() if e[0] is tb]:
            del self._leases[lid]
        if tb.store is not None:
            tb.store.destroy()
        del self._tables[name]

    def table_names(self) -> list[str]:
        return list(self._tables)

    def table_spec(self, name: str) -> TableSpec:
        return self._table(name).spec

    def _table(self, name: str) -> _Table:
        tb = self._tables.get(name) if isinstance(name, str) else None
        if tb is None:
            raise UnknownTable(f"no table {name!r} on node {self.node_index}")
        return tb

    def _task(self, tb: _Table, task: str) -> int:
        t = tb.task_index.get(task) if isinstance(task, str) else None
        if t is None:
            raise UnknownTask(f"table {tb.spec.name!r} has no task {task!r}")
        return t

    # ----------------------------------------------------------------------------- put
    def live_rows(self, table: str) -> int:
        """Rows of ``table`` held on this node (O(shards); the server's placement hint)."""
        return self._table(table).rows()

    def has_capacity(self, table: str, num_rows: int, num_bytes: int) -> bool:
        tb = self._table(table)
        return (tb.rows() + num_rows <= tb.spec.capacity_rows
                and tb.nbytes() + num_bytes <= tb.spec.capacity_bytes)

    def put(self, table: str, batch: pa.RecordBatch, *, shard_id: int | None = None) -> np.ndarray:
        tb = self._table(table)
        spec = tb.spec
        batch = as_batch(batch, "put")
        for name in batch.schema.names:
            if name in META_COLUMNS:
                raise SchemaMismatch(f"column {name!r} is store metadata and cannot be put")
        arrays = check_columns(tb.spec, batch)
        n, nbytes = batch.num_rows, batch.get_total_buffer_size()
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        if n > spec.capacity_rows or nbytes > spec.capacity_bytes:
            raise BadRequest(f"put of {n} rows / {nbytes} bytes can never fit table {table!r} "
                             f"(capacity {spec.capacity_rows} rows / {spec.capacity_bytes} bytes)")
        order = group_order(tb.spec, batch) if spec.group_column else None
        if order is not None:
            batch = batch.take(pa.array(order))
            nbytes = batch.get_total_buffer_size()
            arrays = {tb.col_index[f.name]: batch.column(i) for i, f in enumerate(batch.schema)}
        if shard_id is None:
            shard = min(tb.shards.values(), key=lambda s: s.num_alive)
        elif shard_id in tb.shards:
            shard = tb.shards[shard_id]
        else:
            raise BadRequest(f"shard_id: {shard_id} is not served by node {self.node_index}")
        if not self.has_capacity(table, n, nbytes):
            raise StoreFull(f"table {table!r} is full ({tb.rows()} rows, {tb.nbytes()} bytes held)")
        now = self.clock()
        if tb.store is not None:
            tb.store.log_put(shard.shard_id, shard.next_seq, now, batch)
        start = shard.put(arrays, n, now, nbytes)
        seqs = np.arange(start, start + n, dtype=np.int64)
        if order is not None:
            seqs[order] = seqs.copy()  # row i of the caller's batch got seq start + rank(i)
        self.events.on_put(table, shard.shard_id, n, nbytes)
        return shard.row_ids(seqs)

    # ---------------------------------------------------------- ready rows (claims: storage.leases)
    def ready_count(
        self, table: str, task: str, *, whole_groups: bool = False,
        shards: Sequence[int] | None = None,
    ) -> int:
        tb = self._table(table)
        t = self._task(tb, task)
        units = sum(s.ready_units(t) for s in self._shards(tb, shards))
        return units * (tb.spec.group_size or 1) if tb.spec.tasks[t].whole_groups else units

    # ----------------------------------------------------------------------------- write
    def write(
        self, table: str, batch: pa.RecordBatch, *, lease_id: int | None = None, ack: bool = False,
        overwrite: bool = False,
    ) -> None:
        tb = self._table(table)
        batch = as_batch(batch, "write")
        if ack and lease_id is None:
            raise BadRequest("ack=True needs a lease_id")
        if ROW_ID not in batch.schema.names:
            raise BadRequest("write: the batch needs a 'row_id' column")
        for name in batch.schema.names:
            if name in META_COLUMNS and name != ROW_ID:
                raise SchemaMismatch(f"column {name!r} is store metadata and cannot be written")
        rid_col = batch.column(ROW_ID)
        if rid_col.type != pa.uint64() or rid_col.null_count:
            got = rid_col.type
            raise SchemaMismatch(f"column 'row_id': expected type uint64 without nulls, got {got}")
        arrays = check_columns(tb.spec, batch)
        row_ids = rid_col.to_numpy()
        entry = self._live_lease(tb, lease_id) if lease_id is not None else None
        if entry is not None and _same_ids(row_ids, entry[2].row_ids):
            # The common case: exactly the lease's rows in its order (the checks below hold).
            _, lshard, rec = entry
            idx = lshard.lease_idx(rec)
            lshard.check_write(idx, list(arrays), overwrite)
            self._apply_write(tb, lshard, idx, arrays, batch, overwrite)
            if ack:
                self._ack(*entry)
            return
        ordered = np.sort(row_ids)
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise BadRequest("write: duplicate row ids in the batch")
        shard_of, seqs = split_row_ids(row_ids)
        plan: list[tuple[Shard, np.ndarray, np.ndarray]] = []  # (shard, batch positions, idx)
        touched = np.unique(shard_of).tolist()
        for sid in touched:
            shard = tb.shards.get(sid)
            if shard is None:
                raise UnknownRows(f"row ids of shard {sid} are not on node {self.node_index}")
            pos = np.arange(len(row_ids)) if len(touched) == 1 else np.flatnonzero(shard_of == sid)
            plan.append((shard, pos, shard.locate(seqs[pos])))
        if entry is not None:
            _, lshard, rec = entry
            for shard, _pos, idx in plan:
                held = shard is lshard and bool((shard.lease[rec.task, idx] == rec.lease_id).all())
                if not held:
                    raise BadRequest(f"write: some rows are not part of lease {lease_id}")
        for shard, _pos, idx in plan:
            shard.check_write(idx, list(arrays), overwrite)
        for shard, pos, idx in plan:
            if len(pos) == len(row_ids):
                self._apply_write(tb, shard, idx, arrays, batch, overwrite)
            else:
                sel = pa.array(pos)
                part = {c: a.take(sel) for c, a in arrays.items()}
                self._apply_write(tb, shard, idx, part, batch.take(sel), overwrite)
        if ack and entry is not None:
            self._ack(*entry)

    def _apply_write(
        self, tb: _Table, shard: Shard, idx: np.ndarray, arrays: dict[int, pa.Array],
        batch: pa.RecordBatch, overwrite: bool,
    ) -> None:
        """Point the cells (idx, columns of ``arrays``) at ``arrays`` (checked by the caller)."""
        if not arrays:
            return
        if tb.store is not None:
            cols = batch.drop_columns([ROW_ID])
            tb.store.log_write(shard.shard_id, shard.seqs[idx], cols, overwrite)
        nbytes = sum(a.get_total_buffer_size() for a in arrays.values())
        shard.write(idx, arrays, np.arange(len(idx), dtype=np.int32), nbytes)
        self.events.on_write(tb.spec.name, shard.shard_id, nbytes)

    # ----------------------------------------------------------------------------- admin
    def stats(self, table: str) -> TableStats:
        tb = self._table(table)
        return TableStats(table=table, shards=[s.stats() for s in tb.shards.values()])

    def clear(self, table: str, *, dead: bool = False) -> int:
        tb = self._table(table)
        if not dead:
            return 0  # rows consumed by every task are freed as soon as the last ack lands
        freed = 0
        for shard in tb.shards.values():
            seqs = shard.clear_dead()
            if tb.store is not None and len(seqs):
                tb.store.log_rows("free", shard.shard_id, seqs)
            freed += len(seqs)
        return freed

    def snapshot(self, table: str) -> str:
        tb = self._table(table)
        if tb.store is None:
            raise BadRequest(f"node {self.node_index} has no persistence root (--persist-dir)")
        return tb.store.snapshot(tb.shards)

    def sync(self) -> None:
        now = time.monotonic()
        for tb in self._tables.values():
            if tb.store is not None:
                tb.store.sync(now)

    def memory_bytes(self) -> int:
        return sum(tb.nbytes() for tb in self._tables.values())

    def close(self) -> None:
        for tb in self._tables.values():
            if tb.store is not None:
                tb.store.close()
        self._tables.clear()
        self._leases.clear()
        self._deadlines.clear()


def _same_ids(row_ids: np.ndarray, lease_ids: np.ndarray | None) -> bool:
    return lease_ids is not None and np.array_equal(row_ids, lease_ids)
