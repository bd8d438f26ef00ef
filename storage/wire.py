"""The store's wire format: frame layout, header validation, Arrow and record encodings.

Owns the ZeroMQ frame layout, header decoding into the Structs of ``storage/headers.py``, the
limits on anything read from a socket (never pickle); layout, limits, guarantees: the doc."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np
import pyarrow as pa

from storage import headers
from storage.errors import BadRequest, StoreError, error_from_code
from storage.headers import PROTOCOL_VERSION
from storage.schema import TableSpec, TableStats, TaskSpec

MAX_HEADER_BYTES = 1 << 20
MAX_DEPTH = 8  # nesting of the header map (spec/stats are the deepest, at 5)
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

# Limits of the diagnostic decode of a refused header (``unpack_header``).
_UNPACK_LIMITS = dict(
    raw=False, strict_map_key=True, use_list=True, max_str_len=MAX_HEADER_BYTES,
    max_bin_len=MAX_HEADER_BYTES, max_array_len=1 << 16, max_map_len=1 << 12, max_ext_len=0,
)


def _no_ext(code: int, data: bytes) -> Any:
    raise BadRequest(f"msgpack ext type {code} is not allowed")


# verb -> its header fields (the Structs of storage/headers.py are the schema).
VERBS: dict[str, tuple[str, ...]] = headers.fields_by_verb(headers.STORE_HEADERS)
_DECODER = headers.decoder(headers.STORE_HEADERS)
# Verbs whose request carries Arrow bodies: verb -> (fewest, most); a claim's needs ack_lease_id.
BODY_COUNTS: dict[str, tuple[int, int]] = {"put": (1, 1), "write": (1, 1), "claim": (0, 1)}
# Verbs that change durable state: the server fsyncs (fsync="always") before replying to them.
MUTATING_VERBS = frozenset({"put", "write", "ack", "release", "clear", "create_table"})


def _depth(obj: Any) -> int:
    """Nesting depth of a decoded msgpack value, iteratively (no recursion on hostile input)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        cur, d = stack.pop()
        if isinstance(cur, dict | list):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (cur.values() if isinstance(cur, dict) else cur))
    return deepest


def unpack_header(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a header that failed typed decoding untyped, with strict limits, to name the fault
    (BadRequest for anything but a bounded map)."""
    try:
        obj = msgpack.unpackb(data, ext_hook=_no_ext, **_UNPACK_LIMITS)
    except BadRequest:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        what = f"{type(exc).__name__}: {exc}"
        raise BadRequest(f"header frame is not valid msgpack: {what}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"header frame must be a msgpack map, got {type(obj).__name__}")
    if _depth(obj) > MAX_DEPTH:
        raise BadRequest(f"header nesting deeper than {MAX_DEPTH}")
    return obj


def decode_header(frame: Any, decoder: msgspec.msgpack.Decoder, verbs: Any) -> Any:
    """A header frame -> its typed Struct, validated; else a BadRequest naming the fault, its
    ``.req_id`` the request's when readable (0 otherwise)."""
    data = _bytes_view(frame)
    if len(data) > MAX_HEADER_BYTES:
        raise BadRequest(f"header frame is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        failure = exc
    obj: dict[str, Any] = {}
    try:  # name the fault; framing faults (not msgpack, ext, nesting, not a map) first
        obj = unpack_header(data)
        if not isinstance(failure, msgspec.ValidationError):  # msgpack only the loose one reads
            raise BadRequest(f"header frame is not valid msgpack: {failure}")
        verb = obj.get("verb")
        scope = verb if isinstance(verb, str) and verb in verbs else ""
        raise headers.field_error(failure, scope, verbs=verbs)
    except BadRequest as err:
        err.req_id = peek_req_id(obj)  # type: ignore[attr-defined]
        raise


def pack_header(header: dict[str, Any]) -> bytes:
    return _ENCODER.encode(header)


_ENCODER = msgspec.msgpack.Encoder()
_REPLY_DECODER = msgspec.msgpack.Decoder(dict[str, Any])


# -- requests and replies -------------------------------------------------------------------------


@dataclass
class Request:
    """A validated request: ``args`` is the verb's header Struct (defaults filled in)."""

    verb: str
    req_id: int
    args: Any  # a storage.headers.Header (or {} for a request that could not be read)
    bodies: list[pa.Buffer] = field(default_factory=list)
    acked: bool = False  # set by the server once a claim's piggybacked ack has been applied


@dataclass
class Reply:
    ok: bool
    req_id: int
    result: dict[str, Any]
    error: StoreError | None = None
    bodies: list[pa.Buffer] = field(default_factory=list)


def encode_request(verb: str, req_id: int, args: dict[str, Any], bodies: Sequence[Any] = ()
                   ) -> list:
    return [pack_header({"v": PROTOCOL_VERSION, "verb": verb, "req_id": req_id, **args}), *bodies]


def peek_req_id(header: dict[str, Any]) -> int:
    """The req_id to answer with, even when the rest of the header is bad (0 if unusable)."""
    rid = header.get("req_id")
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < (1 << 64):
        return rid
    return 0


def decode_request(
    frames: Sequence[Any], decoder: msgspec.msgpack.Decoder = _DECODER,
    verbs: dict[str, Any] = VERBS, body_counts: dict[str, tuple[int, int]] = BODY_COUNTS,
) -> Request:
    """Validate a request's frames (the store's by default, the coordinator's with its decoder
    and verbs); bodies stay buffers (``read_batch``). BadRequest has ``.req_id`` when known."""
    if not frames:
        raise BadRequest("empty message")
    args = decode_header(frames[0], decoder, verbs)
    verb, bodies = headers.VERB_OF[type(args)], frames[1:]
    lo, hi = body_counts.get(verb, (0, 0))
    try:
        if not lo <= len(bodies) <= hi:
            want = str(lo) if lo == hi else f"{lo}..{hi}"
            raise BadRequest(f"{verb!r} takes {want} Arrow body frame(s), got {len(bodies)}")
        if verb == "claim" and bodies and args.ack_lease_id is None:
            raise BadRequest("a 'claim' body (columns to write) needs 'claim.ack_lease_id'")
    except BadRequest as exc:
        exc.req_id = args.req_id  # type: ignore[attr-defined]
        raise
    return Request(verb, args.req_id, args, [pa.py_buffer(_bytes_view(b)) for b in bodies])


def encode_reply(req_id: int, result: dict[str, Any], bodies: Sequence[Any] = ()) -> list:
    return [pack_header({"ok": True, "req_id": req_id, "error": None, **result}), *bodies]


def encode_error(req_id: int, exc: StoreError, *, acked: bool = False) -> list:
    """An error reply. ``acked``: the request's piggybacked ack was applied before the error."""
    err = {"code": exc.code, "message": str(exc)[:4096]}
    header: dict[str, Any] = {"ok": False, "req_id": req_id, "error": err}
    if acked:
        header["acked"] = True
    return [pack_header(header)]


def decode_reply(frames: Sequence[Any]) -> Reply:
    """Decode a reply (client side); BadRequest if malformed (a buggy server, or not a store)."""
    if not frames:
        raise BadRequest("empty reply")
    data = _bytes_view(frames[0])
    if len(data) > MAX_HEADER_BYTES:
        raise BadRequest(f"reply header is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = _REPLY_DECODER.decode(data)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise BadRequest(f"reply header is not a msgpack map: {exc}") from None
    ok, req_id = header.pop("ok", None), peek_req_id(header)
    header.pop("req_id", None)
    err = header.pop("error", None)
    bodies = [pa.py_buffer(_bytes_view(b)) for b in frames[1:]]
    if ok is True:
        return Reply(True, req_id, header, None, bodies)
    if not isinstance(err, dict):
        raise BadRequest("reply is neither ok nor a typed error")
    code, message = err.get("code"), err.get("message")
    exc = error_from_code(str(code), str(message))
    exc.acked = header.get("acked") is True  # type: ignore[attr-defined]
    return Reply(False, req_id, header, exc, bodies)


def _bytes_view(frame: Any) -> bytes | memoryview:
    """A zmq.Frame (copy=False), bytes or buffer -> something msgpack/Arrow can read, no copy."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


# -- Arrow bodies ---------------------------------------------------------------------------------


_schema_sizes: dict[pa.Schema, int] = {}  # IPC schema-message size per schema, bounded
_SCHEMA_CACHE = 256
_EOS_BYTES = 8  # the end-of-stream marker the stream writer appends on close
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()  # built once: new_stream() rebuilds it every call


def write_batch(batch: pa.RecordBatch) -> pa.Buffer:
    """One record batch -> uncompressed Arrow IPC stream bytes, written into one buffer of its
    final size (one copy; a growing stream cost as much again)."""
    schema = batch.schema
    head = _schema_sizes.get(schema)
    if head is None:
        head = schema.serialize().size
        if len(_schema_sizes) >= _SCHEMA_CACHE:
            _schema_sizes.clear()
        _schema_sizes[schema] = head
    out = pa.allocate_buffer(head + pa.ipc.get_record_batch_size(batch) + _EOS_BYTES)
    sink = pa.FixedSizeBufferWriter(out)
    try:
        with pa.ipc.RecordBatchStreamWriter(sink, schema, options=_WRITE_OPTIONS) as writer:
            writer.write_batch(batch)
    except OSError:  # more messages than estimated (dictionary batches): grow as needed
        growing = pa.BufferOutputStream()
        with pa.ipc.new_stream(growing, schema) as writer:
            writer.write_batch(batch)
        return growing.getvalue()
    return out if sink.tell() == out.size else out.slice(0, sink.tell())


def read_batch(buf: pa.Buffer | bytes, what: str = "body") -> pa.RecordBatch:
    """Arrow IPC stream bytes -> one fully validated record batch (BadRequest otherwise)."""
    try:
        reader = pa.ipc.open_stream(buf)
        batches = list(reader)
    except (pa.ArrowException, ValueError, OSError, MemoryError) as exc:
        raise BadRequest(f"{what} is not a valid Arrow IPC stream: {exc}") from None
    if len(batches) != 1:
        raise BadRequest(f"{what} must hold exactly one record batch, got {len(batches)}")
    batch = batches[0]
    try:
        batch.validate(full=True)
    except (pa.ArrowException, ValueError) as exc:
        raise BadRequest(f"{what} fails Arrow validation: {exc}") from None
    return batch


def to_batch(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    """A RecordBatch or Table -> one RecordBatch (a Table's chunks are concatenated)."""
    if isinstance(data, pa.RecordBatch):
        return data
    if isinstance(data, pa.Table):
        batches = data.combine_chunks().to_batches(max_chunksize=None)
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=data.schema)
    raise TypeError(f"expected a pyarrow RecordBatch or Table, got {type(data).__name__}")


def row_ids_to_bytes(row_ids: np.ndarray | Sequence[int]) -> bytes:
    return np.asarray(row_ids, dtype="<u8").tobytes()


def row_ids_from_bytes(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise BadRequest("row_ids bytes length is not a multiple of 8")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64, copy=False)


# -- TableSpec and TableStats as msgpack maps -----------------------------------------------------

def spec_to_wire(spec: TableSpec) -> dict[str, Any]:
    tasks = [headers.WireTask(name=t.name, needs=list(t.needs), whole_groups=t.whole_groups,
                              skip_null=t.skip_null)
             for t in spec.tasks]
    scalars = {key: getattr(spec, key) for key in headers.SPEC_SCALARS}
    schema = spec.schema.serialize().to_pybytes()
    wire_spec = headers.WireSpec(name=spec.name, schema=schema, tasks=tasks, **scalars)
    return msgspec.to_builtins(wire_spec, builtin_types=(bytes,))  # the schema stays bytes


def spec_from_wire(data: dict[str, Any] | headers.WireSpec) -> TableSpec:
    """A TableSpec from its wire form (a typed ``spec``, or a map checked against the Struct);
    semantic checks are the node's."""
    if not isinstance(data, headers.WireSpec):
        try:
            data = msgspec.convert(data, headers.WireSpec)
        except msgspec.ValidationError as exc:
            raise headers.field_error(exc, "", kind="spec") from None
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(data.schema))
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise BadRequest(f"spec.schema is not an Arrow IPC schema: {exc}") from None
    tasks = tuple(TaskSpec(t.name, tuple(t.needs), t.whole_groups, t.skip_null) for t in data.tasks)
    scalars = {key: getattr(data, key) for key in headers.SPEC_SCALARS}
    return TableSpec(name=data.name, schema=schema, tasks=tasks, **scalars)


def stats_to_wire(stats: TableStats) -> dict[str, Any]:
    """TableStats -> nested msgpack maps (the dataclasses' fields)."""
    return msgspec.to_builtins(stats)


def stats_from_wire(data: dict[str, Any]) -> TableStats:
    try:
        return msgspec.convert(data, TableStats)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"malformed stats reply: {exc}") from None


def merge_stats(parts: Sequence[TableStats]) -> TableStats:
    """Stats of one table from several nodes -> one TableStats (shard ids are globally unique)."""
    shards = sorted((s for p in parts for s in p.shards), key=lambda s: s.shard_id)
    return TableStats(parts[0].table if parts else "", shards)
