"""Persistence of one table on one node: an append-only log per shard plus atomic snapshots.

Owns the log records, snapshots, replay at recovery and the fsync policy. Layout, ownership,
recovery and what is durable when: docs/store-protocol.md ("Persistence")."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import zlib
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import pyarrow as pa

from storage.errors import BadRequest
from storage.persist_root import (
    DATA_KEYS,
    claim_dir,
    fsync_dir,
    remove_owned,
    spec_doc,
    table_dir,
    write_atomic,
)
from storage.schema import RowState, TableSpec
from storage.wire import read_batch, write_batch

if TYPE_CHECKING:
    from storage.shard import Shard

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")
_HLEN = struct.Struct("<I")
_SNAP_ROWS = 65536  # rows per snapshot record batch (keeps list offsets far from int32 limits)
_META_KEY = b"streamflow"
_LOG_NAME = re.compile(r"^shard-(\d+)\.(\d+)\.log$")


class ShardLog:
    """The append-only log of one shard: one open fd, appends with one writev per record."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.dirty = False

    def append(self, header: dict, body: pa.Buffer | None = None) -> None:
        head = msgpack.packb(header, use_bin_type=True)
        pieces: list[bytes | pa.Buffer] = [_HLEN.pack(len(head)), head]
        if body is not None:
            pieces.append(body)
        length = sum(len(p) if isinstance(p, bytes) else p.size for p in pieces)
        crc = 0
        for p in pieces:
            crc = zlib.crc32(p, crc)
        pieces.insert(0, _FRAME.pack(length, crc))
        total = length + _FRAME.size
        done = os.writev(self.fd, pieces)
        if done < total:  # short write (rare: signals, nearly full disk): finish byte by byte
            rest = memoryview(b"".join(bytes(p) for p in pieces))[done:]
            while len(rest):
                rest = rest[os.write(self.fd, rest) :]
        self.dirty = True

    def fsync(self) -> None:
        os.fsync(self.fd)
        self.dirty = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def read_records(path: str) -> tuple[list[tuple[dict, bytes]], int]:
    """(records, problems) of a log file; truncates a torn tail in place."""
    records: list[tuple[dict, bytes]] = []
    problems, good_end = 0, 0
    with open(path, "rb") as f:
        while True:
            frame = f.read(_FRAME.size)
            if not frame:
                break
            if len(frame) < _FRAME.size:
                problems += 1
                break
            length, crc = _FRAME.unpack(frame)
            payload = f.read(length)
            if len(payload) < length:
                problems += 1
                break
            good_end = f.tell()
            if zlib.crc32(payload) != crc:
                log.warning("%s: record at %d fails its crc; dropped", path, good_end - length - 8)
                problems += 1
                continue
            try:
                (hlen,) = _HLEN.unpack_from(payload)
                header = msgpack.unpackb(payload[4 : 4 + hlen], raw=False, strict_map_key=True)
                if not isinstance(header, dict):
                    raise ValueError("header is not a map")
            except Exception as e:  # noqa: BLE001 - bad contents must never stop recovery
                log.warning("%s: undecodable record header (%s); dropped", path, e)
                problems += 1
                continue
            records.append((header, payload[4 + hlen :]))
    size = os.path.getsize(path)
    if good_end < size:
        log.warning("%s: torn tail of %d bytes cut off", path, size - good_end)
        os.truncate(path, good_end)
    return records, problems


class TableStore:
    """Logs and snapshots of one table's shards on one node (docs/store-protocol.md)."""

    def __init__(self, spec: TableSpec, root: str, node_index: int) -> None:
        """Open (creating it, with its marker) ``<root>/<spec.name>``."""
        self.spec = spec
        self.path = table_dir(root, spec.name)
        self.node_index = node_index
        self.logs: dict[int, ShardLog] = {}
        self.gens: dict[int, int] = {}
        self._last_fsync = 0.0
        claim_dir(self.path, spec.name)
        self._check_spec()

    def _check_spec(self) -> None:
        meta = os.path.join(self.path, "table.json")
        doc = json.loads(json.dumps(spec_doc(self.spec)))
        if os.path.exists(meta):
            with open(meta) as f:
                on_disk = json.load(f)
            for key in DATA_KEYS:
                if on_disk.get(key) != doc[key]:
                    what = f"{self.path!r} holds table {self.spec.name!r} with a different {key}"
                    raise BadRequest(f"{what}; drop the table first")
            if on_disk == doc:
                return
        write_atomic(meta, json.dumps(doc))  # new, or the same data with other limits

    def _files(self, sid: int) -> tuple[str, list[tuple[int, str]]]:
        """The shard's snapshot path and its (generation, log path)s, oldest first."""
        logs = [(int(m[2]), os.path.join(self.path, name)) for name in os.listdir(self.path)
                if (m := _LOG_NAME.match(name)) and int(m[1]) == sid]
        return os.path.join(self.path, f"shard-{sid}.snap"), sorted(logs)

    # ----------------------------------------------------------------------------- recovery
    def recover(self, shards: dict[int, Shard]) -> None:
        self._check_shard_files(shards)
        for sid, shard in shards.items():
            snap, logs = self._files(sid)
            covered = -1
            if os.path.exists(snap):
                covered = load_snapshot(shard, snap)
            replayed, problems = 0, 0
            for gen, path in logs:
                if gen <= covered:
                    continue
                records, bad = read_records(path)
                problems += bad
                for header, body in records:
                    try:
                        apply_record(shard, header, body)
                        replayed += 1
                    except Exception as e:  # noqa: BLE001 - a bad record never stops recovery
                        op = header.get("op")
                        log.warning("%s: record %s not applied (%s); dropped", path, op, e)
                        problems += 1
            shard.rebuild_queues()
            self.gens[sid] = max([covered, *(g for g, _ in logs)]) + 1
            self.logs[sid] = ShardLog(self._log_path(sid, self.gens[sid]))
            if replayed or problems:
                self._snapshot_shard(shard)

    def _check_shard_files(self, shards: dict[int, Shard]) -> None:
        for name in os.listdir(self.path):
            m = re.match(r"shard-(\d+)(?:\.|$)", name)
            sid = int(m[1]) if m else -1
            if sid >> 8 == self.node_index and sid not in shards:
                raise BadRequest(f"persist_dir {self.path!r} holds shard {sid}, not served by this "
                                 "node (num_shards too small?)")

    def _log_path(self, sid: int, gen: int) -> str:
        return os.path.join(self.path, f"shard-{sid}.{gen}.log")

    # ----------------------------------------------------------------------------- logging
    def log_put(self, sid: int, start: int, created_at: float, batch: pa.RecordBatch) -> None:
        self.logs[sid].append({"op": "put", "start": start, "t": created_at}, write_batch(batch))

    def log_write(self, sid: int, seqs: np.ndarray, batch: pa.RecordBatch, overwrite: bool) -> None:
        header = {"op": "write", "seqs": seqs.astype("<i8").tobytes(), "ow": overwrite}
        self.logs[sid].append(header, write_batch(batch))

    def log_rows(
        self, op: str, sid: int, seqs: np.ndarray, *, task: str | None = None,
        reason: str | None = None,
    ) -> None:
        header = {"op": op, "seqs": np.asarray(seqs).astype("<i8").tobytes(), "task": task,
                  "reason": reason}
        self.logs[sid].append({k: v for k, v in header.items() if v is not None})

    def sync(self, now: float) -> None:
        """fsync dirty logs per the table's policy (``now``: a monotonic clock)."""
        if self.spec.fsync == "never":
            return
        if self.spec.fsync == "interval" and now - self._last_fsync < self.spec.fsync_interval_s:
            return
        for shard_log in self.logs.values():
            if shard_log.dirty:
                shard_log.fsync()
        self._last_fsync = now

    # ----------------------------------------------------------------------------- snapshots
    def snapshot(self, shards: dict[int, Shard]) -> str:
        for shard in shards.values():
            self._snapshot_shard(shard)
        return self.path

    def _snapshot_shard(self, shard: Shard) -> None:
        sid = shard.shard_id
        covered = self.gens[sid]
        snap = os.path.join(self.path, f"shard-{sid}.snap")
        write_snapshot(shard, snap + ".tmp", covered)
        os.replace(snap + ".tmp", snap)
        fsync_dir(self.path)
        self.logs[sid].close()
        self.gens[sid] = covered + 1
        self.logs[sid] = ShardLog(self._log_path(sid, covered + 1))
        for gen, path in self._files(sid)[1]:
            if gen <= covered:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def close(self) -> None:
        for shard_log in self.logs.values():
            if shard_log.dirty and self.spec.fsync != "never":
                with contextlib.suppress(OSError):
                    shard_log.fsync()
            shard_log.close()
        self.logs.clear()

    def destroy(self) -> None:
        """Close, then delete only the files the store wrote (marker checked; see above)."""
        self.close()
        remove_owned(self.path)


# --------------------------------------------------------------------------------- shard codec
def apply_record(shard: Shard, header: dict, body: bytes) -> None:
    """Replay one log record onto a shard (rows already gone are skipped)."""
    op = header["op"]
    if op == "put":
        batch, arrays = _columns(shard, body)
        start = int(header["start"])
        if start < shard.next_seq:
            raise ValueError(f"put at seq {start} below next seq {shard.next_seq}")
        shard.next_seq = start
        shard.put(arrays, batch.num_rows, float(header["t"]))
        return
    seqs = np.frombuffer(header["seqs"], dtype="<i8").astype(np.int64)
    idx, ok = shard._find(seqs)
    if op == "write":
        arrays = _columns(shard, body)[1]
        pos = np.flatnonzero(ok).astype(np.int32)
        if len(pos):
            shard.write(idx[ok], arrays, pos)
        return
    idx = idx[ok]
    if op == "free":
        shard.free(idx)
        return
    t = shard.task_names.index(header["task"])
    if op == "claim":
        shard.deliv[t, idx] += 1
    elif op == "release":
        shard.deliv[t, idx] -= 1
    elif op == "ack":
        idx = idx[shard.state[t, idx] != RowState.CONSUMED]
        shard.consume(t, idx)
    elif op == "dead":
        shard.mark_dead(t, idx, str(header["reason"]))
    else:
        raise ValueError(f"unknown op {op!r}")


def _columns(shard: Shard, body: bytes) -> tuple[pa.RecordBatch, dict[int, pa.Array]]:
    batch = read_batch(body, "log record")
    index = {n: i for i, n in enumerate(shard.columns)}
    return batch, {index[f.name]: batch.column(i) for i, f in enumerate(batch.schema)}


def write_snapshot(shard: Shard, path: str, covered: int) -> None:
    live = np.flatnonzero(shard.alive[: shard.n])
    meta = {
        "covered": covered, "next_seq": shard.next_seq, "reasons": shard.reasons,
        "consumed_total": shard.consumed_total.tolist(),
        "redelivered_total": shard.redelivered_total.tolist(),
    }
    fields = [
        pa.field("__seq", pa.int64()), pa.field("__created", pa.float64()),
        pa.field("__gpos", pa.int64()),
    ]
    for f in shard.spec.schema:
        fields += [pa.field(f.name, f.type), pa.field(f"__w:{f.name}", pa.bool_())]
    for name in shard.task_names:
        fields += [
            pa.field(f"__state:{name}", pa.uint8()), pa.field(f"__deliv:{name}", pa.uint16()),
            pa.field(f"__reason:{name}", pa.int32()),
        ]
    schema = pa.schema(fields, metadata={_META_KEY: json.dumps(meta).encode()})
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for lo in range(0, max(len(live), 1), _SNAP_ROWS):
            idx = live[lo : lo + _SNAP_ROWS]
            arrays = [
                pa.array(shard.seqs[idx]), pa.array(shard.created[idx]), pa.array(shard.gpos[idx]),
            ]
            for c in range(len(shard.columns)):
                arrays += [shard.cells(idx, c), pa.array(shard.src[c, idx] >= 0)]
            for t in range(len(shard.task_names)):
                state = shard.state[t, idx].copy()
                state[state == RowState.LEASED] = RowState.READY  # leases are not persisted
                arrays += [
                    pa.array(state), pa.array(shard.deliv[t, idx]), pa.array(shard.reason[t, idx]),
                ]
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def load_snapshot(shard: Shard, path: str) -> int:
    """Load a shard snapshot into an empty shard; returns the log generation it covers."""
    with pa.OSFile(path, "rb") as source:
        reader = pa.ipc.open_file(source)
        meta = json.loads(reader.schema.metadata[_META_KEY])
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    shard.reasons = list(meta["reasons"])
    shard._reason_index = {r: i for i, r in enumerate(shard.reasons)}
    for batch in batches:
        if batch.num_rows == 0:
            continue
        seqs = batch.column("__seq").to_numpy()
        arrays, written = {}, {}
        for c, name in enumerate(shard.columns):
            arrays[c] = batch.column(name)
            written[c] = batch.column(f"__w:{name}").to_numpy(zero_copy_only=False)
        idx = shard.append(seqs, batch.column("__created").to_numpy(), arrays, written,
                           batch.column("__gpos").to_numpy())
        for t, name in enumerate(shard.task_names):
            shard.state[t, idx] = batch.column(f"__state:{name}").to_numpy()
            shard.deliv[t, idx] = batch.column(f"__deliv:{name}").to_numpy()
            shard.reason[t, idx] = batch.column(f"__reason:{name}").to_numpy()
    live = np.flatnonzero(shard.alive[: shard.n])
    for t in range(len(shard.task_names)):
        shard.counts[t] = np.bincount(shard.state[t, live], minlength=len(RowState))
    shard.next_seq = int(meta["next_seq"])
    shard.consumed_total[:] = meta["consumed_total"]
    shard.redelivered_total[:] = meta["redelivered_total"]
    return int(meta["covered"])
