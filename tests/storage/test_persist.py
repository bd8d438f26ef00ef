"""Persistence: log + snapshot recovery, crash without close, torn tails, corrupt records."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os

import numpy as np
import pyarrow as pa
import pytest

from storage.errors import BadRequest, TableExists
from storage.node import StoreNode
from storage.schema import TableSpec, TaskSpec

I32L = pa.list_(pa.int32())
SCHEMA = pa.schema([("prompt", I32L), ("response", I32L), ("reward", pa.float32())])


def spec(path: str, **kw) -> TableSpec:  # path: the node's root (kept for the call sites)
    return TableSpec(
        name="t",
        schema=SCHEMA,
        tasks=(TaskSpec("reward", ("response",)), TaskSpec("train", ("response", "reward"))),
        fsync="always",
        max_deliveries=2,
        **kw,
    )


def open_node(path: str, num_shards: int = 2, **kw) -> StoreNode:
    node = StoreNode(0, num_shards, persist_root=path)
    node.create_table(spec(path, **kw))
    return node


def put(node: StoreNode, n: int, start: int = 0) -> np.ndarray:
    batch = pa.RecordBatch.from_pydict(
        {"prompt": pa.array([[i] * 3 for i in range(start, start + n)], I32L)}
    )
    ids = node.put("t", batch)
    node.sync()
    return ids


def write(node: StoreNode, ids: np.ndarray, column: str) -> None:
    if column == "response":
        values = pa.array([[int(r) % 1000, 7] for r in ids], I32L)
    else:
        values = pa.array([float(int(r) % 1000) for r in ids], pa.float32())
    node.write(
        "t", pa.RecordBatch.from_pydict({"row_id": pa.array(ids, pa.uint64()), column: values})
    )
    node.sync()


def drain(node: StoreNode, task: str, columns: list[str]) -> dict[int, dict]:
    out, leases = {}, []
    while (lease := node.claim("t", task, columns, 7)) is not None:
        for row in lease.batch.to_pylist():
            out[row["row_id"]] = row
        leases.append(lease.lease_id)
    for lease_id in leases:
        node.release("t", lease_id)  # clean hand-back: state unchanged for the next look
    return out


def state(node: StoreNode) -> tuple:
    stats = node.stats("t")
    per_task = {t: stats.task_total(t) for t in ("reward", "train")}
    return (
        drain(node, "reward", ["prompt", "response"]),
        drain(node, "train", ["prompt", "response", "reward"]),
        {t: (s.pending, s.ready, s.consumed, s.dead, s.dead_reasons) for t, s in per_task.items()},
        sum(s.rows for s in stats.shards),
    )


def build(node: StoreNode) -> None:
    ids = np.concatenate([put(node, 10), put(node, 6, start=10)])
    write(node, ids[:12], "response")
    write(node, ids[:5], "reward")
    lease = node.claim("t", "reward", ["response"], 4)
    node.ack("t", lease.lease_id)
    node.sync()
    lease = node.claim("t", "train", ["reward"], 3)
    node.ack("t", lease.lease_id)
    node.sync()


def test_crash_without_close_recovers_everything(tmp_path) -> None:
    node = open_node(str(tmp_path))
    build(node)
    before = state(node)
    assert before[3] > 0 and before[2]["train"][2] == 3
    del node  # no close(): a crashed process
    again = open_node(str(tmp_path))
    assert state(again) == before
    again.close()


def test_leased_rows_come_back_ready_with_delivery_counts(tmp_path) -> None:
    node = open_node(str(tmp_path))
    ids = put(node, 4)
    write(node, ids, "response")
    lease = node.claim("t", "reward", ["response"], 4)
    assert lease.batch["deliveries"].to_pylist() == [1] * 4
    node.sync()
    again = open_node(str(tmp_path))
    relet = again.claim("t", "reward", ["response"], 10)
    assert sorted(relet.row_ids) == sorted(ids.tolist())
    assert relet.batch["deliveries"].to_pylist() == [2] * 4


def test_snapshot_then_more_log_then_recover(tmp_path) -> None:
    node = open_node(str(tmp_path))
    build(node)
    path = node.snapshot("t")
    assert os.path.isdir(path) and glob.glob(os.path.join(path, "shard-*.snap"))
    ids = put(node, 5, start=100)
    write(node, ids, "response")
    lease = node.claim("t", "reward", ["response"], 2)
    node.ack("t", lease.lease_id)
    node.sync()
    before = state(node)
    again = open_node(str(tmp_path))
    assert state(again) == before
    # recovery compacted everything into a snapshot; a second restart sees the same
    assert state(open_node(str(tmp_path))) == before


def test_dead_rows_survive_with_reason(tmp_path) -> None:
    clock = [0.0]
    node = StoreNode(0, 1, clock=lambda: clock[0], persist_root=str(tmp_path))
    node.create_table(spec(str(tmp_path)))
    write(node, put(node, 3), "response")
    for _ in range(2):
        lease = node.claim("t", "reward", ["response"], 10)
        clock[0] = lease.deadline
        node.expire()
    node.sync()
    again = open_node(str(tmp_path), num_shards=1)
    total = again.stats("t").task_total("reward")
    assert total.dead == 3 and total.dead_reasons == {"lease expired 2 times": 3}


def _logs(path: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(path, "t", "*.log")) if os.path.getsize(p))


def test_torn_tail_recovers_the_prefix(tmp_path) -> None:
    node = open_node(str(tmp_path), num_shards=1)
    first = put(node, 3)
    put(node, 4, start=3)
    (log,) = _logs(str(tmp_path))
    os.truncate(log, os.path.getsize(log) - 10)  # the second put's record is torn
    again = open_node(str(tmp_path), num_shards=1)
    assert again.stats("t").shards[0].rows == 3
    write(again, first, "response")
    got = drain(again, "reward", ["prompt"])
    assert sorted(got) == sorted(first.tolist())
    assert [got[r]["prompt"][0] for r in first.tolist()] == [0, 1, 2]
    more = put(again, 2, start=50)  # appends after the cut are readable next time
    assert again.stats("t").shards[0].rows == 5
    assert open_node(str(tmp_path), num_shards=1).stats("t").shards[0].rows == 5
    assert len(set(more.tolist()) & set(first.tolist())) == 0


def test_corrupt_record_is_dropped_with_a_warning(tmp_path, caplog) -> None:
    node = open_node(str(tmp_path), num_shards=1)
    put(node, 3)
    put(node, 4, start=3)
    put(node, 5, start=7)
    (log,) = _logs(str(tmp_path))
    with open(log, "rb") as f:
        data = bytearray(f.read())
    first_len = int.from_bytes(data[0:4], "little")
    second = 8 + first_len
    data[second + 8 + 20] ^= 0xFF  # flip a payload byte of the second record
    with open(log, "wb") as f:
        f.write(data)
    with caplog.at_level(logging.WARNING, logger="storage.persist"):
        again = open_node(str(tmp_path), num_shards=1)
    assert any("crc" in r.message for r in caplog.records)
    assert again.stats("t").shards[0].rows == 8  # records 1 and 3 survive


def test_garbage_log_never_crashes_recovery(tmp_path) -> None:
    node = open_node(str(tmp_path), num_shards=1)
    put(node, 3)
    (log,) = _logs(str(tmp_path))
    with open(log, "ab") as f:
        f.write(os.urandom(3000))
    again = open_node(str(tmp_path), num_shards=1)
    assert again.stats("t").shards[0].rows == 3


def test_spec_mismatch_and_drop(tmp_path) -> None:
    node = open_node(str(tmp_path))
    put(node, 2)
    node.close()
    other = StoreNode(0, 2, persist_root=str(tmp_path))  # recovered "t" at start
    bad = TableSpec("t", pa.schema([("prompt", pa.int64())]), (TaskSpec("x", ("prompt",)),))
    with pytest.raises(TableExists):
        other.create_table(bad)
    other.close()
    with pytest.raises(BadRequest, match="num_shards"):
        StoreNode(0, 1, persist_root=str(tmp_path))
    again = open_node(str(tmp_path))
    again.drop_table("t")
    assert not os.path.exists(os.path.join(str(tmp_path), "t"))
    assert sum(s.rows for s in open_node(str(tmp_path)).stats("t").shards) == 0


def test_fsync_interval_and_never_still_survive_process_crash(tmp_path) -> None:
    for policy in ("interval", "never"):
        d = str(tmp_path / policy)
        node = StoreNode(0, 1, persist_root=d)
        node.create_table(dataclasses.replace(spec(d), fsync=policy))
        put(node, 3)
        del node
        again = StoreNode(0, 1, persist_root=d)
        again.create_table(dataclasses.replace(spec(d), fsync=policy))
        assert again.stats("t").shards[0].rows == 3
