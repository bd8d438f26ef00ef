"""``TaskSpec.skip_null``: a row whose named needed cell is written NULL is consumed for that task
without a claim, freed once every task is done with it, and recovered the same way from the log."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.errors import BadRequest
from storage.node import StoreNode
from storage.schema import TableSpec, TaskSpec
from storage.wire import spec_from_wire, spec_to_wire

I32L = pa.list_(pa.int32())
SCHEMA = pa.schema([("x", pa.int64()), ("y", I32L)])
TASKS = (TaskSpec("first", ("x",)), TaskSpec("later", ("y",), skip_null="y"))


def spec(tasks: tuple[TaskSpec, ...] = TASKS, **kw) -> TableSpec:
    return TableSpec("t", SCHEMA, tasks, capacity_rows=10**6, **kw)


def ys(ids: list[int], values: list[list[int] | None]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"row_id": pa.array(ids, pa.uint64()),
                                       "y": pa.array(values, I32L)})


def later_stats(node: StoreNode):
    return node.stats("t").task_total("later")


def test_null_rows_are_consumed_without_a_claim_and_freed_after_the_last_task() -> None:
    node = StoreNode(0, 1)
    node.create_table(spec())
    node.put("t", pa.RecordBatch.from_pydict({"x": pa.array([0, 1, 2, 3])}))
    lease = node.claim("t", "first", ["x"], 4)
    ids = lease.row_ids
    node.write("t", ys(ids, [[1], None, [3], None]), lease_id=lease.lease_id)
    # a skipped row is CONSUMED for "later" at once; not freed while "first" still leases it
    st = later_stats(node)
    assert (st.ready, st.consumed, st.pending) == (2, 2, 0)
    assert node.stats("t").shards[0].rows == 4
    node.ack("t", lease.lease_id)
    assert node.stats("t").shards[0].rows == 2  # the NULL rows: every task done, freed
    got = node.claim("t", "later", ["y"], 10)
    assert sorted(got.row_ids) == sorted([ids[0], ids[2]])  # never the NULL rows
    assert sorted(got.batch.column("y").to_pylist()) == [[1], [3]]
    node.ack("t", got.lease_id)
    assert node.memory_bytes() == 0


def test_an_empty_list_is_work_only_null_skips() -> None:
    """Breaks if the store skipped on an empty (written, not NULL) cell."""
    node = StoreNode(0, 1)
    node.create_table(spec())
    ids = node.put("t", pa.RecordBatch.from_pydict({"x": pa.array([0, 1])}))
    node.write("t", ys(ids.tolist(), [[], None]))
    st = later_stats(node)
    assert (st.ready, st.consumed) == (1, 1)
    assert node.claim("t", "later", ["y"], 10).batch.column("y").to_pylist() == [[]]


def test_rows_freed_by_a_put_compact_without_moving_the_rest() -> None:
    """Puts whose rows are all skipped free them inside the put, compaction included; the
    kept rows keep their cells (breaks if freeing ran while a task's candidates were in use)."""
    node = StoreNode(0, 1)
    node.create_table(spec((TaskSpec("later", ("y",), skip_null="y"),)))
    shard = node._tables["t"].shards[0]
    kept = []
    for i in range(12):
        y = [None] * 999 + [[i]]
        ids = node.put("t", pa.RecordBatch.from_pydict({"x": pa.array(np.arange(1000)),
                                                        "y": pa.array(y, I32L)}))
        kept.append(int(ids[-1]))
    assert shard.layout > 0 and shard.num_alive == 12
    lease = node.claim("t", "later", ["y"], 100)
    by_id = dict(zip(lease.row_ids, lease.batch.column("y").to_pylist(), strict=True))
    assert by_id == {rid: [i] for i, rid in enumerate(kept)}


def test_skips_replay_from_the_log(tmp_path) -> None:
    node = StoreNode(0, 1, persist_root=str(tmp_path))
    node.create_table(spec(fsync="always"))
    ids = node.put("t", pa.RecordBatch.from_pydict({"x": pa.array([0, 1, 2])})).tolist()
    node.write("t", ys(ids, [None, [5], None]))
    node.sync()
    node.close()
    again = StoreNode(0, 1, persist_root=str(tmp_path))  # recovers "t" from its files
    st = later_stats(again)
    assert (st.ready, st.consumed) == (1, 2)
    assert again.claim("t", "later", ["y"], 10).row_ids == [ids[1]]
    assert again._tables["t"].spec.tasks[1].skip_null == "y"
    again.close()


def test_bad_skip_null_is_refused_and_the_spec_travels() -> None:
    node = StoreNode(0, 1)
    with pytest.raises(BadRequest, match=r"tasks\[later\]\.skip_null: 'x' is not one of its needs"):
        node.create_table(spec((TaskSpec("later", ("y",), skip_null="x"),)))
    grouped = TableSpec("g", pa.schema([("g", pa.int64()), ("y", I32L)]),
                        (TaskSpec("w", ("y",), whole_groups=True, skip_null="y"),),
                        group_column="g", group_size=2)
    with pytest.raises(BadRequest, match=r"tasks\[w\]\.skip_null: not with whole_groups"):
        node.create_table(grouped)
    assert spec_from_wire(spec_to_wire(spec())).tasks == TASKS
