"""What an outside client must not be able to do to a store node, and what a node must do by
itself: server paths stay the node's, lease ids never repeat across restarts, parked requests are
bounded (bytes of puts, requests per peer) and dropped when their peer is gone, and a node with a
persistence root serves its tables again as soon as it starts. Every wait here is bounded."""

from __future__ import annotations

import logging
import os

import msgpack
import pytest
import zmq
from testkit import wait_until

import storage
from storage import node as node_mod
from storage import wire
from storage.errors import BadRequest, TooManyWaiting, UnknownLease
from storage.node import StoreNode
from storage.server import Server, ServerConfig


def _raw(address: str, ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _reply(sock: zmq.Socket, timeout_ms: int = 10_000) -> wire.Reply:
    """The next reply that is not a liveness probe."""
    while True:
        assert sock.poll(timeout_ms), "no reply"
        reply = wire.decode_reply(sock.recv_multipart())
        if not reply.result.get("probe"):
            return reply


# -- 1: paths --------------------------------------------------------------------------------------


def test_a_client_can_neither_choose_nor_delete_a_server_path(tmp_path, h):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    root = tmp_path / "root"
    ctx = zmq.Context()
    server = Server(
        ServerConfig(bind=("tcp://127.0.0.1:0",), persist_dir=str(root)), context=ctx
    ).start()
    try:
        raw = _raw(server.addresses[0], ctx)
        spec = wire.spec_to_wire(h.make_spec("t"))
        spec["persist_dir"] = str(victim)  # what the documented API used to accept
        raw.send_multipart([wire.pack_header({"v": 1, "verb": "create_table", "req_id": 1,
                                              "spec": spec})])
        reply = _reply(raw)
        assert not reply.ok and reply.error.code == "bad_request"
        assert "persist_dir" in str(reply.error)
        raw.close()
        assert not (victim / "t").exists()
        with pytest.raises(TypeError):
            h.make_spec(persist_dir=str(victim))  # not even a field of the spec any more
        with storage.connect(server.addresses[0], context=ctx, request_timeout=10) as c:
            # A directory under the root that the store did not create is neither adopted ...
            (root / "u").mkdir()
            (root / "u" / "precious.txt").write_text("keep")
            with pytest.raises(BadRequest, match="not created by the store"):
                c.create_table(h.make_spec("u"))
            os.symlink(victim, root / "v")  # ... nor followed
            with pytest.raises(BadRequest, match="symlink"):
                c.create_table(h.make_spec("v"))
            for name in ("..", ".hidden", "a/b"):
                with pytest.raises(BadRequest):
                    c.create_table(h.make_spec(name))
            # drop_table removes what the store wrote and nothing else.
            c.create_table(h.make_spec("t"))
            c.put("t", h.make_rows(2))
            (root / "t" / "notes.txt").write_text("mine")
            c.drop_table("t")
            assert sorted(os.listdir(root / "t")) == ["notes.txt"]  # marker gone: not ours
            with pytest.raises(BadRequest, match="not created by the store"):
                c.create_table(h.make_spec("t"))
            c.create_table(h.make_spec("w"))
            c.drop_table("w")
            assert not (root / "w").exists()
    finally:
        server.stop()
        ctx.destroy(linger=0)
    assert (victim / "precious.txt").read_text() == "keep"
    assert (root / "u" / "precious.txt").read_text() == "keep"


# -- 2: lease ids across restarts --------------------------------------------------------------------


def test_lease_ids_never_repeat_across_restarts_even_when_the_random_epoch_collides(
    tmp_path, h, monkeypatch
):
    monkeypatch.setattr(node_mod, "_random_epoch", lambda: 7)  # every incarnation draws 7
    root = str(tmp_path)
    first = StoreNode(0, 1, persist_root=root)
    first.create_table(h.make_spec())
    first.put("t", h.make_rows(2))
    old = first.claim("t", "reward", ["x"], 4)
    del first  # a crash: nothing closed
    second = StoreNode(0, 1, persist_root=root)  # recovers "t"; its rows come back READY
    new = [second.claim("t", "reward", ["x"], 4) for _ in range(2)]
    assert old.lease_id not in {lease.lease_id for lease in new}
    with pytest.raises(UnknownLease):  # the zombie's lease names nothing
        second.ack("t", old.lease_id)
    second.close()
    epochs = []
    for _ in range(4):
        node = StoreNode(0, 1, persist_root=root)
        epochs.append(node.epoch)
        node.close()
    assert epochs == sorted(set(epochs)) and epochs[0] > 1  # strictly increasing
    # The 32-bit counter running out moves the node to a new epoch, again without repeats.
    node = StoreNode(0, 1, persist_root=root)
    node._lease_counter = (1 << node_mod.LEASE_COUNTER_BITS) - 2
    ids = [node.claim("t", "reward", ["x"], 1).lease_id for _ in range(3)]
    assert len(set(ids)) == 3 and ids[2] >> 32 == epochs[-1] + 2
    assert all(0 < i < 1 << 63 for i in ids)
    node.close()


# -- 3: bytes held by parked puts ---------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _settled_peak_rss(pid: int, timeout: float = 30.0) -> int:
    """The highest RSS seen until it stays within 1 MiB for a second (the node has read what
    was sent to it)."""
    peak, window = 0, []

    def settled() -> bool:
        nonlocal peak, window
        rss = _rss_bytes(pid)
        peak, window = max(peak, rss), [*window[-9:], rss]
        return len(window) == 10 and max(window) - min(window) < 1 << 20

    try:
        wait_until(settled, timeout, interval=0.1, what="the node's RSS to settle")
    except AssertionError:
        pass  # still moving at the timeout: the peak so far is the answer
    return peak


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_parked_put_bytes_are_bounded_per_node(store_factory, h, monkeypatch):
    limit = 8 << 20
    # Freed message buffers go back to the OS at once, so RSS shows what the node holds, not
    # what the allocator caches.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    node = store_factory(extra=("--max-parked-bytes", str(limit))).start()
    big = h.make_rows(1, width=1 << 16)  # 4 rows x 64 Ki int32 = 1 MiB
    with storage.connect(node.address, request_timeout=30) as c:
        c.create_table(h.make_spec(capacity_bytes=big.get_total_buffer_size() * 3 // 2))
        c.put("t", big)  # the table is now full
    ctx = zmq.Context()
    raw = _raw(node.address, ctx)
    body = wire.write_batch(big)
    before = _settled_peak_rss(node.proc.pid)
    n = 200  # 200 MiB pipelined without waiting for any reply
    for i in range(n):
        raw.send_multipart([wire.pack_header({"v": 1, "verb": "put", "req_id": i + 1,
                                              "table": "t", "timeout": 600.0}), body],
                           copy=False)
    grown = _settled_peak_rss(node.proc.pid) - before
    refused = 0
    while refused < n - limit // body.size:
        reply = _reply(raw, 60_000)
        assert not reply.ok and reply.error.code == "store_full", reply.error
        assert "max_parked_bytes" in str(reply.error)
        refused += 1
    with pytest.raises(AssertionError):
        _reply(raw, 300)  # the rest wait (at most `limit` bytes of them)
    raw.close()
    ctx.destroy(linger=0)
    assert grown < 64 << 20, f"node RSS grew {grown >> 20} MiB for {n} MiB of pipelined puts"
    assert node.stop() == 0  # the parked ones are answered ShuttingDown; it stops by itself


# -- 4: recovery at start -------------------------------------------------------------------------


def test_a_node_with_a_persistence_root_serves_its_tables_at_start(tmp_path, h, caplog):
    ctx = zmq.Context()
    cfg = ServerConfig(bind=("tcp://127.0.0.1:0",), persist_dir=str(tmp_path), metrics_port=0)
    server = Server(cfg, context=ctx).start()
    with storage.connect(server.addresses[0], context=ctx, request_timeout=10) as c:
        c.create_table(h.make_spec("a"))
        c.create_table(h.make_spec("b", fsync="interval"))
        c.put("a", h.make_rows(3))
        c.put("b", h.make_rows(1))
    server.stop()
    caplog.set_level(logging.INFO, logger="storage.node")
    server = Server(cfg, context=ctx).start()
    try:
        with storage.connect(server.addresses[0], context=ctx, request_timeout=10) as c:
            assert sorted(c.tables()) == ["a", "b"]  # without any create_table
            assert sum(s.rows for s in c.stats("a").shards) == 12
            assert c.claim("b", "reward", ["x"], 8).num_rows == 4
            c.create_table(h.make_spec("b", fsync="interval"))  # the same spec: a no-op
        assert "table a recovered" in caplog.text and "table b recovered" in caplog.text
        value = server.metrics.registry.get_sample_value
        assert value("streamflow_store_recovered_tables") == 2
        assert value("streamflow_store_recovered_rows", {"table": "a"}) == 12
    finally:
        server.stop()
        ctx.destroy(linger=0)


# -- 5: parked claims of peers that are gone -------------------------------------------------------


def test_parked_requests_are_bounded_per_peer_and_dropped_when_the_peer_is_gone(h):
    ctx = zmq.Context()
    cfg = ServerConfig(bind=("tcp://127.0.0.1:0",), max_parked_per_peer=16,
                       peer_probe_interval_s=0.1)
    server = Server(cfg, context=ctx).start()
    try:
        address = server.addresses[0]
        with storage.connect(address, context=ctx, request_timeout=10) as c:
            c.create_table(h.make_spec())
            c.create_table(h.make_spec("full", capacity_rows=4))
            c.put("full", h.make_rows(1))
        gone = _raw(address, ctx)
        claim = {"v": 1, "verb": "claim", "table": "t", "task": "reward", "columns": ["x"],
                 "max_rows": 4, "timeout": 3600.0}
        for i in range(15):
            gone.send_multipart([msgpack.packb({**claim, "req_id": i + 1})])
        put = {"v": 1, "verb": "put", "req_id": 99, "table": "full", "timeout": 3600.0}
        gone.send_multipart([msgpack.packb(put), wire.write_batch(h.make_rows(1, 7))])
        assert wait_until(lambda: server.parked()["claims"] == 15 and server.parked()["puts"] == 1)
        gone.send_multipart([msgpack.packb({**claim, "req_id": 50})])  # the 17th request
        reply = _reply(gone)
        assert reply.req_id == 50 and isinstance(reply.error, TooManyWaiting)
        # A live peer's parked claim is kept (it ignores the probes) and served later.
        live = storage.connect(address, context=ctx, request_timeout=10)
        box: dict = {}
        import threading

        waiter = threading.Thread(
            target=lambda: box.update(lease=live.claim("t", "reward", ["x"], 4, timeout=20))
        )
        waiter.start()
        assert wait_until(lambda: server.parked()["claims"] == 16)
        gone.close()  # the peer goes away: its 16 parked requests and their bytes are dropped
        assert wait_until(lambda: server.parked() == {"claims": 1, "puts": 0, "put_bytes": 0,
                                                 "peers": 1}, timeout=5.0), server.parked()
        with storage.connect(address, context=ctx, request_timeout=10) as c:
            c.put("t", h.make_rows(1))
        waiter.join(20)
        assert box["lease"].num_rows == 4
        live.close()
    finally:
        server.stop()
        ctx.destroy(linger=0)
