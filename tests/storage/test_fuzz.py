"""Fuzzing the wire of a real store node process: every hostile message gets a typed error reply
(or, past MAXMSGSIZE, is dropped by ZeroMQ), nothing is executed, and the node keeps serving a
well-behaved client afterwards. Bounded: a fixed list plus a capped number of hypothesis cases."""

from __future__ import annotations

import os
import pickle

import msgpack
import pyarrow as pa
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import storage
from storage import wire
from storage.errors import StoreError
from storage.server import Server, ServerConfig


class _Dropper:
    """Unpickling this would create a file (the test asserts it never appears)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Raw:
    """A raw DEALER speaking (or not) the wire format."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frames: list, timeout_ms: int = 10_000) -> wire.Reply:
        self.sock.send_multipart(frames)
        while True:
            assert self.sock.poll(timeout_ms), "no reply: the server hung or died"
            reply = wire.decode_reply(self.sock.recv_multipart())
            if not reply.result.get("probe"):  # the node's liveness probe (parked requests)
                return reply

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def node(store_node, h):
    with storage.connect(store_node.address) as c:
        c.create_table(h.make_spec())
    raw = Raw(store_node.address)
    yield store_node, raw
    raw.close()


def _well_behaved(address: str, h) -> None:
    with storage.connect(address, request_timeout=10) as c:
        ids = c.put("t", h.make_rows(1, start_gid=os.getpid() % 1000))
        lease = c.claim("t", "reward", ["x"], 64)
        assert len(ids) == 4 and lease.num_rows >= 4
        c.release(lease)


def _hdr(verb: str, **fields) -> bytes:
    return msgpack.packb({"v": 1, "verb": verb, "req_id": 5, **fields}, use_bin_type=True)


def test_hostile_messages_get_typed_errors(node, h, tmp_path):
    store, raw = node
    marker = tmp_path / "pwned"
    pickled = pickle.dumps(_Dropper(str(marker)))
    arrow_ok = wire.write_batch(h.make_rows(1)).to_pybytes()
    cases = [
        ("truncated header", [b"\x85\xa1v\x01\xa4ve"], "bad_request"),
        ("truncated arrow", [_hdr("put", table="t"), arrow_ok[: len(arrow_ok) // 3]], "bad_request"),
        ("wrong type", [_hdr("claim", table=["t"], task="reward", columns=["x"], max_rows=1)],
         "bad_request"),
        ("missing field", [_hdr("claim", table="t", task="reward", max_rows=1)], "bad_request"),
        ("huge declared str", [b"\x81\xdb\xff\xff\xff\xf0abc"], "bad_request"),
        ("huge declared array", [b"\xdd\xff\xff\xff\xff"], "bad_request"),
        ("invalid arrow", [_hdr("put", table="t"), b"\xff\xff\xff\xff" + b"\x00" * 64],
         "bad_request"),
        ("pickle header", [pickled], "bad_request"),
        ("pickle body", [_hdr("put", table="t"), pickled], "bad_request"),
        ("pickle in spec", [_hdr("create_table", spec={"name": "p", "schema": pickled,
                                                       "tasks": []})], "bad_request"),
        ("deep nesting", [_hdr("stats", table="t", x=_nest(200))], "bad_request"),
        ("msgpack stack bomb", [b"\x91" * 100_000 + b"\xc0"], "bad_request"),
        ("ext type", [msgpack.packb({"v": msgpack.ExtType(5, b"\x00" * 8)})], "bad_request"),
        ("not a map", [msgpack.packb("hello")], "bad_request"),
        ("unknown verb", [_hdr("exec", cmd="rm -rf /")], "bad_request"),
        ("bool as int", [_hdr("ack", table="t", lease_id=True)], "bad_request"),
        ("negative lease id", [_hdr("ack", table="t", lease_id=-1)], "bad_request"),
        ("unknown lease", [_hdr("ack", table="t", lease_id=12345)], "unknown_lease"),
        ("schema mismatch", [_hdr("put", table="t"),
                             wire.write_batch(pa.record_batch({"zzz": [1]})).to_pybytes()],
         "schema_mismatch"),
        ("extra frames", [_hdr("stats", table="t"), b"a", b"b"], "bad_request"),
        ("empty header", [b""], "bad_request"),
    ]
    for name, frames, code in cases:
        reply = raw.ask(frames)
        assert not reply.ok, name
        assert reply.error.code == code, (name, reply.error)
    assert not marker.exists(), "a pickle payload was executed"
    _well_behaved(store.address, h)


def _nest(depth: int) -> object:
    obj: object = 0
    for _ in range(depth):
        obj = {"a": obj}
    return obj


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
_value = st.recursive(_scalar, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
_field = st.sampled_from(["table", "task", "columns", "max_rows", "min_rows", "timeout",
                          "lease_id", "spec", "whole_groups", "seconds", "error", "target",
                          "shard_id", "dead", "ack", "junk"])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(verb=st.sampled_from([*wire.VERBS, "nope"]),
       fields=st.dictionaries(_field, _value, max_size=6),
       body=st.one_of(st.none(), st.binary(max_size=64)))
def test_random_headers_never_break_the_server(shared_fuzz_node, verb, fields, body):
    raw = shared_fuzz_node
    header = {"v": 1, "verb": verb, "req_id": 77, **fields}
    if verb == "drop_table":
        header["table"] = "not-t"  # keep the table the well-behaved client uses
    frames = [msgpack.packb(header, use_bin_type=True)] + ([body] if body is not None else [])
    reply = raw.ask(frames)
    assert reply.req_id == 77
    assert reply.ok or reply.error.code != "internal", reply.error


# Edge values of every header field: empty lists, lists of bad items, zero, negative, huge and
# non-finite numbers, empty and over-long strings, wrong container types.
_EDGES = [[], [[]], [""], [-1], [70_000], 0, -1, 2**63, 2**64 - 1, 1e308, float("inf"),
          float("nan"), -0.0, "", "x" * 300, None, {}, True, b"\x00"]
_BASE = {
    "claim": {"table": "t", "task": "reward", "columns": ["x"], "max_rows": 4},
    "put": {"table": "t"},
    "write": {"table": "t"},
    "ack": {"table": "t", "lease_id": 1},
    "extend": {"table": "t", "lease_id": 1},
    "release": {"table": "t", "lease_id": 1},
    "cancel": {"target": 1},
    "drop_table": {"table": "not-t"},
}


def test_every_header_field_edge_value_gets_a_typed_reply(shared_fuzz_node, h):
    """Each field of each verb, one edge value at a time, on an otherwise valid request: the
    reply is ok or a typed error, never ``internal`` (e.g. ``claim.shards: []`` was)."""
    raw = shared_fuzz_node
    body = wire.write_batch(h.make_rows(1, start_gid=900)).to_pybytes()
    seen = 0
    for verb, rules in wire.VERBS.items():
        for name in rules:
            for value in _EDGES:
                header = {"v": 1, "verb": verb, "req_id": 41, **_BASE.get(verb, {}), name: value}
                if verb in ("claim", "put"):
                    header.setdefault("timeout", 0.0)  # never park: one reply per request
                bodies = [body] if verb == "put" else []
                reply = raw.ask([msgpack.packb(header, use_bin_type=True), *bodies])
                assert reply.req_id == 41
                assert reply.ok or type(reply.error) is not StoreError, (verb, name, value,
                                                                         reply.error)
                seen += 1
    assert seen > 500
    spec = wire.spec_to_wire(h.make_spec("edge"))
    for i, (key, value) in enumerate((k, v) for k in spec for v in _EDGES + [2**50]):
        bad = {**spec, "name": f"edge{i}"}
        bad[key] = value
        reply = raw.ask([msgpack.packb({"v": 1, "verb": "create_table", "req_id": 42,
                                        "spec": bad}, use_bin_type=True)])
        assert reply.ok or type(reply.error) is not StoreError, (key, value, reply.error)
        if reply.ok:  # an edge value that is valid: leave only "t" on the shared node
            raw.ask([msgpack.packb({"v": 1, "verb": "drop_table", "req_id": 43,
                                    "table": bad["name"]})])


@pytest.fixture(scope="module")
def shared_fuzz_node(tmp_path_factory, h):
    # Module-scoped: one node process serves every hypothesis example.
    proc = h.StoreProcess(tmp_path_factory.mktemp("fuzz")).start()
    with storage.connect(proc.address) as c:
        c.create_table(h.make_spec())
    raw = Raw(proc.address)
    yield raw
    raw.close()
    with storage.connect(proc.address, request_timeout=10) as c:
        assert c.tables() == ["t"]  # still serving after every example
    assert proc.stop() == 0  # and shuts down cleanly


def test_message_over_maxmsgsize_is_dropped_and_server_keeps_serving(h):
    ctx = zmq.Context()
    server = Server(ServerConfig(bind=("tcp://127.0.0.1:0",), max_message_bytes=1 << 20),
                    context=ctx).start()
    try:
        raw = Raw(server.addresses[0])
        raw.sock.send_multipart([_hdr("stats", table="t"), b"\x00" * (2 << 20)])
        assert not raw.sock.poll(500)  # dropped by ZeroMQ: no reply, no crash
        raw.close()
        with storage.connect(server.addresses[0], context=ctx, request_timeout=10) as c:
            c.create_table(h.make_spec())
            assert c.tables() == ["t"]
    finally:
        server.stop()
        ctx.term()
