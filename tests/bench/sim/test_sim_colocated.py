"""Colocated stage turns (``bench.sim.colocated``): one claimer feeding every device through a
real (embedded) store — requests per turn, exactly-once results, whole groups, failures."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

import storage
from bench.sim.colocated import ColocatedTurns
from storage.schema import ROW_ID, TableSpec, TaskSpec

G = 4  # rows per group
SCHEMA = pa.schema([("group_id", pa.int64()), ("x", pa.int64()), ("y", pa.int64())])


class Doubler:
    """A stage writing y = 2x; records which device processed which group ids."""

    task, columns, whole_groups = "double", ("group_id", "x"), True

    def __init__(self, device: str, seen: list, *, max_rows: int = 8, fail_x: int = -1) -> None:
        self.device, self.seen, self.max_rows, self.fail_x = device, seen, max_rows, fail_x

    def process(self, lease):  # noqa: ANN001, ANN201
        xs = lease.batch.column("x").to_pylist()
        if self.fail_x in xs:
            raise ValueError(f"poison x={self.fail_x}")
        self.seen.append((self.device, lease.batch.column("group_id").to_pylist()))
        time.sleep(0.005)  # a device hold: lets the other devices take the next micro-batches
        return pa.RecordBatch.from_pydict(
            {ROW_ID: lease.batch.column(ROW_ID), "y": pa.array([2 * x for x in xs], pa.int64())}
        )


def _store(rows: int):  # noqa: ANN202
    spec = TableSpec(
        "t",
        SCHEMA,
        tasks=(TaskSpec("double", ("x",), whole_groups=True), TaskSpec("check", ("y",))),
        group_column="group_id",
        group_size=G,
    )
    store = storage.embedded(num_shards=1)
    client = store.__enter__().client()
    client.create_table(spec)
    n = rows // G
    client.put(
        "t",
        pa.table(
            {
                "group_id": pa.array([g for g in range(n) for _ in range(G)], pa.int64()),
                "x": pa.array(range(rows), pa.int64()),
            }
        ),
    )
    return store, client


def test_a_turn_costs_two_requests_per_chunk_and_writes_every_row_once() -> None:
    rows, devices = 80, ["d0", "d1", "d2", "d3"]
    store, client = _store(rows)
    seen: list = []
    turns = ColocatedTurns(client, "t", {"double": {d: Doubler(d, seen) for d in devices}}, devices)
    try:
        turns.turn("double", rows)
        # chunks of 4 devices x 8 rows: 32 + 32 + 16 rows -> 3 claims + 3 write+acks
        assert turns.requests == 6
        assert turns.micro_batches == 10
        assert client.stats("t").task_total("double").consumed == rows
        check = client.claim("t", "check", ["x", "y"], rows)
        assert check.num_rows == rows
        assert check.batch.column("y").to_pylist() == [2 * x for x in check.batch["x"].to_pylist()]
        # list scheduling: every device took micro-batches, each made of whole groups
        assert {d for d, _ in seen} == set(devices)
        for _, gids in seen:
            assert len(gids) == 8 and all(gids.count(g) == G for g in set(gids))
        done = sorted(g for _, gids in seen for g in gids)
        assert done == sorted(g for g in range(rows // G) for _ in range(G))  # each row once
    finally:
        turns.close()
        store.__exit__(None, None, None)


def test_a_failing_device_fails_the_turn_and_leaves_its_rows_to_be_redelivered() -> None:
    rows, devices = 32, ["d0", "d1"]
    store, client = _store(rows)
    seen: list = []
    stages = {"double": {d: Doubler(d, seen, fail_x=13) for d in devices}}
    turns = ColocatedTurns(client, "t", stages, devices)
    try:
        with pytest.raises(RuntimeError, match="colocated double turn failed") as info:
            turns.turn("double", rows)
        assert "poison x=13" in str(info.value.__cause__)
        stats = client.stats("t").task_total("double")
        assert stats.consumed == 0 and stats.in_flight == rows  # nothing acked; the lease expires
    finally:
        turns.close()
        store.__exit__(None, None, None)


def test_a_turn_whose_rows_are_not_ready_says_so() -> None:
    store, client = _store(8)
    turns = ColocatedTurns(
        client, "t", {"double": {"d0": Doubler("d0", [])}}, ["d0"], claim_timeout_s=0.05
    )
    try:
        with pytest.raises(TimeoutError, match="no ready rows"):
            turns.turn("double", 16)  # only 8 rows were put
    finally:
        turns.close()
        store.__exit__(None, None, None)


def test_close_stops_idle_device_threads() -> None:
    store, client = _store(8)
    before = threading.active_count()
    turns = ColocatedTurns(client, "t", {"double": {"d0": Doubler("d0", [])}}, ["d0", "d1"])
    assert threading.active_count() == before + 2
    turns.close()
    assert threading.active_count() == before
    store.__exit__(None, None, None)
