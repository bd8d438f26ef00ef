"""The coordinator's shard map over real sockets: claims routed to owned shards across nodes,
placement on the shallowest shard, a dead consumer's shards reassigned within the bound, metrics,
and (slow) a skewed workload against a store node process where the balancer evens the load."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

import storage
from storage.balance import BalancerConfig
from storage.coordinator import ConsumerSession, Coordinator, CoordinatorClient
from storage.schema import TableSpec, TaskSpec

SCHEMA = pa.schema([("x", pa.int64())])


def spec(name: str = "t") -> TableSpec:
    return TableSpec(name, SCHEMA, (TaskSpec("work", ("x",)),), lease_seconds=30.0)


def rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"x": list(range(start, start + n))})


def test_claim_with_shards_routes_to_the_owning_nodes_only():
    with storage.embedded(2, tcp=True) as n0, storage.embedded(2, node_index=1, tcp=True) as n1:
        client = storage.connect([n0.address, n1.address])
        client.create_table(spec())
        client.put("t", rows(10), shard_id=0)
        client.put("t", rows(10, 10), shard_id=(1 << 8) | 1)
        lease = client.claim("t", "work", ["x"], 4, shards=[(1 << 8) | 1])
        assert lease.shard_id == (1 << 8) | 1 and lease.num_rows == 4
        # The previous lease lives on node 1; the next claim asks node 0 only: ack apart, no loss.
        nxt = client.claim("t", "work", ["x"], 4, shards=[0], ack=lease)
        assert nxt.shard_id == 0 and nxt.num_rows == 4
        assert client.stats("t").task_total("work").consumed == 4
        assert client.claim("t", "work", ["x"], 4, shards=[1], timeout=0.1).num_rows == 0
        with pytest.raises(ValueError, match="non-empty"):
            client.claim("t", "work", ["x"], 4, shards=[])
        with pytest.raises(ValueError, match="shard id"):
            client.claim("t", "work", ["x"], 4, shards=[-1])
        client.close()


def test_puts_go_to_the_shallowest_shard():
    with storage.embedded(4) as store:
        client = store.client()
        client.create_table(spec())
        client.put("t", rows(30), shard_id=0)
        client.put("t", rows(20), shard_id=1)
        client.put("t", rows(10), shard_id=2)
        for _ in range(3):  # each put goes to the shallowest shard then (ties: lowest id)
            client.put("t", rows(5))
        by_shard = {s.shard_id: s.rows for s in client.stats("t").shards}
        assert by_shard == {0: 30, 1: 20, 2: 15, 3: 10}  # 3: 0->5->10, then 2: 10->15


def test_dead_consumer_shards_go_to_the_live_one_within_the_bound():
    cfg = BalancerConfig(session_timeout_s=1.0, heartbeat_interval_s=0.2)
    with storage.embedded(4, tcp=True) as store:
        store.client().create_table(spec())
        with Coordinator(store_addresses=[store.address], balancer=cfg) as coord:
            live = ConsumerSession(coord.address, "t", "work", "live")
            ghost = CoordinatorClient(coord.address)
            ghost.join("t", "work", "ghost")
            deadline = time.monotonic() + 10
            with CoordinatorClient(coord.address) as cc:
                while not cc.assignment("t", "work")["members"].get("ghost", {}).get("shards"):
                    ghost.heartbeat("t", "work", "ghost", generation=1 << 40)
                    assert time.monotonic() < deadline, "ghost never got shards"
                    time.sleep(0.1)
                died = time.monotonic()  # the ghost stops heartbeating now
                while sorted(live.shards()) != [0, 1, 2, 3]:
                    assert time.monotonic() - died < cfg.unowned_bound_s + 2.0, live.shards()
                    time.sleep(0.05)
                assert "ghost" not in cc.assignment("t", "work")["members"]
            m = coord.metrics
            assert m.reassignments.labels("t", "work", "expired")._value.get() >= 1
            assert m.owned_shards.labels("t", "work", "live")._value.get() == 4
            assert m.consumers.labels("t", "work")._value.get() == 1
            # The dead consumer's process is restarted under the same id: it rejoins and the
            # balancer hands it its share again (by handoff: never owned by both at once).
            reborn = ConsumerSession(coord.address, "t", "work", "ghost")
            rejoined = time.monotonic()
            while len(reborn.shards()) != 2:
                assert time.monotonic() - rejoined < cfg.unowned_bound_s + 5.0, reborn.shards()
                time.sleep(0.05)
            with CoordinatorClient(coord.address) as cc:
                members = cc.assignment("t", "work")["members"]
                owned = [s for m in members.values() for s in m.get("shards", [])]
                assert sorted(owned) == [0, 1, 2, 3]  # each shard exactly one owner
            assert sorted(live.shards()) == sorted({0, 1, 2, 3} - set(reborn.shards()))
            reborn.close()
            live.close()
            ghost.close()


@pytest.mark.slow
def test_skewed_workload_balancer_moves_the_flooded_shard_to_the_fast_consumer(h, tmp_path):
    """Store node process, coordinator, two consumer threads: c0-slow (5x slower) starts owning
    the flooded shard. Stealing is off so the move itself must do the evening."""
    node = h.StoreProcess(tmp_path, shards=4).start()
    try:
        admin = storage.connect(node.address)
        admin.create_table(spec())
        cfg = BalancerConfig(session_timeout_s=2.0, heartbeat_interval_s=0.2, patience=2)
        with Coordinator(store_addresses=[node.address], balancer=cfg) as coord:
            names = ("c0-slow", "c1-fast")
            cost = {"c0-slow": 0.005, "c1-fast": 0.001}
            sessions = {n: ConsumerSession(coord.address, "t", "work", n, steal=False)
                        for n in names}
            deadline = time.monotonic() + 10
            while sorted(sessions["c0-slow"].shards()) != [0, 2]:  # round-robin start
                assert time.monotonic() < deadline, sessions["c0-slow"].shards()
                time.sleep(0.05)
            done = {n: 0 for n in names}
            stop = threading.Event()

            def consume(name: str) -> None:
                client, prev = storage.connect(node.address), None
                while not stop.is_set():
                    lease = sessions[name].claim(client, ["x"], 16, timeout=0.3, ack=prev)
                    prev = None
                    if lease.num_rows:
                        t0 = time.monotonic()
                        time.sleep(cost[name] * lease.num_rows)
                        sessions[name].record(lease.num_rows, time.monotonic() - t0)
                        done[name] += lease.num_rows
                        prev = lease
                if prev is not None:
                    client.ack(prev)
                client.close()

            threads = [threading.Thread(target=consume, args=(n,)) for n in names]
            for t in threads:
                t.start()
            total = 2000
            admin.put("t", rows(1800), shard_id=0)  # the flood, on c0-slow's shard
            admin.put("t", rows(total - 1800, 1800), shard_id=1)  # c1-fast's own work
            start = time.monotonic()
            while admin.stats("t").task_total("work").consumed < total:
                assert time.monotonic() - start < 20, done
                time.sleep(0.05)
            wall = time.monotonic() - start
            stop.set()
            for t in threads:
                t.join(10)
            moved = coord.metrics.reassignments.labels("t", "work", "balance")._value.get()
            owners = dict(CoordinatorClient(coord.address).assignment("t", "work")["owners"])
            for s in sessions.values():
                s.close()
        # c0-slow alone would need 1800 * 5 ms = 9 s for the flood; the balancer gave the
        # flooded shard to c1-fast, which then did most of the work.
        assert moved >= 1 and owners[0] == "c1-fast"
        assert done["c1-fast"] >= 0.5 * total, done
        assert wall < 0.8 * 1800 * cost["c0-slow"], (wall, done)
        admin.close()
    finally:
        node.stop()
