"""One shard of one table: the per-row state machine, in numpy arrays, and its ready queues.

Owns the rows' cells (pointers into ``storage._columns``) and per (row, task) state, deliveries,
lease and dead reason. Layout, groups and invariants: docs/store-protocol.md ("Shards")."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from storage._columns import Source, claimed_batch, gather_with_nulls
from storage.errors import BadRequest, CellAlreadyWritten, UnknownRows
from storage.queues import LeaseRec, SeqQueue
from storage.schema import SEQ_BITS, RowState, ShardStats, TableSpec, TaskStats

PENDING, READY, LEASED, CONSUMED, DEAD = (int(s) for s in RowState)
_NUM_STATES = len(RowState)
_COMPACT_MIN = 4096
# Per-row arrays (rows the last axis): name -> (leading axis "", "col" or "task"; dtype; fill).
_ROW_ARRAYS: dict[str, tuple[str, type, int | float | bool]] = {
    "seqs": ("", np.int64, 0),
    "alive": ("", np.bool_, False),
    "created": ("", np.float64, 0.0),
    "gpos": ("", np.int64, 0),
    "src": ("col", np.int32, -1),  # -1 = cell not written
    "off": ("col", np.int32, 0),
    "state": ("task", np.uint8, PENDING),
    "deliv": ("task", np.uint16, 0),
    "lease": ("task", np.int64, 0),  # 0 = not leased
    "reason": ("task", np.int32, -1),  # index into reasons, -1 = none
    "gready": ("task", np.int32, 0),  # READY rows of group, at leader
}


class Shard:
    """Rows of one table on one shard. Layout and invariants: docs/store-protocol.md."""

    def __init__(self, shard_id: int, spec: TableSpec) -> None:
        self.shard_id = shard_id
        self.spec = spec
        self.row_id_base = np.uint64(shard_id << SEQ_BITS)
        self.columns = list(spec.schema.names)
        col_index = {name: i for i, name in enumerate(self.columns)}
        self.task_names = [t.name for t in spec.tasks]
        self.needs = [np.array([col_index[c] for c in t.needs], dtype=np.int64) for t in spec.tasks]
        self._needs_sets = [set(n.tolist()) for n in self.needs]
        self.whole = [t.whole_groups for t in spec.tasks]
        # per task: the column whose NULL cell skips the row (TaskSpec.skip_null), -1: none
        self.skip_col = [col_index[t.skip_null] if t.skip_null else -1 for t in spec.tasks]
        self.group_size = spec.group_size or 1
        num_cols, num_tasks = len(self.columns), len(spec.tasks)
        self.n = 0  # dense slots in use (live + freed-not-yet-compacted)
        self.num_alive = 0
        self.next_seq = 0
        lead = {"": (), "col": (num_cols,), "task": (num_tasks,)}
        for name, (axis, dtype, _) in _ROW_ARRAYS.items():
            setattr(self, name, np.empty((*lead[axis], 0), dtype=dtype))
        self.counts = np.zeros((num_tasks, _NUM_STATES), dtype=np.int64)
        self.consumed_total = np.zeros(num_tasks, dtype=np.int64)
        self.redelivered_total = np.zeros(num_tasks, dtype=np.int64)
        self.ready_groups = np.zeros(num_tasks, dtype=np.int64)
        self.queues = [SeqQueue() for _ in spec.tasks]
        self.sources: dict[int, Source] = {}
        self.next_source = 0
        self.bytes = 0
        self.reasons: list[str] = []
        self._reason_index: dict[str, int] = {}
        self.leases: dict[int, LeaseRec] = {}
        self.layout = 0  # bumped by _compact, the only step that moves rows' dense indices

    # ----------------------------------------------------------------------------- row lookup
    def row_ids(self, seqs: np.ndarray) -> np.ndarray:
        return seqs.astype(np.uint64) | self.row_id_base

    def locate(self, seqs: np.ndarray) -> np.ndarray:
        """Dense indices of live rows; UnknownRows naming the first few missing row ids."""
        idx, ok = self._find(seqs)
        if not bool(ok.all()):
            missing = self.row_ids(seqs[~ok][:5]).tolist()
            raise UnknownRows(f"shard {self.shard_id}: no live row with id(s) {missing}")
        return idx

    def lease_idx(self, rec: LeaseRec) -> np.ndarray:
        """Dense indices of a live lease's rows (cached until the next compaction). A leased
        row cannot be freed (its task has not consumed it), so only compaction moves it."""
        if rec.layout != self.layout or rec.idx is None:
            rec.idx, rec.layout = self.locate(rec.seqs), self.layout
        return rec.idx

    def _find(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.n
        idx = np.searchsorted(self.seqs[:n], seqs)
        clipped = np.minimum(idx, max(n - 1, 0))
        ok = (idx < n) & (self.seqs[clipped] == seqs) & self.alive[clipped] if n else idx < 0
        return clipped, ok

    def _reason_id(self, text: str) -> int:
        rid = self._reason_index.get(text)
        if rid is None:
            rid = self._reason_index[text] = len(self.reasons)
            self.reasons.append(text)
        return rid

    # ----------------------------------------------------------------------------- storage
    def _grow(self, extra: int) -> None:
        need = self.n + extra
        if need <= len(self.seqs):
            return
        cap = max(need, 2 * len(self.seqs), 1024)
        for name, (_, _, fill) in _ROW_ARRAYS.items():
            a = getattr(self, name)
            out = np.full((*a.shape[:-1], cap), fill, dtype=a.dtype)
            out[..., : self.n] = a[..., : self.n]
            setattr(self, name, out)

    def _compact(self) -> None:
        keep = np.flatnonzero(self.alive[: self.n])
        k = len(keep)
        for name in _ROW_ARRAYS:
            a = getattr(self, name)
            a[..., :k] = a[..., keep]
        self.alive[k : self.n] = False
        self.n = k
        self.layout += 1  # dense indices moved: cached lease indices are stale

    def _add_source(self, arrays: dict[int, pa.Array], refs: int, nbytes: int | None = None) -> int:
        sid = self.next_source
        self.next_source += 1
        if nbytes is None:
            nbytes = sum(a.nbytes for a in arrays.values())
        self.sources[sid] = Source(arrays, nbytes, refs)
        self.bytes += nbytes
        return sid

    def _unref(self, src: np.ndarray) -> None:
        if not len(src):
            return
        lo, hi = int(src.min()), int(src.max())
        if lo == hi:  # the common case: all cells from one chunk (or none written)
            if lo >= 0:
                self._drop_refs(lo, len(src))
            return
        ids, cnt = np.unique(src[src >= 0], return_counts=True)
        for sid, c in zip(ids.tolist(), cnt.tolist(), strict=True):
            self._drop_refs(sid, c)

    def _drop_refs(self, sid: int, count: int) -> None:
        source = self.sources[sid]
        source.refs -= count
        if source.refs <= 0:
            self.bytes -= source.nbytes
            del self.sources[sid]

    def append(
        self, seqs: np.ndarray, created: np.ndarray | float, arrays: dict[int, pa.Array],
        written: dict[int, np.ndarray] | None = None, gpos: np.ndarray | None = None,
        nbytes: int | None = None,
    ) -> np.ndarray:
        """Append rows (ascending seqs above every existing one) as PENDING; returns indices.
        ``written[c]``: which cells of ``arrays[c]`` are written (a snapshot; None: all)."""
        k = len(seqs)
        if written is not None:  # a column with no written cell needs no source
            arrays = {c: a for c, a in arrays.items() if bool(written[c].any())}
        self._grow(k)
        start = self.n
        idx = np.arange(start, start + k)
        sl = slice(start, start + k)  # the same slots: slice assignment is cheaper than fancy
        self.n += k
        self.num_alive += k
        self.next_seq = max(self.next_seq, int(seqs[-1]) + 1)
        # Slots past n may hold rows moved away by _compact: reset every per-row field.
        for name, (_, _, fill) in _ROW_ARRAYS.items():
            getattr(self, name)[..., sl] = fill
        self.seqs[sl], self.alive[sl], self.created[sl] = seqs, True, created
        if gpos is not None:
            self.gpos[sl] = gpos
        refs = k * len(arrays) if written is None else sum(int(written[c].sum()) for c in arrays)
        sid = self._add_source(arrays, refs, nbytes)
        positions = np.arange(k, dtype=np.int32)
        for c in arrays:
            mask = None if written is None else written[c]
            self.src[c, sl] = sid if mask is None else np.where(mask, sid, -1)
            self.off[c, sl] = positions
        self.counts[:, PENDING] += k
        return idx

    def put(
        self, arrays: dict[int, pa.Array], num_rows: int, created_at: float,
        nbytes: int | None = None,
    ) -> int:
        """Create rows (batch already validated, grouped rows consecutive). Returns first seq."""
        start = self.next_seq
        seqs = np.arange(start, start + num_rows, dtype=np.int64)
        gpos = seqs - start
        gpos %= self.group_size
        idx = self.append(seqs, created_at, arrays, gpos=gpos, nbytes=nbytes)
        self.refresh_ready(idx, list(arrays), fresh=True)
        return start

    def check_write(self, idx: np.ndarray, cols: Sequence[int], overwrite: bool) -> None:
        if overwrite:
            return
        for c in cols:
            taken = self.src[c, idx] >= 0
            if bool(taken.any()):
                rid = self.row_ids(self.seqs[idx[taken][:1]])[0]
                raise CellAlreadyWritten(
                    f"column {self.columns[c]!r} of row {int(rid)} is already written"
                )

    def write(
        self, idx: np.ndarray, arrays: dict[int, pa.Array], offsets: np.ndarray,
        nbytes: int | None = None,
    ) -> None:
        """Point cells (idx, c) at ``arrays[c][offsets]``; caller ran ``check_write``."""
        k = len(idx)
        for c in arrays:
            self._unref(self.src[c, idx])  # overwrite: the old cells are no longer live
        sid = self._add_source(arrays, k * len(arrays), nbytes)
        for c in arrays:
            self.src[c, idx] = sid
            self.off[c, idx] = offsets
        self.refresh_ready(idx, list(arrays))

    def refresh_ready(self, idx: np.ndarray, cols: Sequence[int], *, fresh: bool = False) -> None:
        """PENDING rows among idx whose needs are now all written become READY, or CONSUMED for a
        task whose ``skip_null`` cell they wrote NULL. ``fresh``: the rows were just created with
        exactly ``cols`` written (a put), so a task's rows are all ready iff it needs nothing
        else, with no per-row check. Rows a skip leaves CONSUMED by every task are freed last,
        once no task's candidates can be moved by a compaction."""
        written = set(cols)
        skipped: list[np.ndarray] = []
        for t, need_set in enumerate(self._needs_sets):
            if need_set and written.isdisjoint(need_set):
                continue  # nothing this task waits for was written
            if fresh:
                if need_set <= written:
                    self._ready_or_skip(t, idx, skipped)
                continue
            cand = idx[self.state[t, idx] == PENDING]
            rest = [c for c in need_set if c not in written]  # needs written earlier, maybe
            if rest and len(cand):
                cand = cand[(self.src[np.ix_(rest, cand)] >= 0).all(axis=0)]
            if len(cand):
                self._ready_or_skip(t, cand, skipped)
        if skipped:
            rows = np.unique(np.concatenate(skipped))
            self.free(rows[(self.state[:, rows] == CONSUMED).all(axis=0)], consumed=True)

    def _ready_or_skip(self, t: int, idx: np.ndarray, skipped: list[np.ndarray]) -> None:
        """PENDING rows idx (every need written) -> READY, or CONSUMED where the task's
        ``skip_null`` cell is NULL (appended to ``skipped``; the caller frees)."""
        c = self.skip_col[t]
        if c >= 0:
            null = self.cells(idx, c).is_null().to_numpy(zero_copy_only=False)
            if bool(null.any()):
                skip = idx[null]
                self._transition(t, skip, CONSUMED, PENDING)
                self.consumed_total[t] += len(skip)
                skipped.append(skip)
                idx = idx[~null]
        if len(idx):
            self._make_ready(t, idx, PENDING)

    # ----------------------------------------------------------------------------- transitions
    def _transition(self, t: int, idx: np.ndarray, new: int, old: int | None = None) -> None:
        """Move rows to state ``new``; ``old`` (their common current state) when known."""
        if old is None:
            self.counts[t] -= np.bincount(self.state[t, idx], minlength=_NUM_STATES)
        else:
            self.counts[t, old] -= len(idx)
        self.counts[t, new] += len(idx)
        self.state[t, idx] = new

    def _make_ready(self, t: int, idx: np.ndarray, old: int | None = None) -> None:
        self._transition(t, idx, READY, old)
        if not self.whole[t]:
            self.queues[t].push(self.seqs[idx])
            return
        leaders = idx - self.gpos[idx]
        np.add.at(self.gready[t], leaders, 1)
        leaders = np.unique(leaders)
        full = leaders[self.gready[t, leaders] >= self.group_size]
        self.ready_groups[t] += len(full)
        self.queues[t].push(self.seqs[full])

    def ready_units(self, t: int) -> int:
        """Claimable units for task t: complete groups for a whole-group task, else rows."""
        return int(self.ready_groups[t] if self.whole[t] else self.counts[t, READY])

    def pop_ready(self, t: int, units: int) -> np.ndarray:
        """Dense indices of up to ``units`` ready units (rows, or whole groups' rows), dequeued."""
        q, got, g = self.queues[t], [], self.group_size
        need = units
        while need and q.size:
            seqs = q.pop(need)
            idx, ok = self._find(seqs)
            ok &= self.state[t, idx] == READY
            if self.whole[t]:
                ok &= self.gready[t, idx] >= g
            idx = idx[ok]
            need -= len(idx)
            got.append(idx)
        lead = np.concatenate(got) if got else np.empty(0, dtype=np.int64)
        if not self.whole[t]:
            return lead
        self.gready[t, lead] = 0
        self.ready_groups[t] -= len(lead)
        return (lead[:, None] + np.arange(g)).ravel()

    def unpop(self, t: int, idx: np.ndarray) -> None:
        """Undo ``pop_ready`` (the claim failed validation): requeue at the front."""
        if self.whole[t]:
            lead = idx[:: self.group_size]
            self.gready[t, lead] = self.group_size
            self.ready_groups[t] += len(lead)
            self.queues[t].push_front(self.seqs[lead])
        else:
            self.queues[t].push_front(self.seqs[idx])

    def lease_rows(self, t: int, idx: np.ndarray, rec: LeaseRec) -> None:
        self._transition(t, idx, LEASED, READY)
        self.deliv[t, idx] += 1
        self.lease[t, idx] = rec.lease_id
        self.leases[rec.lease_id] = rec
        rec.idx, rec.layout = idx, self.layout

    def check_written(self, idx: np.ndarray, cols: Sequence[int]) -> None:
        for c in cols:
            if not bool((self.src[c, idx] >= 0).all()):
                raise BadRequest(
                    f"column {self.columns[c]!r} is not written for every claimable row "
                    "(claim only columns the task needs or that every row has)"
                )

    def batch(
        self, idx: np.ndarray, t: int, names: Sequence[str], cols: Sequence[int],
        row_ids: np.ndarray | None = None,
    ) -> pa.RecordBatch:
        """The claimed batch: requested columns (col id -1 = created_at), row_id, deliveries."""
        if row_ids is None:
            row_ids = self.row_ids(self.seqs[idx])
        return claimed_batch(
            self.sources, self.src, self.off, self.created, idx, names, cols, row_ids,
            self.deliv[t, idx],
        )

    def cells(self, idx: np.ndarray, c: int) -> pa.Array:
        """Column ``c`` of rows idx with nulls for unwritten cells (snapshots)."""
        typ = self.spec.schema.field(c).type
        return gather_with_nulls(self.sources, c, typ, self.src[c, idx], self.off[c, idx])

    def end_lease(
        self, rec: LeaseRec, *, failed: bool, error: str | None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Hand a lease's rows back: READY again, or DEAD past max_deliveries if ``failed``.
        Returns (rows made ready again, {reason: seqs of rows made dead})."""
        self.leases.pop(rec.lease_id, None)
        t = rec.task
        idx = self.lease_idx(rec)
        self.lease[t, idx] = 0
        if not failed:
            self.deliv[t, idx] -= 1  # a clean hand-back is not a failed delivery
            self._make_ready(t, idx, LEASED)
            return len(idx), {}
        deliv = self.deliv[t, idx]
        dead = deliv >= self.spec.max_deliveries
        dead_rows: dict[str, np.ndarray] = {}
        if bool(dead.any()):
            for n in np.unique(deliv[dead]).tolist():
                text = error if error is not None else f"lease expired {n} times"
                rows = idx[dead & (deliv == n)]
                self.mark_dead(t, rows, text, LEASED)
                prev = dead_rows.get(text)
                seqs = self.seqs[rows]
                dead_rows[text] = seqs if prev is None else np.concatenate((prev, seqs))
        live = idx[~dead]
        if len(live):
            self._make_ready(t, live, LEASED)
            self.redelivered_total[t] += len(live)
        return len(live), dead_rows

    def mark_dead(self, t: int, idx: np.ndarray, reason: str, old: int | None = None) -> None:
        self._transition(t, idx, DEAD, old)
        self.lease[t, idx] = 0
        self.reason[t, idx] = self._reason_id(reason)

    def consume(self, t: int, idx: np.ndarray, old: int | None = None) -> int:
        """Rows -> CONSUMED for task t; frees rows every task consumed. Returns rows freed."""
        self._transition(t, idx, CONSUMED, old)
        self.lease[t, idx] = 0
        self.consumed_total[t] += len(idx)
        done = idx[(self.state[:, idx] == CONSUMED).all(axis=0)]
        self.free(done, consumed=True)
        return len(done)

    def free(self, idx: np.ndarray, *, consumed: bool = False) -> None:
        """Release rows' memory (their chunks once no live cell points there). ``consumed``:
        the rows are CONSUMED for every task (what ``consume`` frees), which skips a count."""
        if not len(idx):
            return
        if consumed:
            self.counts[:, CONSUMED] -= len(idx)
        else:
            for t in range(len(self.needs)):
                self.counts[t] -= np.bincount(self.state[t, idx], minlength=_NUM_STATES)
        for src in self.src[:, idx]:
            self._unref(src)
        self.src[:, idx] = -1
        self.alive[idx] = False
        self.num_alive -= len(idx)
        if self.n - self.num_alive > max(_COMPACT_MIN, self.n // 2):
            self._compact()

    def clear_dead(self) -> np.ndarray:
        """Free rows DEAD for some task and leased by none (whole groups). Returns their seqs."""
        idx = np.flatnonzero(self.alive[: self.n])
        states = self.state[:, idx]
        dead = (states == DEAD).any(axis=0)
        leased = (states == LEASED).any(axis=0)
        if self.spec.group_size:
            keys = self.seqs[idx] - self.gpos[idx]
            _, group = np.unique(keys, return_inverse=True)
            dead = np.bincount(group, weights=dead)[group] > 0
            leased = np.bincount(group, weights=leased)[group] > 0
        idx = idx[dead & ~leased]
        for t, whole in enumerate(self.whole):
            if not whole:
                continue
            ready = idx[self.state[t, idx] == READY]
            lead = np.unique(ready - self.gpos[ready])
            full = lead[self.gready[t, lead] >= self.group_size]
            self.ready_groups[t] -= len(full)
            self.gready[t, lead] = 0
        seqs = self.seqs[idx].copy()
        self.free(idx)
        return seqs

    def rebuild_queues(self) -> None:
        """Recompute ready queues and group counters from the states (after recovery); rows
        LEASED at that point come back READY, since leases do not survive a restart."""
        self.leases.clear()
        live = np.flatnonzero(self.alive[: self.n])
        for t in range(len(self.needs)):
            self.queues[t] = SeqQueue()
            self.gready[t, :] = 0
            self.ready_groups[t] = 0
            self.lease[t, :] = 0
            ready = live[np.isin(self.state[t, live], (READY, LEASED))]
            if len(ready):
                self._make_ready(t, ready)

    # ----------------------------------------------------------------------------- stats
    def stats(self) -> ShardStats:
        tasks: dict[str, TaskStats] = {}
        live = np.flatnonzero(self.alive[: self.n])
        for t, name in enumerate(self.task_names):
            c = self.counts[t]
            reasons: dict[str, int] = {}
            if c[DEAD]:
                r = self.reason[t, live][self.state[t, live] == DEAD]
                for rid, k in zip(*np.unique(r, return_counts=True), strict=True):
                    reasons[self.reasons[int(rid)]] = int(k)
            pending, ready, in_flight, dead = (int(c[k]) for k in (PENDING, READY, LEASED, DEAD))
            consumed, again = int(self.consumed_total[t]), int(self.redelivered_total[t])
            tasks[name] = TaskStats(pending, ready, in_flight, consumed, dead, again, reasons)
        return ShardStats(self.shard_id, self.num_alive, self.bytes, tasks)
