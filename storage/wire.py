"""The store's wire format: frame layout, header validation, Arrow and record encodings.

Owns: how a request/reply is laid out in ZeroMQ frames, the decoding of headers into the verbs'
Structs (their schema: ``storage/headers.py``), the limits applied to anything read from a socket,
and the msgpack encodings of ``TableSpec`` and ``TableStats``. Never pickle; msgpack ext types are
refused; Arrow is the only binary body format.

Frame layout (one ZeroMQ multipart message; the ROUTER prepends the peer identity)::

    request: [header: msgpack map {v, verb, req_id, <verb fields>}] [body: Arrow IPC stream]*
    reply:   [header: msgpack map {ok, req_id, error: {code, message} | nil, <results>}] [body]*

Bodies are Arrow IPC *streams* holding exactly one record batch (``put``: the new rows; ``write``:
``row_id`` + the new columns; a ``claim`` with ``ack_lease_id``, optionally: the columns to write
under that lease; a ``claim`` reply: the leased rows). Bodies of at least 64 KiB (pyzmq's
copy threshold) are sent as zero-copy frames; received bodies are wrapped, not copied.
Row ids in headers travel as little-endian uint64 bytes (``row_ids``), never as msgpack arrays.

Limits on anything read from a socket: the whole message <= ``max_message_bytes`` (ZeroMQ
``MAXMSGSIZE`` drops bigger ones before we see them); header <= ``MAX_HEADER_BYTES``, decoded and
validated in one pass into the verb's Struct (``storage/headers.py``: every field typed and
bounded, unknown fields refused; a refused header is reported as not msgpack, an ext type, nesting
deeper than ``MAX_DEPTH`` or the field at fault); the bodies a verb takes (``BODY_COUNTS``); every
Arrow body is fully validated (``validate(full=True)``) before the node sees it. A request that
breaks any rule gets a ``BadRequest`` reply naming the field; it never reaches the node.

Delivery guarantees (the store as a whole, enforced by the node, transported here):
- At-least-once per (row, task): a claim hands rows out under a lease with a deadline; a lease not
  acked/extended in time expires and its rows become claimable again with ``deliveries`` + 1. Past
  ``max_deliveries`` a row is quarantined (DEAD) with its reason, visible in stats, never dropped.
- Exactly-once *consumption* per (row, task) is the consumer's job: ack after processing, and
  treat ``deliveries > 1`` as a possible duplicate of work done before a crash.
- Fencing: a write or ack carrying an expired/unknown lease is refused (``LeaseExpired`` /
  ``UnknownLease``), so a zombie consumer cannot overwrite its successor. Each (row, column) cell
  is written at most once (``CellAlreadyWritten``) unless overwritten by the admin flag.
- Back-pressure: ``put`` beyond a table's capacity waits server-side up to its timeout, then fails
  with ``StoreFull``. Writes never wait (refusing them could deadlock a pipeline).
- Combined ack + claim (one round trip instead of two): a ``claim`` may carry ``ack_lease_id``
  (a lease of the same table, typically the consumer's previous one) and optionally one body
  (columns to write under that lease, as ``write`` with ``ack=True``). The node runs it in order,
  all in one step of the loop thread: (1) the claim's own arguments are checked (unknown task,
  column, bounds: BadRequest, nothing applied); (2) the write+ack / ack, fenced exactly like the
  plain verbs; (3) the claim (which may then wait server-side like any claim). Failure rules:
  * step 1 or 2 fails (``LeaseExpired``/``UnknownLease`` when fenced, ``CellAlreadyWritten``,
    ``SchemaMismatch``, ``BadRequest`` on the body): the reply is that typed error and NOTHING
    was applied: no cell written, no row acked, no row leased. The consumer sees exactly what
    the plain write/ack would have raised; the old lease's rows are redelivered as usual.
  * step 2 succeeded and step 3 fails (``ShuttingDown`` while waiting, the table dropped, a
    requested column not written for a ready row): the reply is the typed error with
    ``acked: true`` in its header (``exc.acked`` on the client): the ack stands, no row leased.
  * step 3 finds nothing: an empty lease as usual; the ack stands.
  The ack is durable as a plain ack would be (fsync="always": before the reply is sent). At-least-
  once is unchanged: rows are acked only by the consumer that processed them, and rows of a lease
  whose reply is lost come back at its deadline. An unanswered request (``Unavailable``) has an
  unknown outcome for both parts, as for any mutating verb.
- Parked requests (a claim waiting for rows, a put waiting for room) are bounded per node
  (``ServerConfig``, ``store serve`` flags): the body bytes of parked puts (``max_parked_bytes``,
  256 MiB; a put that would go past it is refused at once with ``StoreFull`` naming the limit),
  the requests one peer may have parked (``max_parked_per_peer``, 256: a claim past it gets
  ``TooManyWaiting``, a put ``StoreFull``) and the claims parked on the node
  (``max_parked_claims``, 65536: ``TooManyWaiting``). A claim that carried an ack and is then
  refused reports ``acked: true`` like any failing step 3 above.
- Departed peers: a peer (one DEALER connection = one ROUTER identity) that is gone loses its
  parked requests within ~``peer_probe_interval_s`` (1 s): every interval the node sends each
  peer that has had requests parked for a whole interval one probe message, ``{ok: true,
  req_id: 0, error: nil, probe: true}``, with ROUTER_MANDATORY; ZeroMQ refuses it
  (EHOSTUNREACH) once the peer's connection is closed, and the node then drops that peer's
  parked requests (nothing is sent to it). A peer whose host vanished without closing its
  connection is cut by ZMTP heartbeats (every 2 s, 10 s timeout) and then dropped the same
  way. This works with a plain ROUTER socket on every transport (tcp, ipc, inproc), needs no
  draft API, and cannot mistake a new connection for an old one (identities are per
  connection). Clients MUST ignore a message with ``probe: true`` (a client that drops replies
  whose ``req_id`` matches no outstanding request does so already; ``req_id`` 0 is also used for
  the error reply to a request whose header could not be read, which has ``ok: false``).
- Server paths: no request names a file or directory of the node. Where tables are persisted is
  the node's configuration (``--persist-dir``, rules in ``storage/persist.py``); a spec with
  ``persist_dir`` is refused. Table names are one path component (``[A-Za-z0-9_][A-Za-z0-9_.-]``,
  at most 128). ``snapshot`` replies with the table's directory on the node, for operators.
- Lease ids are unique per node across restarts on the same persistence root (a persisted,
  monotonic epoch in the id's high bits; see ``storage/node.py``): a zombie's lease id from
  before a restart is ``UnknownLease``, never another consumer's lease.
- Header lists: ``claim.shards`` is null (every shard of the node) or 1..4096 shard ids; an
  empty list is a BadRequest. Every number has inclusive bounds (``storage/headers.py``); NaN
  and infinities are refused.
- Replies: a reply is matched to its request by ``req_id``; a client that times out drops its
  socket, so a late reply can never be taken for another request's. A lost reply to a mutating
  verb means "unknown outcome": a lost put may have created rows; a lost claim's rows come back
  after the lease deadline.
"""

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

# The limits of the diagnostic decode (``unpack_header``): a header msgspec refused is decoded
# once more, untyped and bounded, to report framing faults (not msgpack, ext, nesting) first.
_UNPACK_LIMITS = dict(
    raw=False,
    strict_map_key=True,
    use_list=True,
    max_str_len=MAX_HEADER_BYTES,
    max_bin_len=MAX_HEADER_BYTES,
    max_array_len=1 << 16,
    max_map_len=1 << 12,
    max_ext_len=0,
)


def _no_ext(code: int, data: bytes) -> Any:
    raise BadRequest(f"msgpack ext type {code} is not allowed")


# verb -> its header fields (the Structs of storage/headers.py are the schema).
VERBS: dict[str, tuple[str, ...]] = headers.fields_by_verb(headers.STORE_HEADERS)
_DECODER = headers.decoder(headers.STORE_HEADERS)
# Verbs whose request carries Arrow bodies: verb -> (fewest, most). A claim carries one only with
# ``ack_lease_id`` (the columns written under that lease before it is acked).
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
    """Decode a header frame untyped, with strict limits; BadRequest for anything but a bounded
    map. Only a header that failed typed decoding comes here (to name the fault)."""
    try:
        obj = msgpack.unpackb(data, ext_hook=_no_ext, **_UNPACK_LIMITS)
    except BadRequest:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadRequest(
            f"header frame is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(obj, dict):
        raise BadRequest(f"header frame must be a msgpack map, got {type(obj).__name__}")
    if _depth(obj) > MAX_DEPTH:
        raise BadRequest(f"header nesting deeper than {MAX_DEPTH}")
    return obj


def decode_header(frame: Any, decoder: msgspec.msgpack.Decoder, verbs: Any) -> Any:
    """A header frame -> its typed Struct, decoded and validated in one pass. A refusal is a
    BadRequest naming the fault, with ``.req_id`` set to the request's id when it is readable
    (0 otherwise), so the error reply reaches the right caller."""
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


def encode_request(
    verb: str, req_id: int, args: dict[str, Any], bodies: Sequence[Any] = ()
) -> list:
    header = {"v": PROTOCOL_VERSION, "verb": verb, "req_id": req_id}
    header.update(args)
    return [pack_header(header), *bodies]


def peek_req_id(header: dict[str, Any]) -> int:
    """The req_id to answer with, even when the rest of the header is bad (0 if unusable)."""
    rid = header.get("req_id")
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < (1 << 64):
        return rid
    return 0


def decode_request(
    frames: Sequence[Any],
    decoder: msgspec.msgpack.Decoder = _DECODER,
    verbs: dict[str, Any] = VERBS,
    body_counts: dict[str, tuple[int, int]] = BODY_COUNTS,
) -> Request:
    """Validate a request's frames (header Struct, body count, sizes): the store's by default,
    the coordinator's with its decoder and verbs. Bodies stay Arrow buffers; parse them with
    ``read_batch``. Raises BadRequest with ``.req_id`` set when known."""
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
    header = {"ok": True, "req_id": req_id, "error": None}
    header.update(result)
    return [pack_header(header), *bodies]


def encode_error(req_id: int, exc: StoreError, *, acked: bool = False) -> list:
    """An error reply. ``acked``: the request's piggybacked ack was applied before the error."""
    err = {"code": exc.code, "message": str(exc)[:4096]}
    header: dict[str, Any] = {"ok": False, "req_id": req_id, "error": err}
    if acked:
        header["acked"] = True
    return [pack_header(header)]


def decode_reply(frames: Sequence[Any]) -> Reply:
    """Decode a reply (client side). A malformed reply raises BadRequest (the server is buggy or
    not a store)."""
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
    """One record batch -> Arrow IPC stream bytes (uncompressed, so a reader can bound its memory
    by the message size).

    The stream is written straight into one buffer allocated at its final size (schema message +
    batch message + end-of-stream marker): one copy of the data, no growing output stream (which
    cost as much again as the copy for a 64-row W1 batch)."""
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
    tasks = [headers.WireTask(name=t.name, needs=list(t.needs), whole_groups=t.whole_groups)
             for t in spec.tasks]  # fmt: skip
    scalars = {key: getattr(spec, key) for key in headers.SPEC_SCALARS}
    schema = spec.schema.serialize().to_pybytes()
    wire_spec = headers.WireSpec(name=spec.name, schema=schema, tasks=tasks, **scalars)
    return msgspec.to_builtins(wire_spec, builtin_types=(bytes,))  # the schema stays bytes


def spec_from_wire(data: dict[str, Any] | headers.WireSpec) -> TableSpec:
    """Rebuild a TableSpec from its wire form (a ``create_table`` header's typed ``spec``, or a
    plain map, checked here against the same Struct: BadRequest naming the field). Semantic
    checks (columns exist, tasks unique, ...) are the node's."""
    if not isinstance(data, headers.WireSpec):
        try:
            data = msgspec.convert(data, headers.WireSpec)
        except msgspec.ValidationError as exc:
            raise headers.field_error(exc, "", kind="spec") from None
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(data.schema))
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise BadRequest(f"spec.schema is not an Arrow IPC schema: {exc}") from None
    tasks = tuple(TaskSpec(t.name, tuple(t.needs), t.whole_groups) for t in data.tasks)
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
