"""Client verbs end to end: the full RL-shaped cycle, row-id writes, extend/release, multi-node
routing and claims, timeouts and reconnection after a node restart."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from testkit import wait_until

import storage
from storage.errors import (
    CellAlreadyWritten,
    LeaseExpired,
    TableExists,
    Unavailable,
    UnknownRows,
)
from storage.schema import shard_of


def _rewards(n: int, value: float = 1.0) -> pa.RecordBatch:
    return pa.record_batch({"reward": pa.array([value] * n, pa.float32())})


def test_full_cycle_every_task_sees_every_row_once(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.create_table(h.make_spec())  # idempotent for an equal spec
    with pytest.raises(TableExists):
        c.create_table(h.make_spec(capacity_rows=7))
    ids = np.concatenate([c.put("t", h.make_rows(4, start_gid=10 * i)) for i in range(3)])
    assert len(set(ids.tolist())) == 48
    rewarded: list[int] = []
    while True:
        lease = c.claim("t", "reward", ["x"], 10)
        if not lease.num_rows:
            break
        rewarded += lease.row_ids
        c.write("t", lease, _rewards(lease.num_rows, 0.5), ack=True)
    trained: list[int] = []
    while True:
        lease = c.claim("t", "train", ["gid", "x", "reward"], 12, whole_groups=True)
        if not lease.num_rows:
            break
        gids = lease.batch.column("gid").to_pylist()
        assert all(gids.count(g) == 4 for g in gids)  # never a split group
        assert lease.batch.column("reward").to_pylist() == [0.5] * lease.num_rows
        trained += lease.row_ids
        c.ack(lease)
    assert sorted(rewarded) == sorted(trained) == sorted(ids.tolist())
    stats = c.stats("t")
    assert stats.task_total("train").consumed == 48 and stats.task_total("reward").in_flight == 0
    assert sum(s.rows for s in stats.shards) == 0  # consumed by every task: freed


def test_write_by_row_ids_and_write_once_cells(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    ids = c.put("t", h.make_rows(1))
    c.write("t", ids, _rewards(4, 2.0))
    with pytest.raises(CellAlreadyWritten):
        c.write("t", ids, _rewards(4, 3.0))
    c.write("t", ids, _rewards(4, 3.0), overwrite=True)
    lease = c.claim("t", "train", ["reward"], 4)
    assert lease.batch.column("reward").to_pylist() == [3.0] * 4
    with pytest.raises(UnknownRows):
        c.write("t", [int(ids[0]) + 1000], _rewards(1))
    with pytest.raises(ValueError):
        c.write("t", ids, _rewards(4), ack=True)


def test_extend_release_and_fencing(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec(lease_seconds=0.5, max_deliveries=3))
    c.put("t", h.make_rows(1))
    lease = c.claim("t", "reward", ["x"], 4)
    new_deadline = c.extend(lease, 30.0)
    assert new_deadline > lease.deadline
    c.release(lease)  # clean hand-back: claimable again at once
    again = c.claim("t", "reward", ["x"], 4)
    assert sorted(again.row_ids) == sorted(lease.row_ids)
    with pytest.raises(LeaseExpired):  # UnknownLease is a LeaseExpired: the old lease is fenced
        c.write("t", lease, _rewards(4), ack=True)
    c.release(again, error="model crashed")
    for _ in range(10):  # failed deliveries until the rows are quarantined (max_deliveries=3)
        lease = c.claim("t", "reward", ["x"], 4)
        if not lease.num_rows:
            break
        c.release(lease, error="model crashed again")
    total = c.stats("t").task_total("reward")
    assert total.dead == 4 and total.ready == 0 and total.dead_reasons


def test_client_timeout_raises_unavailable_and_recovers_after_node_start(h, tmp_path):
    port = h.free_port()
    node = h.StoreProcess(tmp_path, port=port)
    c = storage.connect(node.address, request_timeout=0.3)
    with pytest.raises(Unavailable):
        c.tables()
    node.start()
    try:
        c.request_timeout = 10.0
        assert c.tables() == []
    finally:
        c.close()
        node.stop()


def test_multi_node_routing_placement_and_merged_stats(store_factory, h):
    n0 = store_factory(node_index=0, shards=2).start()
    n1 = store_factory(node_index=1, shards=1).start()
    with storage.connect([n0.address, n1.address]) as c:
        c.create_table(h.make_spec())
        ids = np.concatenate([c.put("t", h.make_rows(2, start_gid=10 * i)) for i in range(6)])
        nodes = {shard_of(int(r)) >> 8 for r in ids}
        assert nodes == {0, 1}  # shallowest-first placement used both nodes
        c.write("t", ids, _rewards(len(ids)))  # one call, split by node
        stats = c.stats("t")
        assert sorted(s.shard_id for s in stats.shards) == [0, 1, 256]
        assert stats.task_total("train").ready == 48
        got: list[int] = []
        while True:
            lease = c.claim("t", "train", ["x"], 16)
            if not lease.num_rows:
                break
            assert len({shard_of(r) for r in lease.row_ids}) == 1  # one shard per lease
            got += lease.row_ids
            c.ack(lease)
        assert sorted(got) == sorted(ids.tolist())


def test_multi_node_long_poll_takes_the_first_lease(store_factory, h):
    n0 = store_factory(node_index=0).start()
    n1 = store_factory(node_index=1).start()
    consumer = storage.connect([n0.address, n1.address])
    consumer.create_table(h.make_spec())
    box: dict = {}

    def wait():
        box["lease"] = consumer.claim("t", "reward", ["x"], 8, timeout=60)

    t = threading.Thread(target=wait, daemon=True)
    t0 = time.monotonic()
    t.start()
    with storage.connect([n0.address, n1.address]) as watcher:  # both long polls parked
        wait_until(lambda: [p["claims"] for p in watcher.parked()] == [1, 1])
    with storage.connect(n1.address) as producer:
        ids = producer.put("t", h.make_rows(1))
    t.join(30)
    lease = box["lease"]
    assert sorted(lease.row_ids) == sorted(ids.tolist()) and time.monotonic() - t0 < 30
    # The other node's parked claim was cancelled: nothing is left leased or parked there.
    consumer.ack(lease)
    assert consumer.stats("t").task_total("reward").in_flight == 0
    consumer.close()


def test_embedded_clients_from_several_threads(embedded_store, h):
    embedded_store.client().create_table(h.make_spec())
    errors: list[BaseException] = []

    def produce(k: int):
        try:
            c = embedded_store.client()
            for i in range(5):
                c.put("t", h.make_rows(1, start_gid=1000 * k + i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert embedded_store.client().stats("t").task_total("reward").ready == 80

