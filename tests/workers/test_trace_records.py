"""The worker side of the row trace (workers.runtime.trace, RowTrace in workers.runtime.events):
the record's wire form, what a write means for each row read from any batch, and the events a
stage loop leaves for a micro-batch (claim, write, ack; a failed delivery then the redelivery;
cells kept from a predecessor)."""

from __future__ import annotations

import msgpack
import pyarrow as pa
import pytest

import storage
from storage.schema import ROW_ID, Lease, TableSpec, TaskSpec
from workers.roles.loop import StageLoop
from workers.runtime.events import EventSender, RowTrace, decode, encode
from workers.runtime.leases import HandBack, Parts, with_row_ids, write_parts
from workers.runtime.trace import Tracer, put_trace, write_facts
from workers.schema import VERSION_RUNS_FIELD

RUNS = VERSION_RUNS_FIELD.type


def _lease(task: str = "rollout", **columns: pa.Array) -> Lease:
    n = len(next(iter(columns.values())))
    arrays = {ROW_ID: pa.array(range(10, 10 + n), pa.uint64()),
              "deliveries": pa.array([1] * (n - 1) + [2], pa.uint16()), **columns}
    return Lease(7, "samples", task, 0, 0.0, pa.RecordBatch.from_pydict(arrays))


def test_a_row_trace_round_trips_and_a_malformed_one_is_refused():
    rec = RowTrace("write", "rollout", "rollout-0", 12.5, [1, 2], lease_id=3, deliveries=[1, 2],
                   columns=["response_ids"], versions=[4, 4], tokens=[9, -1],
                   runs=[[0, 3, 5, 4], []], ends=["cut", ""], tools=["calculator", ""],
                   tool_seconds=[0.25, 0.0],
                   tool_errors=["", ""])
    assert decode(encode(rec)) == rec
    # what breaks it: a per-row list off by one, a wrong type, an unknown field (each dropped by
    # the controller's receiver as a ValueError, never written)
    for bad in ({"tokens": [1]}, {"row_ids": ["x", "y"]}, {"runs": [[0.5], []]},
                {"surprise": 1}):
        payload = msgpack.packb({"kind": "RowTrace", **{**rec.__dict__, **bad}})
        with pytest.raises(ValueError, match="RowTrace"):
            decode(payload)


def test_write_facts_read_versions_tokens_and_runs_from_whatever_the_batch_carries():
    # single-turn rollout: the response's length, its version, one run
    single = pa.RecordBatch.from_pydict({
        "response_ids": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32())),
        "policy_version": pa.array([3, 3], pa.int64())})
    assert write_facts(single) == ([3, 3], [3, 1], [[0, 3], [0, 3]], [])
    # a cut piece (piece1 written, later pieces NULL): the piece's version, length and end
    cut = pa.RecordBatch.from_pydict({
        "piece1_ids": pa.array([[5, 6], [7]], pa.list_(pa.int32())),
        "piece1_version": pa.array([4, 5], pa.int64()),
        "piece1_end": pa.array(["cut", "cut"], pa.string()),
        "piece2_ids": pa.array([None, None], pa.list_(pa.int32())),
        "piece2_version": pa.array([None, None], pa.int64())})
    assert write_facts(cut) == ([4, 5], [2, 1], [], ["cut", "cut"])
    # the end of a trajectory: the assembled response with its runs; version = newest piece's
    done = pa.RecordBatch.from_pydict({
        "response_ids": pa.array([list(range(7))], pa.list_(pa.int32())),
        "policy_version": pa.array([3], pa.int64()),
        "response_version_runs": pa.array([[{"start": 0, "version": 3},
                                            {"start": 5, "version": 4}]], RUNS),
        "piece2_ids": pa.array([None], pa.list_(pa.int32()))})
    assert write_facts(done) == ([4], [7], [[0, 3, 5, 4]], [])
    # an observation: its length and end, no version of its own
    obs = pa.RecordBatch.from_pydict({
        "piece1_ids": pa.array([[9, 9, 9]], pa.list_(pa.int32())),
        "piece1_version": pa.array([None], pa.int64()),
        "piece1_end": pa.array(["observation"], pa.string())})
    assert write_facts(obs) == ([], [3], [], ["observation"])
    # a reward write: nothing known, nothing sent
    reward = pa.RecordBatch.from_pydict({"reward": pa.array([1.0], pa.float32())})
    assert write_facts(reward) == ([], [], [], [])


def test_the_tracer_splits_kept_rows_and_carries_tool_calls():
    sent: list[RowTrace] = []
    lease = _lease("env.1", group_id=pa.array([0, 0, 1], pa.int64()),
                   iteration=pa.array([2, 2, 2], pa.int64()))
    tracer = Tracer(sent.append, "environment-0", enabled=True)
    batch = pa.RecordBatch.from_pydict({
        ROW_ID: pa.array([10, 12], pa.uint64()),
        "piece1_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    tracer.claim(lease)
    tracer.write(lease, batch, seconds=0.5, kept=[0], calls={12: ("calculator", 0.01, None)})
    claim, kept, write = sent
    assert (claim.event, claim.row_ids, claim.deliveries) == ("claim", [10, 11, 12], [1, 1, 2])
    assert (claim.groups, claim.iterations) == ([0, 0, 1], [2, 2, 2])
    assert (kept.event, kept.row_ids, kept.deliveries, kept.groups) == ("kept", [10], [1], [0])
    assert (write.row_ids, write.deliveries, write.groups, write.tokens) == ([12], [2], [1], [1])
    assert (write.tools, write.tool_seconds, write.tool_errors) == (["calculator"], [0.01], [""])
    assert write.columns == ["piece1_ids"] and write.seconds == 0.5
    for rec in sent:
        rec.check()
    put = put_trace([5, 6], pa.RecordBatch.from_pydict({"group_id": [0, 0], "iteration": [1, 1]}))
    assert (put.event, put.row_ids, put.groups, put.iterations) == ("put", [5, 6], [0, 0], [1, 1])
    off = Tracer(sent.append, "w", enabled=False)
    off.claim(lease)
    off.write(lease, batch)
    assert len(sent) == 3  # off: nothing sent


class FailsOnce:
    """Doubles x; hands its first lease back as a failed delivery."""

    task, columns, whole_groups, max_rows = "double", ("x",), False, 4

    def __init__(self) -> None:
        self.failed = False

    def process(self, lease: Lease) -> pa.RecordBatch:
        if not self.failed:
            self.failed = True
            raise HandBack("flaky")
        xs = lease.batch.column("x").to_pylist()
        return with_row_ids(lease, {"y": pa.array([2 * x for x in xs], pa.int64())})


def test_a_stage_loop_traces_claim_fail_redelivery_write_and_ack():
    spec = TableSpec("t", pa.schema([("x", pa.int64()), ("y", pa.int64())]),
                     (TaskSpec("double", ("x",)), TaskSpec("check", ("y",))))
    with storage.embedded() as store:
        client = store.client()
        client.create_table(spec)
        ids = client.put("t", pa.table({"x": [1, 2]})).tolist()
        events = EventSender(None, trace=True)
        loop = StageLoop(client, "t", FailsOnce(), worker="w-0", role="double", events=events)
        assert loop.turn(0.0) == -1
        assert loop.turn(0.0) == 2
        loop.flush()
        got = [(r.event, r.row_ids, r.deliveries) for r in events.sent if isinstance(r, RowTrace)]
        # what breaks it: a lost event kind, a wrong delivery count, the write before the fail
        assert got == [("claim", ids, [1, 1]), ("fail", ids, [1, 1]), ("claim", ids, [2, 2]),
                       ("write", ids, [2, 2]), ("ack", ids, [2, 2])]
        write = [r for r in events.sent if isinstance(r, RowTrace) and r.event == "write"][0]
        assert write.columns == ["y"] and write.seconds >= 0.0
        fail = [r for r in events.sent if isinstance(r, RowTrace) and r.event == "fail"][0]
        assert "flaky" in fail.error
        quiet = EventSender(None, trace=False)  # run.trace false: no RowTrace at all
        client.put("t", pa.table({"x": [3]}))
        StageLoop(client, "t", FailsOnce(), worker="w-1", role="double", events=quiet).turn(0.0)
        assert not [r for r in quiet.sent if isinstance(r, RowTrace)]


def test_write_parts_reports_the_rows_a_predecessor_had_written():
    spec = TableSpec("t", pa.schema([("x", pa.int64()), ("y", pa.int64())]),
                     (TaskSpec("double", ("x",)), TaskSpec("check", ("y",))), lease_seconds=30)
    with storage.embedded() as store:
        client = store.client()
        client.create_table(spec)
        client.put("t", pa.table({"x": [1, 2, 3]}))
        lease = client.claim("t", "double", ["x"], 3)
        first = with_row_ids(lease, {"y": pa.array([2, 4, 6], pa.int64())})
        client.write("t", lease, first.slice(1, 1))  # the predecessor wrote row 1 and died
        seen: list[tuple[int, list[int]]] = []
        kept = write_parts(client, "t", lease, Parts((first,)),
                           lambda batch, k: seen.append((batch.num_rows, k)))
        assert kept == 1 and seen == [(3, [1])]


def test_early_writes_are_traced_as_writes():
    """The loop's early writes (workers.roles.riding) bypass the stage's result: they are traced
    by the tracer they are given. What breaks it: an early write left out of the trace."""
    from workers.roles.riding import Riding

    spec = TableSpec("t", pa.schema([("x", pa.int64()), ("y", pa.int64())]),
                     (TaskSpec("double", ("x",)), TaskSpec("check", ("y",))), lease_seconds=30)
    with storage.embedded() as store:
        client = store.client()
        client.create_table(spec)
        ids = client.put("t", pa.table({"x": [1, 2]})).tolist()
        lease = client.claim("t", "double", ["x"], 2)
        sent: list[RowTrace] = []
        tracer = Tracer(sent.append, "rollout-0", enabled=True)

        def rows(picked: list[int]) -> Parts:
            return Parts((pa.RecordBatch.from_pydict({
                ROW_ID: pa.array([ids[p] for p in picked], pa.uint64()),
                "y": pa.array([2 * (p + 1) for p in picked], pa.int64())}),))

        class Doubling:
            def process_all(self, leases, early):  # noqa: ANN001, ANN202
                early(0, rows([1]))  # row 1 finished first
                return [rows([0, 1])]

        rest = Riding(client, "t", {}, max_rows=2, early_s=0.0, tracer=tracer).process(
            Doubling(), lease)
        assert [(r.event, r.row_ids, r.columns) for r in sent] == [("write", [ids[1]], ["y"])]
        assert [b.column(ROW_ID).to_pylist() for b in rest.batches] == [[ids[0]]]
