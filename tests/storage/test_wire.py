"""Unit tests of storage/wire.py: header validation, limits, Arrow bodies, spec/stats encodings."""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pytest

from storage import wire
from storage.errors import BadRequest, LeaseExpired, StoreFull, UnknownLease
from storage.schema import ShardStats, TableSpec, TableStats, TaskSpec, TaskStats


def _req(verb: str, **args):
    return wire.encode_request(verb, 7, args)


def test_claim_request_round_trip_fills_defaults():
    frames = _req("claim", table="t", task="reward", columns=["a"], max_rows=64)
    req = wire.decode_request(frames)
    assert req.verb == "claim" and req.req_id == 7
    assert req.args["min_rows"] == 1 and req.args["whole_groups"] is False
    assert req.args["timeout"] == 0.0 and req.args["shards"] is None


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"table": "t", "task": "r", "columns": ["a"]}, "max_rows"),  # missing
        ({"table": 5, "task": "r", "columns": ["a"], "max_rows": 1}, "claim.table"),
        ({"table": "t", "task": "r", "columns": "a", "max_rows": 1}, "claim.columns"),
        ({"table": "t", "task": "r", "columns": [1], "max_rows": 1}, "columns[0]"),
        ({"table": "t", "task": "r", "columns": ["a"], "max_rows": True}, "max_rows"),
        ({"table": "t", "task": "r", "columns": ["a"], "max_rows": 0}, "max_rows"),
        ({"table": "t", "task": "r", "columns": ["a"], "max_rows": 1, "timeout": -1}, "timeout"),
        ({"table": "t", "task": "r", "columns": ["a"], "max_rows": 1, "timeout": float("nan")},
         "timeout"),
        ({"table": "t", "task": "r", "columns": ["a"], "max_rows": 1, "bogus": 1}, "bogus"),
        ({"table": "", "task": "r", "columns": ["a"], "max_rows": 1}, "claim.table"),
        ({"table": "t" * 300, "task": "r", "columns": ["a"], "max_rows": 1}, "claim.table"),
    ],
)
def test_bad_claim_headers_name_the_field(args, needle):
    with pytest.raises(BadRequest, match=needle.replace("[", r"\[").replace("]", r"\]")) as ei:
        wire.decode_request(wire.encode_request("claim", 9, args))
    assert ei.value.req_id == 9


def test_unknown_verb_version_and_req_id():
    with pytest.raises(BadRequest, match="verb"):
        wire.decode_request(_req("explode"))
    with pytest.raises(BadRequest, match="'v'"):
        wire.decode_request([msgpack.packb({"v": 99, "verb": "hello", "req_id": 1})])
    with pytest.raises(BadRequest, match="req_id"):
        wire.decode_request([msgpack.packb({"v": 1, "verb": "hello", "req_id": -1})])
    with pytest.raises(BadRequest, match="req_id"):
        wire.decode_request([msgpack.packb({"v": 1, "verb": "hello", "req_id": "x"})])


def test_header_must_be_bounded_msgpack_map():
    with pytest.raises(BadRequest, match="map"):
        wire.decode_request([msgpack.packb([1, 2, 3])])
    with pytest.raises(BadRequest, match="msgpack"):
        wire.decode_request([b"\x81\xa1"])  # truncated
    with pytest.raises(BadRequest, match="ext"):
        wire.decode_request([msgpack.packb({"v": msgpack.ExtType(1, b"x")})])
    deep: object = 1
    for _ in range(50):
        deep = [deep]
    with pytest.raises(BadRequest, match="nesting"):
        wire.decode_request([msgpack.packb({"v": 1, "verb": "hello", "req_id": 1, "x": deep})])
    with pytest.raises(BadRequest, match="msgpack"):  # deeper than msgpack's own stack
        wire.decode_request([b"\x91" * 5000 + b"\x00"])
    with pytest.raises(BadRequest, match="header frame is"):
        wire.decode_request([b"\x80" + b"\x00" * (wire.MAX_HEADER_BYTES + 1)])
    # A declared length far beyond the frame: refused by the limits, no allocation.
    with pytest.raises(BadRequest, match="msgpack"):
        wire.decode_request([b"\xdb\xff\xff\xff\xf0abc"])


def test_body_count_is_checked():
    with pytest.raises(BadRequest, match="body"):
        wire.decode_request(_req("put", table="t"))
    with pytest.raises(BadRequest, match="body"):
        wire.decode_request([*_req("stats", table="t"), b"extra"])


def test_arrow_body_round_trip_and_invalid_bytes():
    batch = pa.record_batch({"a": pa.array(np.arange(10, dtype=np.int32)), "b": [[1.0]] * 10})
    buf = wire.write_batch(batch)
    assert wire.read_batch(buf).equals(batch)
    with pytest.raises(BadRequest, match="Arrow"):
        wire.read_batch(b"not arrow at all")
    with pytest.raises(BadRequest, match="Arrow"):
        wire.read_batch(buf.to_pybytes()[: len(buf) // 2])
    two = pa.BufferOutputStream()
    with pa.ipc.new_stream(two, batch.schema) as w:
        w.write_batch(batch)
        w.write_batch(batch)
    with pytest.raises(BadRequest, match="exactly one"):
        wire.read_batch(two.getvalue())


def test_arrow_body_with_corrupt_offsets_fails_full_validation():
    arr = pa.array(["ab", "cd", "ef"])
    validity, offsets, data = arr.buffers()
    bad_offsets = np.frombuffer(offsets, dtype=np.int32).copy()
    bad_offsets[2] = 1_000_000  # points far past the data buffer
    bad = pa.Array.from_buffers(pa.string(), 3, [validity, pa.py_buffer(bad_offsets), data])
    buf = wire.write_batch(pa.RecordBatch.from_arrays([bad], names=["s"]))
    with pytest.raises(BadRequest):
        wire.read_batch(buf)


def test_error_reply_rebuilds_typed_error():
    for exc in (StoreFull("full!"), UnknownLease("gone"), LeaseExpired("late")):
        reply = wire.decode_reply(wire.encode_error(3, exc))
        assert not reply.ok and reply.req_id == 3
        assert type(reply.error) is type(exc) and str(reply.error) == str(exc)
    ok = wire.decode_reply(wire.encode_reply(4, {"x": 1}, [b"body"]))
    assert ok.ok and ok.result == {"x": 1} and ok.bodies[0].to_pybytes() == b"body"


def test_row_ids_bytes():
    ids = np.array([1, 2**63 + 5, (3 << 48) | 9], dtype=np.uint64)
    assert (wire.row_ids_from_bytes(wire.row_ids_to_bytes(ids)) == ids).all()
    with pytest.raises(BadRequest):
        wire.row_ids_from_bytes(b"123")


def _spec() -> TableSpec:
    schema = pa.schema([("gid", pa.int64()), ("x", pa.list_(pa.int32())), ("r", pa.float32())])
    return TableSpec("t", schema, (TaskSpec("reward", ("x",)), TaskSpec("train", ("x", "r"), True)),
                     group_column="gid", group_size=4, capacity_rows=100)


def test_spec_round_trip_through_msgpack():
    spec = _spec()
    data = msgpack.unpackb(msgpack.packb(wire.spec_to_wire(spec), use_bin_type=True), raw=False)
    assert wire.spec_from_wire(data) == spec


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.pop("schema"), "schema"),
        (lambda d: d.update(schema=b"garbage"), "schema"),
        (lambda d: d.update(capacity_rows="many"), "capacity_rows"),
        (lambda d: d.update(tasks=[{"name": "x"}]), "tasks"),
        (lambda d: d.update(tasks=[{"name": "x", "needs": [3]}]), "needs"),
        (lambda d: d.update(extra=1), "extra"),
    ],
)
def test_bad_spec_is_refused(mutate, needle):
    data = wire.spec_to_wire(_spec())
    mutate(data)
    with pytest.raises(BadRequest, match=needle):
        wire.spec_from_wire(data)


def test_stats_round_trip_and_merge():
    a = TableStats("t", [ShardStats(1, 10, 100, {"r": TaskStats(1, 2, 3, 4, 5, 6, {"x": 5})})])
    b = TableStats("t", [ShardStats(0, 1, 1, {"r": TaskStats(ready=7)})])
    got = [wire.stats_from_wire(msgpack.unpackb(msgpack.packb(wire.stats_to_wire(s)))) for s in (a, b)]
    assert got[0] == a
    merged = wire.merge_stats(got)
    assert [s.shard_id for s in merged.shards] == [0, 1]
    assert merged.task_total("r").ready == 9 and merged.task_total("r").dead_reasons == {"x": 5}
