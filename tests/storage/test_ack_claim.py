"""The combined verb: a claim that first writes/acks the consumer's previous lease, in one round
trip. Order (check claim args -> write+ack -> claim), failure rules (fenced: nothing applied;
failed after the ack: ``exc.acked``), durability, wire validation and multi-node routing."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
from testkit import wait_until

import storage
from storage import wire
from storage.errors import (
    BadRequest,
    CellAlreadyWritten,
    LeaseExpired,
    SchemaMismatch,
    ShuttingDown,
    UnknownTask,
)


def _rewards(n: int, value: float = 1.0) -> pa.RecordBatch:
    return pa.record_batch({"reward": pa.array([value] * n, pa.float32())})


def test_streaming_consumers_see_every_row_once_with_one_request_per_turn(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    ids = c.put("t", h.make_rows(6)).tolist()  # 24 rows
    rewarded: list[int] = []
    lease = c.claim("t", "reward", ["x"], 8)
    while lease.num_rows:
        rewarded += lease.row_ids
        gid = lease.batch.column("x").to_pylist()
        lease = c.claim("t", "reward", ["x"], 8, ack=lease, write=_rewards(len(gid), 0.5))
    trained: list[int] = []
    lease = c.claim("t", "train", ["gid", "reward"], 8, whole_groups=True)
    while lease.num_rows:
        assert lease.batch.column("reward").to_pylist() == [0.5] * lease.num_rows
        trained += lease.row_ids
        lease = c.claim("t", "train", ["gid", "reward"], 8, whole_groups=True, ack=lease)
    assert sorted(rewarded) == sorted(trained) == sorted(ids)
    stats = c.stats("t")
    assert stats.task_total("reward").consumed == stats.task_total("train").consumed == 24
    assert stats.task_total("train").in_flight == 0
    assert sum(s.rows for s in stats.shards) == 0  # consumed by every task: freed


def test_fenced_ack_applies_nothing_and_rows_come_back(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec(lease_seconds=0.2))
    c.put("t", h.make_rows(2))
    old = c.claim("t", "reward", ["x"], 4)
    # past the deadline (the node expired the lease): a zombie
    wait_until(lambda: c.stats("t").task_total("reward").in_flight == 0, what="lease expiry")
    with pytest.raises(LeaseExpired) as ei:
        c.claim("t", "reward", ["x"], 4, ack=old, write=_rewards(4, 9.0))
    assert ei.value.acked is False
    reward = c.stats("t").task_total("reward")
    assert reward.in_flight == 0 and reward.consumed == 0 and reward.ready == 8  # none leased
    # At-least-once: the zombie's rows are handed out again, and its write never landed.
    again = c.claim("t", "reward", ["x"], 8)
    assert set(old.row_ids) <= set(again.row_ids)
    c.write("t", again, _rewards(8, 1.0), ack=True)
    assert c.claim("t", "train", ["reward"], 8).batch.column("reward").to_pylist() == [1.0] * 8


def test_bad_claim_or_bad_write_leaves_the_previous_lease_live(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.put("t", h.make_rows(2))
    lease = c.claim("t", "reward", ["x"], 4)
    with pytest.raises(UnknownTask):
        c.claim("t", "nope", ["x"], 4, ack=lease, write=_rewards(4))
    with pytest.raises(BadRequest, match="no_such"):
        c.claim("t", "reward", ["no_such"], 4, ack=lease, write=_rewards(4))
    wrong_type = pa.record_batch({"reward": pa.array([1, 2, 3, 4], pa.int64())})
    with pytest.raises(SchemaMismatch, match="reward"):
        c.claim("t", "reward", ["x"], 4, ack=lease, write=wrong_type)
    c.write("t", [lease.row_ids[0]], _rewards(1, 7.0))  # someone else wrote one cell
    with pytest.raises(CellAlreadyWritten) as ei:
        c.claim("t", "reward", ["x"], 4, ack=lease, write=_rewards(4))
    assert ei.value.acked is False
    reward = c.stats("t").task_total("reward")
    assert reward.in_flight == 4 and reward.consumed == 0  # nothing acked, nothing new leased
    c.ack(lease)  # still live: every failed attempt above applied nothing


def test_claim_failing_after_the_ack_reports_acked(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.put("t", h.make_rows(2))
    lease = c.claim("t", "reward", ["x"], 4)
    # "reward" is not a column the task needs and no ready row has it: the claim part fails
    # only once it looks at the rows, after the ack went through.
    with pytest.raises(BadRequest, match="not written") as ei:
        c.claim("t", "reward", ["reward"], 4, ack=lease, write=_rewards(4))
    assert ei.value.acked is True
    reward = c.stats("t").task_total("reward")
    assert reward.consumed == 4 and reward.in_flight == 0 and reward.ready == 4


def test_shutdown_while_waiting_after_the_ack_reports_acked(h):
    store = storage.embedded()
    box: dict = {}
    try:
        c = store.client()
        c.create_table(h.make_spec())
        c.put("t", h.make_rows(1))
        lease = c.claim("t", "reward", ["x"], 4)

        def wait() -> None:
            try:
                c.claim("t", "reward", ["x"], 4, timeout=20, ack=lease, write=_rewards(4))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                box["error"] = exc

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        wait_until(lambda: store.parked()["claims"] == 1, what="the claim to park")
        reward = store.server.node.stats("t").shards[0].tasks["reward"]
        assert reward.consumed == 4  # acked, now waiting for rows
        store.server.stop()
        t.join(30)
    finally:
        store.close()
    assert isinstance(box.get("error"), ShuttingDown) and box["error"].acked is True


def test_combined_ack_is_synced_before_the_reply(h, tmp_path, monkeypatch):
    with storage.embedded(persist_dir=str(tmp_path)) as store:
        node = store.server.node
        c = store.client()
        c.create_table(h.make_spec(fsync="always"))
        c.put("t", h.make_rows(1))
        lease = c.claim("t", "reward", ["x"], 4)
        calls = []
        real_sync = node.sync
        monkeypatch.setattr(node, "sync", lambda: (calls.append(1), real_sync())[1])
        c.claim("t", "reward", ["x"], 4, ack=lease, write=_rewards(4))
        assert calls


def test_client_side_misuse_is_refused(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.create_table(h.make_spec("u"))
    c.put("t", h.make_rows(1))
    lease = c.claim("t", "reward", ["x"], 4)
    with pytest.raises(ValueError, match="ack"):
        c.claim("t", "reward", ["x"], 4, write=_rewards(4))
    with pytest.raises(ValueError, match="table"):
        c.claim("u", "reward", ["x"], 4, ack=lease)
    empty = c.claim("u", "reward", ["x"], 4)
    assert c.claim("u", "reward", ["x"], 4, ack=empty).num_rows == 0  # an empty lease: no ack


def test_wire_rules_for_the_claim_body():
    args = {"table": "t", "task": "r", "columns": ["a"], "max_rows": 4}
    body = wire.write_batch(pa.record_batch({"a": pa.array(np.arange(4))}))
    with pytest.raises(BadRequest, match="ack_lease_id"):
        wire.decode_request(wire.encode_request("claim", 1, args, [body]))
    with pytest.raises(BadRequest, match="body"):
        wire.decode_request(
            wire.encode_request("claim", 1, {**args, "ack_lease_id": 5}, [body] * 2)
        )
    with pytest.raises(BadRequest, match="claim.ack_lease_id"):
        wire.decode_request(wire.encode_request("claim", 1, {**args, "ack_lease_id": "5"}))
    req = wire.decode_request(wire.encode_request("claim", 1, {**args, "ack_lease_id": 5}, [body]))
    assert req.args["ack_lease_id"] == 5 and len(req.bodies) == 1
    assert wire.decode_request(wire.encode_request("claim", 1, args)).args["ack_lease_id"] is None
    err = wire.decode_reply(wire.encode_error(2, ShuttingDown("bye"), acked=True)).error
    assert isinstance(err, ShuttingDown) and err.acked is True


def test_multi_node_ack_goes_to_the_node_holding_the_lease(h):
    with (
        storage.embedded(node_index=0, tcp=True) as a,
        storage.embedded(node_index=1, tcp=True) as b,
    ):
        c = storage.connect([a.address, b.address])
        c.create_table(h.make_spec())
        c.put("t", h.make_rows(1), shard_id=1 << 8)  # only node 1 has rows
        lease = c.claim("t", "reward", ["x"], 4)
        assert lease.shard_id >> 8 == 1
        nxt = c.claim("t", "reward", ["x"], 4, ack=lease, write=_rewards(4, 2.0))
        assert nxt.num_rows == 0
        assert c.stats("t").task_total("reward").consumed == 4
        assert c.claim("t", "train", ["reward"], 4).batch.column("reward").to_pylist() == [2.0] * 4
        c.close()
