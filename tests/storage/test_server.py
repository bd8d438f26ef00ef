"""Server behaviour through real sockets (embedded server thread, same code path as the network):
long polls, parked puts, shutdown, typed errors, internal errors, metrics, CURVE, fsync."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request

import pyarrow as pa
import pytest
import zmq
from testkit import wait_until

import storage
from storage import wire
from storage.client import Client, CurveClientKeys
from storage.errors import (
    BadRequest,
    SchemaMismatch,
    ShuttingDown,
    StoreError,
    StoreFull,
    Unavailable,
    UnknownTable,
)
from storage.server import Server, ServerConfig


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_long_poll_claim_is_woken_by_put(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    waiter = embedded_store.client()
    t0 = time.monotonic()
    t, box = _in_thread(lambda: waiter.claim("t", "reward", ["x"], 64, timeout=60))
    wait_until(lambda: embedded_store.parked()["claims"] == 1, what="the claim to park")
    c.put("t", h.make_rows(2))
    t.join(30)
    lease = box["value"]
    assert lease.num_rows == 8 and time.monotonic() - t0 < 30
    assert lease.batch.schema.names == ["x", "row_id", "deliveries"]


def test_parked_claim_on_one_shard_is_woken_though_one_on_another_shard_stays_dry(
    embedded_store, h
):
    """Parked claims limited to different shards (a balanced consumer's owned shards): the one
    parked first finds its shard empty, which must not keep the put's shard's claim parked.
    (The retry used to mark the whole task dry after the first empty claim, so the second one
    waited for its timeout.)"""
    c = embedded_store.client()
    c.create_table(h.make_spec())
    first, second = embedded_store.client(), embedded_store.client()
    t_first, box_first = _in_thread(
        lambda: first.claim("t", "reward", ["x"], 64, timeout=20, shards=[0])
    )
    wait_until(lambda: embedded_store.parked()["claims"] == 1)  # the shard-0 claim parks first
    t0 = time.monotonic()
    t_second, box_second = _in_thread(
        lambda: second.claim("t", "reward", ["x"], 64, timeout=20, shards=[1])
    )
    wait_until(lambda: embedded_store.parked()["claims"] == 2)
    c.put("t", h.make_rows(2), shard_id=1)
    t_second.join(30)
    lease = box_second["value"]
    assert lease.num_rows == 8 and lease.shard_id == 1
    assert time.monotonic() - t0 < 10, "woken by its timeout, not by the put"
    assert "value" not in box_first  # its shard is still empty: still parked
    c.put("t", h.make_rows(1, start_gid=10), shard_id=0)
    t_first.join(30)
    assert box_first["value"].num_rows == 4 and box_first["value"].shard_id == 0


def test_claim_timeout_gives_empty_lease_with_schema(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    lease = c.claim("t", "train", ["x", "reward"], 8, timeout=0.1)
    assert lease.num_rows == 0 and lease.lease_id == 0
    assert lease.batch.schema.field("reward").type == pa.float32()
    c.ack(lease)  # an empty lease needs no ack: a no-op


def test_empty_lease_schema_follows_a_recreated_table(embedded_store, h):
    """Empty-lease bodies are cached per (table, columns): a table dropped and created again
    with another schema must answer with the new one."""
    c = embedded_store.client()
    c.create_table(h.make_spec())
    assert c.claim("t", "train", ["x", "reward"], 8).batch.schema.field("reward").type == (
        pa.float32()
    )
    c.drop_table("t")
    schema = pa.schema([("gid", pa.int64()), ("x", pa.list_(pa.int32())), ("reward", pa.float64())])
    c.create_table(dataclasses.replace(h.make_spec(), schema=schema))
    lease = c.claim("t", "train", ["x", "reward"], 8)
    assert lease.num_rows == 0 and lease.batch.schema.field("reward").type == pa.float64()


def test_min_rows_waits_then_takes_what_is_ready_at_timeout(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.put("t", h.make_rows(1))
    lease = c.claim("t", "reward", ["x"], 64, min_rows=16, timeout=0.2)
    assert lease.num_rows == 4


def test_parked_put_waits_for_capacity(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec(capacity_rows=8))
    c.put("t", h.make_rows(2))
    with pytest.raises(StoreFull):
        c.put("t", h.make_rows(1, start_gid=10), timeout=0)
    with pytest.raises(StoreFull):
        c.put("t", h.make_rows(1, start_gid=10), timeout=0.1)
    producer = embedded_store.client()
    t, box = _in_thread(lambda: producer.put("t", h.make_rows(1, start_gid=20), timeout=60))
    wait_until(lambda: embedded_store.parked()["puts"] == 1, what="the put to park")
    assert "value" not in box  # still parked: the table is full
    # Consume everything with both tasks: the rows are freed and the parked put goes in.
    lease = c.claim("t", "reward", ["x"], 8)
    c.write("t", lease, pa.record_batch({"reward": pa.array([1.0] * 8, pa.float32())}), ack=True)
    train = c.claim("t", "train", ["x", "reward"], 8, whole_groups=True)
    c.ack(train)
    t.join(30)
    assert len(box["value"]) == 4
    assert sum(s.rows for s in c.stats("t").shards) == 4


def test_lease_expiry_timer_wakes_parked_claim(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec(lease_seconds=0.3))
    c.put("t", h.make_rows(1))
    first = c.claim("t", "reward", ["x"], 8)
    again = c.claim("t", "reward", ["x"], 8, timeout=30)  # woken by the expiry, not the timeout
    assert sorted(again.row_ids) == sorted(first.row_ids)
    assert again.batch.column("deliveries").to_pylist() == [2] * 4
    assert c.stats("t").task_total("reward").redelivered_total == 4


def test_shutdown_answers_parked_claims(h):
    store = storage.embedded()
    c = store.client()
    c.create_table(h.make_spec())
    waiter = store.client()
    t, box = _in_thread(lambda: waiter.claim("t", "reward", ["x"], 8, timeout=60))
    wait_until(lambda: store.parked()["claims"] == 1, what="the claim to park")
    store.server.stop()
    t.join(30)
    assert isinstance(box.get("error"), ShuttingDown)
    store.close()


def test_typed_errors_and_server_keeps_serving(embedded_store, h):
    c = embedded_store.client()
    with pytest.raises(UnknownTable):
        c.stats("nope")
    c.create_table(h.make_spec())
    bad = pa.record_batch({"gid": pa.array([1, 1, 1, 1], pa.int64()), "x": pa.array([1, 2, 3, 4])})
    with pytest.raises(SchemaMismatch):
        c.put("t", bad)
    with pytest.raises(BadRequest):
        c.claim("t", "reward", ["no_such_column"], 8)
    assert len(c.put("t", h.make_rows(1))) == 4


def test_handler_crash_becomes_internal_error(embedded_store, h, monkeypatch):
    c = embedded_store.client()
    c.create_table(h.make_spec())

    def boom(table):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(embedded_store.server.node, "stats", boom)
    with pytest.raises(StoreError, match="kaboom") as ei:
        c.stats("t")
    assert ei.value.code == "store_error"  # "internal" maps to the base class on the client
    monkeypatch.undo()
    assert c.stats("t").table == "t"


def test_metrics_endpoint(h):
    with storage.embedded(num_shards=2, metrics_port=0) as store:
        store.server.config.metrics_interval_s = 0.0
        c = store.client()
        c.create_table(h.make_spec())
        c.put("t", h.make_rows(3))
        lease = c.claim("t", "reward", ["x"], 4)
        c.ack(lease)
        c.stats("t")  # one more loop round refreshes the gauges
        url = f"http://127.0.0.1:{store.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'streamflow_store_rows_put_total{table="t"} 12.0' in text
    assert 'streamflow_store_rows_acked_total{table="t",task="reward"} 4.0' in text
    assert 'streamflow_store_request_duration_seconds_count{verb="put"} 1.0' in text
    assert "streamflow_store_queue_depth_rows{" in text and "streamflow_store_memory_bytes{" in text
    assert "streamflow_store_bytes_received_total" in text


def test_fsync_always_syncs_before_acknowledging(h, tmp_path, monkeypatch):
    with storage.embedded(persist_dir=str(tmp_path)) as store:
        node = store.server.node
        calls = []
        real_sync = node.sync
        monkeypatch.setattr(node, "sync", lambda: (calls.append(1), real_sync())[1])
        c = store.client()
        c.create_table(h.make_spec(fsync="always"))
        before = len(calls)
        c.put("t", h.make_rows(1))
        assert len(calls) > before


def test_curve_allows_listed_clients_only(h):
    server_pub, server_sec = zmq.curve_keypair()
    good_pub, good_sec = zmq.curve_keypair()
    bad_pub, bad_sec = zmq.curve_keypair()
    ctx = zmq.Context()
    cfg = ServerConfig(bind=("tcp://127.0.0.1:0",), curve_secret_key=server_sec,
                       curve_public_key=server_pub, curve_allowed_clients=(good_pub,))
    server = Server(cfg, context=ctx).start()
    try:
        good = Client(server.addresses[0], context=ctx,
                      curve=CurveClientKeys(good_pub, good_sec, server_pub))
        assert good.tables() == []
        bad = Client(server.addresses[0], context=ctx, request_timeout=0.5,
                     curve=CurveClientKeys(bad_pub, bad_sec, server_pub))
        with pytest.raises(Unavailable):
            bad.tables()
        plain = Client(server.addresses[0], context=ctx, request_timeout=0.5)
        with pytest.raises(Unavailable):
            plain.tables()
        assert good.tables() == []  # still serving the allowed client
        for cl in (good, bad, plain):
            cl.close()
    finally:
        server.stop()
        ctx.term()


def test_server_process_cli_serves_and_stops_on_sigterm(store_node, h):
    with storage.connect(store_node.address) as c:
        c.create_table(h.make_spec())
        assert len(c.put("t", h.make_rows(1))) == 4
    assert store_node.stop() == 0


def test_cancel_ends_a_parked_claim_with_an_empty_lease(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    sock = embedded_store.context.socket(zmq.DEALER)
    sock.connect(embedded_store.address)
    args = {"table": "t", "task": "reward", "columns": ["x"], "max_rows": 8, "timeout": 60.0}
    sock.send_multipart(wire.encode_request("claim", 11, args))
    wait_until(lambda: embedded_store.parked()["claims"] == 1, what="the claim to park")
    sock.send_multipart(wire.encode_request("cancel", 12, {"target": 11}))
    replies = {}
    for _ in range(2):
        assert sock.poll(10_000)
        r = wire.decode_reply(sock.recv_multipart())
        replies[r.req_id] = r
    assert replies[12].result["cancelled"] is True
    assert replies[11].ok and replies[11].result["lease_id"] == 0
    sock.close(0)


def test_lease_for_a_vanished_consumer_is_handed_back_at_once(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec(lease_seconds=600.0))
    gone = embedded_store.context.socket(zmq.DEALER)
    gone.connect(embedded_store.address)
    args = {"table": "t", "task": "reward", "columns": ["x"], "max_rows": 8, "timeout": 60.0}
    gone.send_multipart(wire.encode_request("claim", 1, args))
    wait_until(lambda: embedded_store.parked()["claims"] == 1, what="the claim to park")
    gone.close(0)  # the consumer disappears while its claim is parked
    # ZeroMQ tears the closed peer's pipe down on the server socket's own thread, with nothing
    # observable from here: give it a moment, so that the reply below finds no route.
    time.sleep(0.2)
    c.put("t", h.make_rows(1))  # the parked claim is served, its reply is undeliverable
    lease = c.claim("t", "reward", ["x"], 8, timeout=10)  # long before the 600 s deadline
    assert lease.num_rows == 4
