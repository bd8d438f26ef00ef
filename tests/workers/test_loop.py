"""The stage loop: one round trip per micro-batch, zombie results fenced off, heartbeats (also of
leases held across turns, as the trainer holds them until its step)."""

from __future__ import annotations

import time

import pyarrow as pa
from testkit import wait_until

import storage
from storage.schema import TableSpec, TaskSpec
from workers.roles.loop import StageLoop
from workers.runtime.events import EventSender
from workers.runtime.leases import LeaseKeeper, with_row_ids

SCHEMA = pa.schema([("x", pa.int64()), ("y", pa.int64())])


class Doubler:
    task = "double"
    columns = ("x",)
    whole_groups = False
    max_rows = 4

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s
        self.seen: list[int] = []

    def process(self, lease):
        time.sleep(self.sleep_s)  # work that outlives a short lease: the time is under test
        xs = lease.batch.column("x").to_pylist()
        self.seen += xs
        return with_row_ids(lease, {"y": pa.array([2 * x for x in xs], pa.int64())})


def _table(lease_seconds: float) -> TableSpec:
    return TableSpec("t", SCHEMA, (TaskSpec("double", ("x",)), TaskSpec("check", ("y",))),
                     lease_seconds=lease_seconds)


def _results(client) -> dict[int, int]:
    lease = client.claim("t", "check", ["x", "y"], 100, timeout=1.0)
    return dict(zip(lease.batch["x"].to_pylist(), lease.batch["y"].to_pylist(), strict=True))


def test_streaming_turns_write_every_row_once() -> None:
    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(30.0))
        client.put("t", pa.table({"x": list(range(10))}))
        loop = StageLoop(client, "t", Doubler(), worker="w", role="double",
                         events=EventSender(None, trace=False))
        total = 0
        while (n := loop.turn(0.0)):
            total += n
        assert total == 10
        assert _results(client) == {x: 2 * x for x in range(10)}
        assert client.stats("t").task_total("double").consumed == 10


def test_a_frozen_workers_late_result_is_fenced_and_the_rows_come_back() -> None:
    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(0.3))
        client.put("t", pa.table({"x": [1, 2]}))
        slow = StageLoop(client, "t", Doubler(sleep_s=0.8), worker="slow", role="double",
                         events=EventSender(None, trace=False))
        assert slow.turn(0.0) == 2  # computed, but the lease expired meanwhile (no heartbeat)
        fast_client = store.client()
        fast = StageLoop(fast_client, "t", Doubler(), worker="fast", role="double",
                         events=EventSender(None, trace=False))
        assert fast.turn(1.0) == 2  # redelivered to the successor
        assert slow.turn(0.0) == 0  # the zombie's carried write is refused, and it carries on
        fast.flush()
        assert _results(client) == {1: 2, 2: 4}
        assert client.stats("t").task_total("double").redelivered_total == 2


def test_heartbeats_keep_long_work_alive() -> None:
    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(0.4))
        client.put("t", pa.table({"x": [3]}))
        keeper = LeaseKeeper(store.client, tick_s=0.05)
        try:
            loop = StageLoop(client, "t", Doubler(sleep_s=1.0), worker="w", role="double",
                             events=EventSender(None, trace=False), keeper=keeper)
            assert loop.turn(0.0) == 1
            loop.flush()  # would raise LeaseExpired without the heartbeats
        finally:
            keeper.close()
        assert _results(client) == {3: 6}
        assert client.stats("t").task_total("double").redelivered_total == 0


def test_a_lease_held_across_turns_is_renewed_until_its_late_ack() -> None:
    """A lease held beyond the turn that claimed it (the trainer acks after its step): the keeper
    renews it while other turns go on, so its ack long after the first deadline is accepted."""
    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(0.4))
        client.put("t", pa.table({"x": [1, 2, 3]}))
        held = client.claim("t", "double", ["x"], 1, timeout=1.0)
        keeper = LeaseKeeper(store.client, tick_s=0.05)
        try:
            keeper.hold(held)
            loop = StageLoop(client, "t", Doubler(), worker="w", role="double",
                             events=EventSender(None, trace=False), keeper=keeper)

            def turns_past_the_deadline() -> bool:  # the other rows go by meanwhile
                loop.turn(0.0)
                return time.time() > held.deadline + 0.4

            wait_until(turns_past_the_deadline, timeout=30, interval=0.0,
                       what="turns past the held lease's first deadline")
            loop.flush()
            keeper.drop(held.lease_id)
            xs = held.batch.column("x").to_pylist()
            out = with_row_ids(held, {"y": pa.array([2 * x for x in xs], pa.int64())})
            client.write("t", held, out, ack=True)  # LeaseExpired had the keeper not renewed it
        finally:
            keeper.close()
        assert _results(client) == {1: 2, 2: 4, 3: 6}
        assert client.stats("t").task_total("double").redelivered_total == 0


class Checker:
    """Stage of task "check": records the y values it saw (acks them, writes nothing)."""

    task = "check"
    columns = ("y",)
    whole_groups = False
    max_rows = 100

    def __init__(self) -> None:
        self.seen: list[int] = []

    def process(self, lease):
        from workers.runtime.leases import Parts

        self.seen += lease.batch.column("y").to_pylist()
        return Parts()


def test_an_idle_worker_of_several_stages_wakes_for_any_of_them() -> None:
    """serve_stages waits on its first stage's claim with the others as ``wake`` tasks: rows of
    the second stage are served at once, not after the first stage's wait (60 s here)."""
    import threading

    from workers.roles.loop import serve_stages

    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(30.0))
        check, stop = Checker(), threading.Event()
        worker = threading.Thread(target=serve_stages, daemon=True, args=(
            store.client(), "t", [Doubler(), check], stop),
            kwargs={"worker": "w", "role": "r", "events": EventSender(None, trace=False),
                    "timeout_s": 60.0})
        worker.start()
        wait_until(lambda: store.parked()["claims"] == 1, what="the worker waiting")
        client.put("t", pa.table({"y": [5, 6]}))  # ready for "check" only
        wait_until(lambda: sorted(check.seen) == [5, 6], timeout=20.0, what="check served")
        stop.set()
        client.put("t", pa.table({"x": [3]}))  # wakes the waiting claim so the worker stops
        worker.join(20.0)
        assert not worker.is_alive()


def test_stages_taken_along_wait_until_the_first_stage_has_no_rows() -> None:
    """``along``: while the first stage finds rows, the stages it takes along are not
    claimed (partial rollout's riders ride the next rollout call instead); once it finds none,
    they are served. Breaks if a round claims them after the first stage got rows."""
    import threading

    from workers.roles.loop import serve_stages

    order: list[str] = []

    class Logged(Doubler):
        along = ("check",)

        def process(self, lease):
            order.append("double")
            return super().process(lease)

    class LoggedCheck(Checker):
        def process(self, lease):
            order.append("check")
            return super().process(lease)

    with storage.embedded() as store:
        client = store.client()
        client.create_table(_table(30.0))
        client.put("t", pa.table({"x": list(range(12))}))  # ready for "double"
        client.put("t", pa.table({"y": list(range(12))}))  # ready for "check"
        check, stop = LoggedCheck(), threading.Event()
        worker = threading.Thread(target=serve_stages, daemon=True, args=(
            store.client(), "t", [Logged(), check], stop),
            kwargs={"worker": "w", "role": "r", "events": EventSender(None, trace=False),
                    "timeout_s": 0.2})
        worker.start()
        wait_until(lambda: len(check.seen) == 24, timeout=20.0, what="check served")
        stop.set()
        worker.join(20.0)
    assert order[:3] == ["double"] * 3 and "double" not in order[3:]  # 12 rows, 4 per claim
