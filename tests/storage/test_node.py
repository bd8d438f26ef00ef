"""StoreNode verbs: put/claim/write/ack/extend/release/expire, fencing, capacity, groups, errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.errors import (
    BadRequest,
    CellAlreadyWritten,
    LeaseExpired,
    SchemaMismatch,
    StoreFull,
    TableExists,
    UnknownLease,
    UnknownRows,
    UnknownTable,
    UnknownTask,
)
from storage.node import StoreNode
from storage.schema import TableSpec, TaskSpec, shard_of

I32L = pa.list_(pa.int32())
SCHEMA = pa.schema(
    [("prompt", I32L), ("gid", pa.int64()), ("response", I32L), ("reward", pa.float32())]
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(**kw) -> TableSpec:
    base = dict(
        name="t",
        schema=SCHEMA,
        tasks=(
            TaskSpec("rollout", ("prompt",)),
            TaskSpec("reward", ("response",)),
            TaskSpec("train", ("response", "reward")),
        ),
        lease_seconds=10.0,
        max_deliveries=3,
    )
    base.update(kw)
    return TableSpec(**base)


def prompts(n: int, start: int = 0, gids: list[int] | None = None) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "prompt": pa.array([[i, i] for i in range(start, start + n)], I32L),
            "gid": pa.array(
                gids if gids is not None else list(range(start, start + n)), pa.int64()
            ),
        }
    )


def responses(row_ids: pa.Array | np.ndarray) -> pa.RecordBatch:
    ids = pa.array(np.asarray(row_ids, dtype=np.uint64))
    return pa.RecordBatch.from_pydict(
        {"row_id": ids, "response": pa.array([[int(r) % 97] * 3 for r in ids.to_pylist()], I32L)}
    )


def rewards(row_ids: pa.Array | np.ndarray) -> pa.RecordBatch:
    ids = pa.array(np.asarray(row_ids, dtype=np.uint64))
    return pa.RecordBatch.from_pydict(
        {"row_id": ids, "reward": pa.array([1.0] * len(ids), pa.float32())}
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def node(clock: Clock) -> StoreNode:
    n = StoreNode(0, 2, clock=clock)
    n.create_table(spec())
    return n


def run_pipeline(node: StoreNode, n: int) -> None:
    node.put("t", prompts(n))
    while (lease := node.claim("t", "rollout", ["prompt"], 7)) is not None:
        node.write("t", responses(lease.batch["row_id"]), lease_id=lease.lease_id, ack=True)
    while (lease := node.claim("t", "reward", ["response"], 5)) is not None:
        node.write("t", rewards(lease.batch["row_id"]), lease_id=lease.lease_id, ack=True)


def test_full_pipeline_each_task_sees_every_row_once_and_memory_is_freed(node: StoreNode) -> None:
    ids = node.put("t", prompts(20))
    assert ids.dtype == np.uint64 and len(set(ids.tolist())) == 20
    assert node.memory_bytes() > 0
    seen = {"rollout": [], "reward": [], "train": []}
    while (lease := node.claim("t", "rollout", ["prompt"], 6)) is not None:
        seen["rollout"] += lease.row_ids
        assert lease.batch.column("deliveries").to_pylist() == [1] * lease.num_rows
        node.write("t", responses(lease.batch["row_id"]), lease_id=lease.lease_id, ack=True)
    while (lease := node.claim("t", "reward", ["response"], 8)) is not None:
        seen["reward"] += lease.row_ids
        node.write("t", rewards(lease.batch["row_id"]), lease_id=lease.lease_id, ack=True)
    while (lease := node.claim("t", "train", ["prompt", "response", "reward"], 9)) is not None:
        seen["train"] += lease.row_ids
        assert lease.batch.schema.names == ["prompt", "response", "reward", "row_id", "deliveries"]
        # cells come back attached to the right rows
        rid = lease.batch["row_id"].to_pylist()
        assert lease.batch["response"].to_pylist() == [[r % 97] * 3 for r in rid]
        node.ack("t", lease.lease_id)
    for task, rows in seen.items():
        assert sorted(rows) == sorted(ids.tolist()), task
    stats = node.stats("t")
    assert stats.task_total("train").consumed == 20
    assert sum(s.rows for s in stats.shards) == 0
    assert node.memory_bytes() == 0


def test_put_goes_to_shallowest_shard_and_lease_rows_come_from_one_shard(node: StoreNode) -> None:
    a = node.put("t", prompts(5))
    b = node.put("t", prompts(3, start=5))
    assert {shard_of(int(r)) for r in a} != {shard_of(int(r)) for r in b}
    lease = node.claim("t", "rollout", ["prompt"], 100)
    assert lease.num_rows == 5 and {shard_of(r) for r in lease.row_ids} == {lease.shard_id}
    lease2 = node.claim("t", "rollout", ["prompt"], 100, shards=[shard_of(int(b[0]))])
    assert sorted(lease2.row_ids) == sorted(b.tolist())


def test_min_rows_and_ready_count(node: StoreNode) -> None:
    node.put("t", prompts(3))
    assert node.ready_count("t", "rollout") == 3
    assert node.claim("t", "rollout", ["prompt"], 10, min_rows=4) is None
    assert node.ready_count("t", "rollout") == 3  # a refused claim takes nothing
    assert node.claim("t", "rollout", ["prompt"], 10, min_rows=3).num_rows == 3
    assert node.ready_count("t", "rollout") == 0


def test_expiry_redelivers_then_quarantines(node: StoreNode, clock: Clock) -> None:
    node.put("t", prompts(4))
    for delivery in (1, 2, 3):
        lease = node.claim("t", "rollout", ["prompt"], 10)
        assert lease.batch["deliveries"].to_pylist() == [delivery] * 4
        assert node.next_deadline() == lease.deadline
        clock.now = lease.deadline
        assert node.expire() == 1
    total = node.stats("t").task_total("rollout")
    assert total.dead == 4 and total.ready == 0
    assert total.redelivered_total == 8
    assert total.dead_reasons == {"lease expired 3 times": 4}
    assert node.claim("t", "rollout", ["prompt"], 10) is None
    assert node.clear("t", dead=True) == 4
    assert node.stats("t").task_total("rollout").dead == 0 and node.memory_bytes() == 0


def test_fencing_expired_and_unknown_leases(node: StoreNode, clock: Clock) -> None:
    node.put("t", prompts(2))
    zombie = node.claim("t", "rollout", ["prompt"], 10)
    clock.now += 11  # past the deadline; expire() not called yet: fencing still applies
    with pytest.raises(LeaseExpired):
        node.write("t", responses(zombie.batch["row_id"]), lease_id=zombie.lease_id)
    successor = node.claim("t", "rollout", ["prompt"], 10)
    assert sorted(successor.row_ids) == sorted(zombie.row_ids)
    node.write("t", responses(successor.batch["row_id"]), lease_id=successor.lease_id)
    for verb in (lambda: node.ack("t", zombie.lease_id), lambda: node.extend("t", zombie.lease_id)):
        with pytest.raises(LeaseExpired):
            verb()
    with pytest.raises(UnknownLease):
        node.ack("t", 12345)
    node.ack("t", successor.lease_id)
    with pytest.raises(UnknownLease):
        node.ack("t", successor.lease_id)  # already acked
    other = StoreNode(0, 2, clock=clock)  # a restarted node does not know old leases
    other.create_table(spec())
    with pytest.raises(UnknownLease):
        other.ack("t", successor.lease_id)


def test_extend_keeps_lease_alive(node: StoreNode, clock: Clock) -> None:
    node.put("t", prompts(2))
    lease = node.claim("t", "rollout", ["prompt"], 10, lease_seconds=5)
    clock.now += 4
    deadline = node.extend("t", lease.lease_id, 5)
    assert deadline == clock.now + 5
    clock.now += 4
    assert node.expire() == 0
    node.ack("t", lease.lease_id)
    assert node.stats("t").task_total("rollout").redelivered_total == 0


def test_release_clean_and_with_error(node: StoreNode) -> None:
    node.put("t", prompts(2))
    lease = node.claim("t", "rollout", ["prompt"], 10)
    node.release("t", lease.lease_id)
    again = node.claim("t", "rollout", ["prompt"], 10)
    assert again.batch["deliveries"].to_pylist() == [1, 1]  # a clean release is no failure
    node.release("t", again.lease_id, error="boom")
    third = node.claim("t", "rollout", ["prompt"], 10)
    assert third.batch["deliveries"].to_pylist() == [2, 2]
    node.release("t", third.lease_id, error="boom")
    fourth = node.claim("t", "rollout", ["prompt"], 10)
    node.release("t", fourth.lease_id, error="tokenizer crashed")
    total = node.stats("t").task_total("rollout")
    assert total.dead == 2 and total.dead_reasons == {"tokenizer crashed": 2}


def test_write_once_cells_and_admin_overwrite(node: StoreNode) -> None:
    ids = node.put("t", prompts(2))
    node.write("t", responses(ids))
    with pytest.raises(CellAlreadyWritten, match="response"):
        node.write("t", responses(ids))
    node.write("t", responses(ids[:1]), overwrite=True)
    with pytest.raises(UnknownRows):
        node.write("t", responses(np.array([ids[0] + 1000], dtype=np.uint64)))


def test_write_is_all_or_nothing(node: StoreNode) -> None:
    ids = node.put("t", prompts(3))
    node.write("t", responses(ids[1:2]))
    with pytest.raises(CellAlreadyWritten):
        node.write("t", responses(ids))  # row 0 writable, row 1 not: nothing written
    assert node.stats("t").task_total("reward").ready == 1


def test_write_outside_lease_is_refused(node: StoreNode) -> None:
    a = node.put("t", prompts(2))
    lease = node.claim("t", "rollout", ["prompt"], 1)
    other = [r for r in a.tolist() if r not in lease.row_ids]
    with pytest.raises(BadRequest, match="not part of lease"):
        node.write("t", responses(np.array(other, np.uint64)), lease_id=lease.lease_id)


def test_capacity_rows_and_bytes_and_freeing(clock: Clock) -> None:
    node = StoreNode(0, 1, clock=clock)
    node.create_table(spec(capacity_rows=10))
    node.put("t", prompts(8))
    assert not node.has_capacity("t", 3, 0)
    with pytest.raises(StoreFull):
        node.put("t", prompts(3))
    with pytest.raises(BadRequest, match="never fit"):
        node.put("t", prompts(11))
    run_pipeline(node, 0)
    while (lease := node.claim("t", "train", ["reward"], 100)) is not None:
        node.ack("t", lease.lease_id)
    assert node.has_capacity("t", 10, 0)
    node.put("t", prompts(10))
    small = StoreNode(0, 1, clock=clock)
    small.create_table(spec(capacity_bytes=150))
    small.put("t", prompts(4))
    with pytest.raises(StoreFull):
        small.put("t", prompts(4))


def test_memory_freed_by_whole_chunks(clock: Clock) -> None:
    node = StoreNode(0, 1, clock=clock)
    node.create_table(spec(tasks=(TaskSpec("only", ("prompt",)),)))
    node.put("t", prompts(4))
    node.put("t", prompts(4, start=4))
    full = node.memory_bytes()
    lease = node.claim("t", "only", ["prompt"], 6)  # first chunk + half the second
    node.ack("t", lease.lease_id)
    assert 0 < node.memory_bytes() < full  # first chunk freed, second still held
    lease = node.claim("t", "only", ["prompt"], 6)
    node.ack("t", lease.lease_id)
    assert node.memory_bytes() == 0


def test_schema_errors_name_the_column(node: StoreNode) -> None:
    bad_type = pa.RecordBatch.from_pydict({"prompt": pa.array([[1]], pa.list_(pa.int64()))})
    with pytest.raises(SchemaMismatch, match="prompt.*int32.*int64"):
        node.put("t", bad_type)
    with pytest.raises(SchemaMismatch, match="nope"):
        node.put("t", pa.RecordBatch.from_pydict({"nope": [1]}))
    with pytest.raises(SchemaMismatch, match="row_id"):
        node.put("t", pa.RecordBatch.from_pydict({"row_id": pa.array([1], pa.uint64())}))
    with pytest.raises(SchemaMismatch, match="row_id"):
        node.write(
            "t",
            pa.RecordBatch.from_pydict({"row_id": [1], "reward": pa.array([1.0], pa.float32())}),
        )
    with pytest.raises(BadRequest, match="row_id"):
        node.write("t", pa.RecordBatch.from_pydict({"reward": pa.array([1.0], pa.float32())}))
    with pytest.raises(BadRequest, match="columns.*nope"):
        node.put("t", prompts(1))
        node.claim("t", "rollout", ["nope"], 1)
    with pytest.raises(BadRequest, match="reward"):
        node.claim("t", "rollout", ["reward"], 1)  # not needed and not written
    assert node.claim("t", "rollout", ["prompt", "gid", "created_at"], 1).num_rows == 1


def test_invalid_arrow_is_a_bad_request(node: StoreNode) -> None:
    values = pa.array([1, 2], pa.int32())
    offsets = pa.py_buffer(np.array([0, 2, 1, 2], dtype=np.int32).tobytes())  # non-monotonic
    broken = pa.ListArray.from_buffers(I32L, 3, [None, offsets], children=[values])
    with pytest.raises(BadRequest, match="invalid Arrow"):
        node.put("t", pa.RecordBatch.from_arrays([broken], names=["prompt"]))


def test_table_admin(node: StoreNode) -> None:
    node.create_table(spec())  # idempotent
    with pytest.raises(TableExists):
        node.create_table(spec(capacity_rows=5))
    assert node.table_names() == ["t"] and node.table_spec("t") == spec()
    with pytest.raises(UnknownTask):
        node.claim("t", "nope", ["prompt"], 1)
    node.drop_table("t")
    with pytest.raises(UnknownTable):
        node.put("t", prompts(1))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"name": "../x"}, "name"),
        ({"tasks": ()}, "tasks"),
        ({"tasks": (TaskSpec("a", ("zzz",)),)}, "needs"),
        ({"group_column": "gid"}, "group_size"),
        ({"group_column": "prompt", "group_size": 2}, "group_column"),
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"lease_seconds": float("nan")}, "lease_seconds"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"tasks": (TaskSpec("a", ("prompt",), whole_groups=True),)}, "whole_groups"),
    ],
)
def test_bad_specs_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        StoreNode().create_table(spec(**kw))


def test_claim_argument_errors(node: StoreNode) -> None:
    for kwargs in (
        {"max_rows": 0},
        {"max_rows": 2, "min_rows": 3},
        {"max_rows": 2, "lease_seconds": -1},
    ):
        with pytest.raises(BadRequest):
            node.claim("t", "rollout", ["prompt"], **kwargs)
    with pytest.raises(BadRequest, match="whole_groups"):
        node.claim("t", "rollout", ["prompt"], 2, whole_groups=True)
    with pytest.raises(BadRequest, match="shards"):
        node.claim("t", "rollout", ["prompt"], 2, shards=[99])


# ------------------------------------------------------------------------------------ groups
def grouped(clock: Clock, **kw) -> StoreNode:
    node = StoreNode(0, 1, clock=clock)
    node.create_table(
        spec(
            group_column="gid",
            group_size=3,
            tasks=(
                TaskSpec("reward", ("response",)),
                TaskSpec("train", ("reward",), whole_groups=True),
            ),
            **kw,
        )
    )
    return node


def test_grouped_put_validates_and_claims_never_split_groups(clock: Clock) -> None:
    node = grouped(clock)
    with pytest.raises(BadRequest, match="whole groups"):
        node.put("t", prompts(4, gids=[1, 1, 1, 2]))
    for gids in ([1, 1, 2, 2, 2, 2], [4, 4, 4, 4, 4, 4]):
        with pytest.raises(BadRequest, match="exactly 3"):
            node.put("t", prompts(6, gids=gids))
    ids = node.put("t", prompts(6, gids=[5, 9, 5, 9, 9, 5]))  # interleaved groups
    node.write("t", responses(ids))
    lease = node.claim("t", "reward", ["response"], 6)
    node.write("t", rewards(ids[[0, 1, 3]]), lease_id=lease.lease_id)  # g5 has 1 row, g9 2 rows
    assert node.ready_count("t", "train") == 0
    assert node.claim("t", "train", ["gid"], 6) is None
    node.write("t", rewards(ids[[4]]), lease_id=lease.lease_id)  # g9 complete
    assert node.ready_count("t", "train") == 3
    with pytest.raises(BadRequest, match="one group"):
        node.claim("t", "train", ["gid"], 2)
    got = node.claim("t", "train", ["gid"], 5, whole_groups=True)
    assert got.batch["gid"].to_pylist() == [9, 9, 9]
    node.write("t", rewards(ids[[2, 5]]), lease_id=lease.lease_id, ack=True)
    second = node.claim("t", "train", ["gid", "prompt"], 100)
    assert second.batch["gid"].to_pylist() == [5, 5, 5]
    # each row keeps its own cells after the reorder
    rid = {r: i for i, r in enumerate(ids.tolist())}
    assert [p[0] for p in second.batch["prompt"].to_pylist()] == [rid[r] for r in second.row_ids]


def test_grouped_expiry_redelivers_whole_group(clock: Clock) -> None:
    node = grouped(clock, max_deliveries=2)
    ids = node.put("t", prompts(6, gids=[1, 1, 1, 2, 2, 2]))
    node.write("t", responses(ids))
    node.write("t", rewards(ids))
    a = node.claim("t", "train", ["gid"], 3)
    clock.now = a.deadline
    node.expire()
    assert node.ready_count("t", "train") == 6
    b = node.claim("t", "train", ["gid"], 6)
    assert b.num_rows == 6 and sorted(b.batch["deliveries"].to_pylist()) == [1, 1, 1, 2, 2, 2]
    clock.now = b.deadline
    node.expire()
    total = node.stats("t").task_total("train")
    assert total.dead == 3 and total.ready == 3
    assert node.clear("t", dead=True) == 3
    assert node.ready_count("t", "train") == 3
