"""Hypothesis state machine: StoreNode against a plain-Python model of the per-(row, task) states.

Invariants: no row is in two live leases of one task; every row is acked at most once per task;
expiry makes rows claimable again (or DEAD past max_deliveries, with a reason, in stats); grouped
claims never split a group; write-once cells; fencing; capacity; memory freed once all consumed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.errors import CellAlreadyWritten, LeaseExpired, StoreFull, UnknownLease
from storage.node import StoreNode
from storage.schema import TableSpec, TaskSpec

G = 2  # group size
CAP = 24  # capacity in rows
LEASE_S = 10.0
MAX_DELIV = 2
SCHEMA = pa.schema([("gid", pa.int64()), ("x", pa.int32()), ("y", pa.float32())])
TASKS = {"a": ("x",), "b": ("x", "y")}  # b is whole-group


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Row:
    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.y = False
        self.state = {"a": "ready", "b": "pending"}
        self.deliv = {"a": 0, "b": 0}
        self.acks = {"a": 0, "b": 0}


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.node = StoreNode(0, 2, clock=self.clock)
        self.node.create_table(
            TableSpec(
                "t",
                SCHEMA,
                (TaskSpec("a", TASKS["a"]), TaskSpec("b", TASKS["b"], whole_groups=True)),
                group_column="gid",
                group_size=G,
                capacity_rows=CAP,
                lease_seconds=LEASE_S,
                max_deliveries=MAX_DELIV,
            )
        )
        self.rows: dict[int, Row] = {}
        self.leases: dict[int, tuple[str, list[int], float]] = {}
        self.expired: list[int] = []
        self.next_gid = 0
        self.consumed = {"a": 0, "b": 0}

    # -------------------------------------------------------------------------- model helpers
    def _ready(self, task: str) -> list[int]:
        return [r for r, row in self.rows.items() if row.state[task] == "ready"]

    def _ready_b_groups(self) -> int:
        by_gid: dict[int, int] = {}
        for row in self.rows.values():
            if row.state["b"] == "ready":
                by_gid[row.gid] = by_gid.get(row.gid, 0) + 1
        return sum(1 for n in by_gid.values() if n == G)

    def _free_consumed(self) -> None:
        for r in [
            r for r, row in self.rows.items() if all(s == "consumed" for s in row.state.values())
        ]:
            del self.rows[r]

    def _end(self, lease_id: int, failed: bool) -> None:
        task, rids, _ = self.leases.pop(lease_id)
        for r in rids:
            row = self.rows[r]
            if not failed:
                row.deliv[task] -= 1
                row.state[task] = "ready"
            elif row.deliv[task] >= MAX_DELIV:
                row.state[task] = "dead"
            else:
                row.state[task] = "ready"

    # -------------------------------------------------------------------------- rules
    @rule(groups=st.integers(1, 3), shuffle=st.randoms())
    def put(self, groups: int, shuffle) -> None:
        gids = [self.next_gid + i for i in range(groups) for _ in range(G)]
        shuffle.shuffle(gids)
        batch = pa.RecordBatch.from_pydict(
            {"gid": pa.array(gids, pa.int64()), "x": pa.array(range(len(gids)), pa.int32())}
        )
        if len(self.rows) + len(gids) > CAP:
            try:
                self.node.put("t", batch)
            except StoreFull:
                return
            raise AssertionError("put beyond capacity was accepted")
        self.next_gid += groups
        ids = self.node.put("t", batch).tolist()
        for r, gid in zip(ids, gids, strict=True):
            assert r not in self.rows
            self.rows[r] = Row(gid)

    @precondition(lambda self: any(not row.y for row in self.rows.values()))
    @rule(data=st.data())
    def write_y(self, data) -> None:
        todo = sorted(r for r, row in self.rows.items() if not row.y)
        pick = data.draw(st.lists(st.sampled_from(todo), min_size=1, max_size=4, unique=True))
        self.node.write("t", self._y(pick))
        for r in pick:
            row = self.rows[r]
            row.y = True
            if row.state["b"] == "pending":
                row.state["b"] = "ready"

    @precondition(lambda self: any(row.y for row in self.rows.values()))
    @rule(data=st.data())
    def write_y_twice_is_refused(self, data) -> None:
        done = sorted(r for r, row in self.rows.items() if row.y)
        r = data.draw(st.sampled_from(done))
        try:
            self.node.write("t", self._y([r]))
        except CellAlreadyWritten:
            return
        raise AssertionError("a cell was written twice")

    @staticmethod
    def _y(rids: list[int]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {"row_id": pa.array(rids, pa.uint64()), "y": pa.array([1.0] * len(rids), pa.float32())}
        )

    @rule(task=st.sampled_from(["a", "b"]), max_rows=st.integers(2, 9), min_rows=st.integers(1, 4))
    def claim(self, task: str, max_rows: int, min_rows: int) -> None:
        min_rows = min(min_rows, max_rows)
        cols = ["gid", "x"] + (["y"] if task == "b" else [])
        lease = self.node.claim("t", task, cols, max_rows, min_rows=min_rows)
        if lease is None:
            return
        rids = lease.row_ids
        assert min_rows <= len(rids) <= max_rows
        held = {r for t, rs, _ in self.leases.values() if t == task for r in rs}
        assert not held.intersection(rids), "row handed to two live leases of one task"
        for r, d, gid in zip(
            rids, lease.batch["deliveries"].to_pylist(), lease.batch["gid"].to_pylist(), strict=True
        ):
            row = self.rows[r]
            assert row.state[task] == "ready" and row.gid == gid
            row.state[task] = "leased"
            row.deliv[task] += 1
            assert d == row.deliv[task]
        if task == "b":
            gids = lease.batch["gid"].to_pylist()
            assert all(gids.count(g) == G for g in gids), f"group split: {gids}"
        self.leases[lease.lease_id] = (task, rids, lease.deadline)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), with_write=st.booleans())
    def ack(self, data, with_write: bool) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        task, rids, _ = self.leases.pop(lease_id)
        todo = [r for r in rids if not self.rows[r].y]
        if with_write and task == "a" and todo:
            self.node.write("t", self._y(todo), lease_id=lease_id, ack=True)
            for r in todo:
                self.rows[r].y = True
                if self.rows[r].state["b"] == "pending":
                    self.rows[r].state["b"] = "ready"
        else:
            self.node.ack("t", lease_id)
        for r in rids:
            row = self.rows[r]
            row.acks[task] += 1
            assert row.acks[task] == 1, "row acked twice by one task"
            row.state[task] = "consumed"
        self.consumed[task] += len(rids)
        self._free_consumed()

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), error=st.sampled_from([None, "boom"]))
    def release(self, data, error: str | None) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        self.node.release("t", lease_id, error=error)
        self._end(lease_id, failed=error is not None)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def extend(self, data) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        task, rids, _ = self.leases[lease_id]
        self.leases[lease_id] = (task, rids, self.node.extend("t", lease_id))

    @rule(dt=st.sampled_from([11.0, 0.0, 6.0, 11.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt
        due = sorted(lid for lid, (_, _, d) in self.leases.items() if d <= self.clock.now)
        assert self.node.expire() == len(due)
        for lid in due:
            self._end(lid, failed=True)
            self.expired.append(lid)

    @precondition(lambda self: self.expired)
    @rule(data=st.data())
    def zombie_is_fenced(self, data) -> None:
        lease_id = data.draw(st.sampled_from(self.expired))
        for verb in (lambda: self.node.ack("t", lease_id), lambda: self.node.extend("t", lease_id)):
            try:
                verb()
            except LeaseExpired as e:
                assert not isinstance(e, UnknownLease)
                continue
            raise AssertionError("an expired lease was accepted")

    @rule()
    def unknown_lease(self) -> None:
        try:
            self.node.ack("t", 7)
        except UnknownLease:
            return
        raise AssertionError("unknown lease accepted")

    @rule()
    def clear_dead(self) -> None:
        groups: dict[int, list[int]] = {}
        for r, row in self.rows.items():
            groups.setdefault(row.gid, []).append(r)
        freed = 0
        for rids in groups.values():
            states = [s for r in rids for s in self.rows[r].state.values()]
            if "dead" in states and "leased" not in states:
                for r in rids:
                    del self.rows[r]
                freed += len(rids)
        assert self.node.clear("t", dead=True) == freed

    # -------------------------------------------------------------------------- invariants
    @invariant()
    def stats_match_model(self) -> None:
        stats = self.node.stats("t")
        assert sum(s.rows for s in stats.shards) == len(self.rows)
        for task in TASKS:
            total = stats.task_total(task)
            states = [row.state[task] for row in self.rows.values()]
            assert total.pending == states.count("pending")
            assert total.ready == states.count("ready")
            assert total.in_flight == states.count("leased")
            assert total.dead == states.count("dead") == sum(total.dead_reasons.values())
            assert total.consumed == self.consumed[task]
        assert self.node.ready_count("t", "a") == len(self._ready("a"))
        assert self.node.ready_count("t", "b") == G * self._ready_b_groups()
        if not self.rows:
            assert self.node.memory_bytes() == 0


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_model_rows_match_numpy_dtype() -> None:
    # The machine above relies on row ids round-tripping through Python ints.
    ids = np.array([1 << 60], dtype=np.uint64)
    assert int(pa.array(ids).to_pylist()[0]) == 1 << 60
