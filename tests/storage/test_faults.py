"""Faults with real processes: a consumer SIGKILLed while holding a lease, a SIGSTOPped zombie
whose late write is fenced, a store node SIGKILLed and restarted with persistence, and a producer
much faster than its consumers held back by capacity. Each test is bounded in rows and time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest

import storage

CONSUMER = """
import sys, time
import pyarrow as pa
import storage
from storage.errors import StoreError
addr, mode = sys.argv[1], sys.argv[2]
c = storage.connect(addr, request_timeout=20)
lease = c.claim("t", "reward", ["x"], 8, timeout=20)
print(" ".join(map(str, lease.row_ids)), flush=True)
if mode == "hang":
    time.sleep(600)
sys.stdin.readline()  # the test says when to try the late write
late = pa.record_batch({"reward": pa.array([9.0] * lease.num_rows, pa.float32())})
try:
    if mode == "late-combined":  # the piggybacked form: write + ack + claim the next rows
        c.claim("t", "reward", ["x"], 8, ack=lease, write=late)
    else:
        c.write("t", lease, late, ack=True)
    print("ok", flush=True)
except StoreError as exc:
    print(exc.code, flush=True)
"""

PRODUCER = """
import sys, time
import pyarrow as pa
import storage
addr, batches = sys.argv[1], int(sys.argv[2])
c = storage.connect(addr, request_timeout=60)
for b in range(batches):
    gids = [b * 4 + g for g in range(4) for _ in range(4)]
    batch = pa.record_batch({"gid": pa.array(gids, pa.int64()),
                             "x": pa.array([[g] * 64 for g in gids], pa.list_(pa.int32()))})
    c.put("t", batch, timeout=60)
print("done", flush=True)
"""


def _spawn(h, script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(h.repo), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=h.repo)


def _rewards(n: int, value: float) -> pa.RecordBatch:
    return pa.record_batch({"reward": pa.array([value] * n, pa.float32())})


def test_sigkilled_consumer_rows_are_redelivered_and_consumed_once(store_node, h):
    c = storage.connect(store_node.address, request_timeout=20)
    c.create_table(h.make_spec(lease_seconds=1.0))
    ids = c.put("t", h.make_rows(4)).tolist()
    child = _spawn(h, CONSUMER, store_node.address, "hang")
    held = [int(x) for x in child.stdout.readline().split()]
    assert len(held) == 8
    child.kill()  # SIGKILL while holding the lease
    child.wait(10)
    acked: list[int] = []
    deliveries: dict[int, int] = {}
    deadline = time.monotonic() + 30
    while len(acked) < len(ids) and time.monotonic() < deadline:
        lease = c.claim("t", "reward", ["x"], 8, timeout=5)
        for r, d in zip(lease.row_ids, lease.batch.column("deliveries").to_pylist(), strict=True):
            deliveries[r] = d
        acked += lease.row_ids
        c.write("t", lease, _rewards(lease.num_rows, 1.0), ack=True)
    assert sorted(acked) == sorted(ids)  # every row consumed, none twice
    assert {deliveries[r] for r in held} == {2}
    total = c.stats("t").task_total("reward")
    assert total.consumed == len(ids) and total.in_flight == 0 and total.redelivered_total == 8
    c.close()


@pytest.mark.parametrize("mode", ["late", "late-combined"])
def test_late_write_of_a_stopped_consumer_is_fenced(store_node, h, mode):
    c = storage.connect(store_node.address, request_timeout=20)
    c.create_table(h.make_spec(lease_seconds=1.0))
    c.put("t", h.make_rows(2))
    zombie = _spawn(h, CONSUMER, store_node.address, mode)
    held = sorted(int(x) for x in zombie.stdout.readline().split())
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        successor = c.claim("t", "reward", ["x"], 8, timeout=20)  # after the zombie's deadline
        assert sorted(successor.row_ids) == held
        c.write("t", successor, _rewards(8, 1.0), ack=True)
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    c.put("t", h.make_rows(2, start_gid=100))  # rows a wrongly accepted combined claim would take
    zombie.stdin.write("go\n")
    zombie.stdin.flush()
    verdict = zombie.stdout.readline().strip()
    zombie.wait(20)
    assert verdict in ("lease_expired", "unknown_lease")
    train = c.claim("t", "train", ["reward"], 8)
    assert train.batch.column("reward").to_pylist() == [1.0] * 8  # the successor's, not 9.0
    reward = c.stats("t").task_total("reward")
    assert reward.consumed == 8 and reward.in_flight == 0 and reward.ready == 8  # nothing leased
    c.close()


def test_node_killed_and_restarted_keeps_acknowledged_durable_data(store_factory, h, tmp_path):
    node = store_factory(shards=2, persist_dir=tmp_path / "data").start()
    spec = h.make_spec(fsync="always", lease_seconds=60.0)
    c = storage.connect(node.address, request_timeout=10)
    c.create_table(spec)
    ids = [int(r) for i in range(3) for r in c.put("t", h.make_rows(2, start_gid=10 * i))]
    done = c.claim("t", "reward", ["x"], 8)
    c.write("t", done, _rewards(8, 0.25), ack=True)  # acknowledged: durable
    held = c.claim("t", "reward", ["x"], 8)  # leased at crash time: comes back READY
    node.kill(signal.SIGKILL)
    node.start()  # recovers every table of its persistence root before it serves
    stats = c.stats("t")  # no create_table needed
    assert sum(s.rows for s in stats.shards) == 24
    rest: list[int] = []
    while True:
        lease = c.claim("t", "reward", ["x"], 8)
        if not lease.num_rows:
            break
        rest += lease.row_ids
        c.ack(lease)
    assert sorted(rest) == sorted(set(ids) - set(done.row_ids))
    assert set(held.row_ids) <= set(rest)
    train = c.claim("t", "train", ["reward"], 8)
    assert sorted(train.row_ids) == sorted(done.row_ids)
    assert train.batch.column("reward").to_pylist() == [0.25] * 8
    c.close()


def test_fast_producer_is_held_back_by_capacity(store_node, h):
    cap_bytes = 48 * 1024
    c = storage.connect(store_node.address, request_timeout=30)
    c.create_table(h.make_spec(capacity_bytes=cap_bytes, lease_seconds=30.0))
    batches = 32  # 512 rows, ~2.2 KiB per 8 rows: many times the capacity in total
    producer = _spawn(h, PRODUCER, store_node.address, str(batches))
    trained, peak_bytes, peak_rows = 0, 0, 0
    deadline = time.monotonic() + 60
    while trained < batches * 16 and time.monotonic() < deadline:
        lease = c.claim("t", "reward", ["x"], 8, timeout=2)
        if lease.num_rows:
            c.write("t", lease, _rewards(lease.num_rows, 1.0), ack=True)
        train = c.claim("t", "train", ["x", "reward"], 8, timeout=0)
        if train.num_rows:
            c.ack(train)
            trained += train.num_rows
        stats = c.stats("t")
        peak_bytes = max(peak_bytes, sum(s.bytes for s in stats.shards))
        peak_rows = max(peak_rows, sum(s.rows for s in stats.shards))
        time.sleep(0.01)  # a slow consumer
    assert producer.stdout.readline().strip() == "done"
    assert producer.wait(20) == 0
    assert trained == batches * 16
    assert peak_bytes <= cap_bytes
    assert peak_bytes > cap_bytes // 2  # the producer really ran ahead and was held back
    c.close()

