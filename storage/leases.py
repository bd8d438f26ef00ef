"""Leases of a store node: handing rows out (``claim``) and ending leases (ack, release, expiry).

A mixin of ``StoreNode``: claim planning, shard choice, lease records and their deadline heap,
and fencing (rules: docs/store-protocol.md, "Leases and fencing")."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from storage._validate import positive
from storage.errors import BadRequest, LeaseExpired, UnknownLease
from storage.queues import LeaseRec
from storage.schema import ROW_ID, Lease, RowState
from storage.shard import Shard

if TYPE_CHECKING:
    from storage.node import _Table

_EXPIRED_MEMORY = 65536  # expired lease ids remembered for LeaseExpired (vs UnknownLease)
_MAX_LEASE_SECONDS = 7 * 24 * 3600.0
_MAX_ERROR_LEN = 500


class NodeLeases:
    """Mixin of ``StoreNode``: claim, ack, extend, release, expire, next_deadline."""

    node_index: int
    clock: Callable[[], float]
    events: Any
    _leases: dict[int, tuple[_Table, Shard, LeaseRec]]
    _deadlines: list[tuple[float, int]]  # heap; stale entries skipped lazily
    _expired: OrderedDict[int, None]
    _table: Callable[[str], _Table]  # StoreNode's: table by name (UnknownTable)
    _task: Callable[[_Table, str], int]  # StoreNode's: task index (UnknownTask)
    _next_lease_id: Callable[[], int]  # StoreNode's (see "Ids" in storage/node.py)

    def _shards(self, tb: _Table, shards: Sequence[int] | None) -> list[Shard]:
        if shards is None:
            return list(tb.shards.values())
        if not shards:
            raise BadRequest("shards: an empty list names no shard (leave it None for all)")
        out = []
        for sid in shards:
            shard = tb.shards.get(sid)
            if shard is None:
                raise BadRequest(f"shards: {sid} is not served by node {self.node_index}")
            out.append(shard)
        return out

    def _claim_columns(
        self, tb: _Table, t: int, columns: Sequence[str]
    ) -> tuple[list[str], list[int], list[int]]:
        """(names, column ids with -1 = created_at, ids to check as written), cached."""
        key = (t, tuple(columns))
        hit = tb.claim_cols.get(key)
        if hit is not None:
            return hit
        needs = set(tb.spec.tasks[t].needs)
        names: list[str] = []
        cols: list[int] = []
        check: list[int] = []
        for name in columns:
            if not isinstance(name, str):
                raise BadRequest(f"columns: {name!r} is not a column name")
            if name in (ROW_ID, "deliveries") or name in names:
                continue
            if name == "created_at":
                names.append(name)
                cols.append(-1)
                continue
            c = tb.col_index.get(name)
            if c is None:
                raise BadRequest(f"columns: table {tb.spec.name!r} has no column {name!r}")
            names.append(name)
            cols.append(c)
            if name not in needs:
                check.append(c)
        if len(tb.claim_cols) < 1024:
            tb.claim_cols[key] = (names, cols, check)
        return names, cols, check

    def check_claim(
        self, table: str, task: str, columns: Sequence[str], max_rows: int, *,
        shards: Sequence[int] | None = None, **options: Any,
    ) -> None:
        """Raise what ``claim`` would raise for its arguments alone (not for the rows it would
        hand out); changes nothing. Run before a claim's piggybacked ack, so that a malformed
        claim leaves the ack unapplied."""
        self._shards(self._claim_plan(table, task, columns, max_rows, **options)[0], shards)

    def _claim_plan(
        self, table: str, task: str, columns: Sequence[str], max_rows: int, min_rows: int = 1,
        whole_groups: bool = False, lease_seconds: float | None = None,
    ) -> tuple[_Table, int, float, tuple[list[str], list[int], list[int]], int, int, int]:
        """Validated claim arguments: (table, task, lease seconds, columns, group size,
        max units, min units). Cached per table for the argument sets consumers repeat."""
        tb = self._table(table)
        try:
            key = (task, tuple(columns), max_rows, min_rows, whole_groups, lease_seconds)
            key += (type(max_rows), type(min_rows))  # 64.0 == 64, but only an int is valid
            hit = tb.claim_plans.get(key)
        except TypeError:  # unhashable garbage from a direct caller: validate it the long way
            key, hit = None, None
        if hit is not None:
            return tb, *hit
        t = self._task(tb, task)
        spec = tb.spec
        if not isinstance(max_rows, int) or max_rows < 1:
            raise BadRequest(f"max_rows: {max_rows!r} must be a positive int")
        if not isinstance(min_rows, int) or not 1 <= min_rows <= max_rows:
            raise BadRequest(f"min_rows: {min_rows!r} must be an int in [1, max_rows]")
        seconds = spec.lease_seconds if lease_seconds is None else lease_seconds
        if not positive(seconds) or seconds > _MAX_LEASE_SECONDS:
            bound = f"(0, {_MAX_LEASE_SECONDS}]"
            raise BadRequest(f"lease_seconds: {lease_seconds!r} must be in {bound}")
        whole = spec.tasks[t].whole_groups
        if whole_groups and not whole:
            raise BadRequest(f"whole_groups: task {task!r} was not declared with whole_groups=True")
        cols = self._claim_columns(tb, t, columns)
        g = (spec.group_size or 1) if whole else 1
        max_units, min_units = max_rows // g, -(-min_rows // g)
        if max_units < 1:
            raise BadRequest(f"max_rows: {max_rows} is smaller than one group ({g} rows)")
        plan = (t, seconds, cols, g, max_units, min_units)
        if key is not None and len(tb.claim_plans) < 1024:
            tb.claim_plans[key] = plan
        return tb, *plan

    def claim(
        self, table: str, task: str, columns: Sequence[str], max_rows: int, *, min_rows: int = 1,
        whole_groups: bool = False, lease_seconds: float | None = None,
        shards: Sequence[int] | None = None,
    ) -> Lease | None:
        self._expire_due()
        tb, t, seconds, (names, cols, check), g, max_units, min_units = self._claim_plan(
            table, task, columns, max_rows, min_rows, whole_groups, lease_seconds
        )
        candidates = self._shards(tb, shards)
        shard = max(candidates, key=lambda s: s.ready_units(t))
        if shard.ready_units(t) < min_units:
            return None
        idx = shard.pop_ready(t, max_units)
        if len(idx) < min_units * g:
            shard.unpop(t, idx)
            return None
        if check:
            try:
                shard.check_written(idx, check)
            except BadRequest:
                shard.unpop(t, idx)
                raise
        lease_id = self._next_lease_id()
        deadline = self.clock() + seconds
        seqs = shard.seqs[idx]  # fancy indexing: already a copy
        row_ids = shard.row_ids(seqs)
        rec = LeaseRec(lease_id, t, seqs, deadline, seconds, row_ids)
        shard.lease_rows(t, idx, rec)
        batch = shard.batch(idx, t, names, cols, row_ids)
        self._leases[lease_id] = (tb, shard, rec)
        heapq.heappush(self._deadlines, (deadline, lease_id))
        if tb.store is not None:
            tb.store.log_rows("claim", shard.shard_id, rec.seqs, task=task)
        self.events.on_claim(table, task, shard.shard_id, len(idx))
        return Lease(lease_id, table, task, shard.shard_id, deadline, batch)

    def ack(self, table: str, lease_id: int) -> None:
        tb = self._table(table)
        self._ack(*self._live_lease(tb, lease_id))

    def _ack(self, tb: _Table, shard: Shard, rec: LeaseRec) -> None:
        del self._leases[rec.lease_id]
        shard.leases.pop(rec.lease_id, None)
        task = tb.spec.tasks[rec.task].name
        if tb.store is not None:
            tb.store.log_rows("ack", shard.shard_id, rec.seqs, task=task)
        shard.consume(rec.task, shard.lease_idx(rec), int(RowState.LEASED))
        self.events.on_ack(tb.spec.name, task, shard.shard_id, len(rec.seqs))

    def _live_lease(self, tb: _Table, lease_id: int) -> tuple[_Table, Shard, LeaseRec]:
        self._expire_due()
        entry = self._leases.get(lease_id) if isinstance(lease_id, int) else None
        if entry is None or entry[0] is not tb:
            if lease_id in self._expired:
                why = "its rows may be held by another consumer"
                raise LeaseExpired(f"lease {lease_id} expired; {why}")
            raise UnknownLease(f"lease {lease_id!r} is not live on table {tb.spec.name!r}")
        return entry

    def extend(self, table: str, lease_id: int, seconds: float | None = None) -> float:
        tb = self._table(table)
        _, _, rec = self._live_lease(tb, lease_id)
        seconds = rec.lease_seconds if seconds is None else seconds
        if not positive(seconds) or seconds > _MAX_LEASE_SECONDS:
            raise BadRequest(f"seconds: {seconds!r} must be in (0, {_MAX_LEASE_SECONDS}]")
        rec.deadline = self.clock() + seconds
        heapq.heappush(self._deadlines, (rec.deadline, lease_id))
        return rec.deadline

    def release(self, table: str, lease_id: int, *, error: str | None = None) -> None:
        tb = self._table(table)
        if error is not None and not isinstance(error, str):
            raise BadRequest("error: must be a string or None")
        entry = self._live_lease(tb, lease_id)
        self._end_lease(entry, failed=error is not None, error=error and error[:_MAX_ERROR_LEN])

    # ----------------------------------------------------------------------------- time
    def expire(self) -> int:
        now = self.clock()
        count = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lid = heapq.heappop(self._deadlines)
            entry = self._leases.get(lid)
            if entry is None or entry[2].deadline != deadline:
                continue  # acked, released or extended since
            self._end_lease(entry, failed=True, error=None)
            self._expired[lid] = None
            if len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
            tb, shard, rec = entry
            self.events.on_lease_expired(
                tb.spec.name, tb.spec.tasks[rec.task].name, shard.shard_id, 1
            )
            count += 1
        return count

    def _expire_due(self) -> None:
        if self._deadlines and self._deadlines[0][0] <= self.clock():
            self.expire()

    def _end_lease(
        self, entry: tuple[_Table, Shard, LeaseRec], *, failed: bool, error: str | None
    ) -> None:
        tb, shard, rec = entry
        del self._leases[rec.lease_id]
        table, task = tb.spec.name, tb.spec.tasks[rec.task].name
        if tb.store is not None and not failed:
            tb.store.log_rows("release", shard.shard_id, rec.seqs, task=task)
        ready, dead = shard.end_lease(rec, failed=failed, error=error)
        if failed and ready:
            self.events.on_redeliver(table, task, shard.shard_id, ready)
        for reason, seqs in dead.items():
            if tb.store is not None:
                tb.store.log_rows("dead", shard.shard_id, seqs, task=task, reason=reason)
            self.events.on_dead(table, task, shard.shard_id, len(seqs), reason)

    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, lid = self._deadlines[0]
            entry = self._leases.get(lid)
            if entry is not None and entry[2].deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None
