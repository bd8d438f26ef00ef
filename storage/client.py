"""The store client: explicit verbs over one ZeroMQ DEALER socket per store node.

Owns routing by shard, placement of puts, multi-node claims, request timeouts and reconnection.
Use a ``Client`` from ONE thread. Rules: docs/store-protocol.md ("Client")."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import zmq

from storage import rpc, wire
from storage.errors import StoreError, Unavailable
from storage.schema import ROW_ID, SEQ_BITS, Lease, TableSpec, TableStats

DEFAULT_REQUEST_TIMEOUT_S = 30.0


@dataclass
class CurveClientKeys:
    """CURVE keys of a client: its own key pair and the server's public key (z85 bytes)."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes


class _Conn(rpc.Channel):
    """One node: its channel (socket replaced after a timeout) and placement hint."""

    def __init__(self, client: Client, address: str) -> None:
        options: list[tuple[int, Any]] = [
            (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 5000),
            (zmq.MAXMSGSIZE, client.max_message_bytes),
        ]
        if (k := client.curve) is not None:
            options += [(zmq.CURVE_PUBLICKEY, k.public_key), (zmq.CURVE_SECRETKEY, k.secret_key),
                        (zmq.CURVE_SERVERKEY, k.server_public_key)]
        super().__init__(client.context, address, timeout_error=Unavailable, options=options)
        self.depth = 0  # live rows of the last-put table, from the last put reply


class Client:
    """Talks to one or more store nodes. Use from one thread; ``close()`` when done."""

    def __init__(
        self, addresses: str | Sequence[str], *, context: zmq.Context | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveClientKeys | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses:
            raise ValueError("Client needs at least one store address")
        self.context = context or zmq.Context.instance()
        self.request_timeout = request_timeout
        self.max_message_bytes = max_message_bytes
        self.curve = curve
        self._req_ids = itertools.count(1)
        self._conns = [_Conn(self, a) for a in addresses]
        self._by_node: dict[int, _Conn] | None = None
        self._rr = 0

    # -- plumbing --------------------------------------------------------------------------------
    def _send(
        self, conn: _Conn, verb: str, args: dict[str, Any], bodies: Sequence[Any] = ()
    ) -> int:
        req_id = next(self._req_ids)
        conn.sock.send_multipart(wire.encode_request(verb, req_id, args, bodies), copy=False)
        return req_id

    def _call(
        self, conn: _Conn, verb: str, args: dict[str, Any], bodies: Sequence[Any] = (), *,
        wait: float = 0.0,
    ) -> wire.Reply:
        return conn.request(next(self._req_ids), verb, args, bodies, wait + self.request_timeout)

    def _nodes(self) -> dict[int, _Conn]:
        """node index -> connection, learned once with "hello" (only needed with several nodes)."""
        if self._by_node is None:
            hello = {c: self._call(c, "hello", {}).result for c in self._conns}
            self._by_node = {int(h["node_index"]): c for c, h in hello.items()}
        return self._by_node

    def _conn_for_shard(self, shard_id: int) -> _Conn:
        if len(self._conns) == 1:
            return self._conns[0]
        node = shard_id >> 8
        try:
            return self._nodes()[node]
        except KeyError:
            raise StoreError(f"no connected node serves shard {shard_id} (node {node})") from None

    # -- admin verbs -----------------------------------------------------------------------------
    def _each(self, verb: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        """The verb on every node, in the order of the addresses: their results."""
        return [self._call(c, verb, args).result for c in self._conns]

    def parked(self) -> list[dict[str, int]]:
        """What each node has parked now ({"claims", "puts", "put_bytes", "peers"}), in the
        order of the addresses: a test waits on it instead of sleeping."""
        return [dict(r["parked"]) for r in self._each("hello", {})]

    def create_table(self, spec: TableSpec) -> None:
        """Create the table on every node (idempotent for an equal spec)."""
        self._each("create_table", {"spec": wire.spec_to_wire(spec)})

    def drop_table(self, table: str) -> None:
        self._each("drop_table", {"table": table})

    def tables(self) -> list[str]:
        return sorted({name for r in self._each("tables", {}) for name in r["tables"]})

    def stats(self, table: str) -> TableStats:
        """Per-shard, per-task counts, merged over every node."""
        parts = self._each("stats", {"table": table})
        return wire.merge_stats([wire.stats_from_wire(r["stats"]) for r in parts])

    def clear(self, table: str, *, dead: bool = False) -> int:
        """Free consumed rows (and DEAD ones with dead=True); returns rows freed."""
        return sum(int(r["freed"]) for r in self._each("clear", {"table": table, "dead": dead}))

    def snapshot(self, table: str) -> list[str]:
        """Snapshot the table on every node; returns the snapshot paths."""
        return [str(r["path"]) for r in self._each("snapshot", {"table": table})]

    # -- data verbs ------------------------------------------------------------------------------
    def put(
        self, table: str, data: pa.RecordBatch | pa.Table, *, timeout: float = 30.0,
        shard_id: int | None = None,
    ) -> np.ndarray:
        """Create rows; returns their uint64 row ids (waits up to ``timeout`` s for room)."""
        batch = wire.to_batch(data)
        conn = self._shallowest() if shard_id is None else self._conn_for_shard(shard_id)
        reply = self._call(
            conn, "put", {"table": table, "timeout": float(timeout), "shard_id": shard_id},
            [wire.write_batch(batch)], wait=timeout,
        )
        conn.depth = int(reply.result.get("depth", 0))
        return wire.row_ids_from_bytes(reply.result["row_ids"])

    def _shallowest(self) -> _Conn:
        if len(self._conns) == 1:
            return self._conns[0]
        self._rr += 1  # ties go round-robin
        n = len(self._conns)
        return min((self._conns[(self._rr + i) % n] for i in range(n)), key=lambda c: c.depth)

    def claim(
        self, table: str, task: str, columns: Sequence[str], max_rows: int, *, min_rows: int = 1,
        whole_groups: bool = False, timeout: float = 0.0, lease_seconds: float | None = None,
        ack: Lease | None = None, write: pa.RecordBatch | pa.Table | None = None,
        shards: Sequence[int] | None = None, wake: Sequence[str] = (),
    ) -> Lease:
        """Lease up to ``max_rows`` rows ready for ``task``, waiting server-side up to ``timeout``
        s for ``min_rows`` (then whatever is ready: maybe an empty lease). ``ack`` (+ ``write``):
        the previous lease, acked in the same round trip; ``shards``: only those shard ids;
        ``wake``: other tasks whose ready rows end the wait early (with an empty lease).
        Rules and usage: docs/store-protocol.md ("Client: claim")."""
        args = {
            "table": table, "task": task, "columns": list(columns), "max_rows": int(max_rows),
            "min_rows": int(min_rows), "whole_groups": bool(whole_groups),
            "lease_seconds": lease_seconds,
        }
        if wake:
            args["wake"] = list(wake)
        piggy: tuple[Lease, list[Any]] | None = None
        if write is not None and (ack is None or not ack.lease_id):
            raise ValueError("claim(write=...) needs the lease to write under as ack=")
        if ack is not None and ack.lease_id:
            if ack.table != table:
                raise ValueError(f"claim(ack=...): the lease is of table {ack.table!r}, "
                                 f"not {table!r}")
            piggy = (ack, [] if write is None else [_lease_body(ack, write)])
        if shards is not None:
            only = self._shards_by_conn(shards)
            if len(self._conns) > 1:
                if piggy is not None and self._conn_for_shard(piggy[0].shard_id) not in only:
                    self._ack_piggy(piggy)  # its node serves none of these shards: ack apart
                    piggy = None
                return self._claim_many(args, float(timeout), piggy, only)
            args["shards"] = only[self._conns[0]]
        if len(self._conns) == 1:
            return self._claim_one(self._conns[0], args, float(timeout), piggy)
        return self._claim_many(args, float(timeout), piggy)

    def _shards_by_conn(self, shards: Sequence[int]) -> dict[_Conn, list[int]]:
        if isinstance(shards, str | bytes) or not len(shards):
            got = f"got {shards!r}"
            raise ValueError(f"claim(shards=...) needs a non-empty list of shard ids, {got}")
        only: dict[_Conn, list[int]] = {}
        for sid in shards:
            ok = isinstance(sid, int | np.integer) and not isinstance(sid, bool)
            if not ok or not 0 <= sid < 65536:
                raise ValueError(f"claim(shards=...): {sid!r} is not a shard id")
            only.setdefault(self._conn_for_shard(int(sid)), []).append(int(sid))
        return only

    def _ack_piggy(self, piggy: tuple[Lease, list[Any]]) -> None:
        lease, bodies = piggy
        if bodies:
            self._on_lease(lease, "write", bodies, ack=True, overwrite=False)
        else:
            self._on_lease(lease, "ack")

    def _lease(self, args: dict[str, Any], reply: wire.Reply) -> Lease:
        if not reply.bodies:
            raise StoreError("claim reply without a batch")
        r, batch = reply.result, wire.read_batch(reply.bodies[0], "claim reply")
        return Lease(int(r["lease_id"]), args["table"], args["task"], int(r["shard_id"]),
                     float(r["deadline"]), batch)

    def _claim_one(
        self, conn: _Conn, args: dict[str, Any], timeout: float,
        piggy: tuple[Lease, list[Any]] | None = None,
    ) -> Lease:
        wire_args = {**args, "timeout": timeout}
        if piggy is not None:
            wire_args["ack_lease_id"] = piggy[0].lease_id
        bodies = piggy[1] if piggy is not None else []
        return self._lease(args, self._call(conn, "claim", wire_args, bodies, wait=timeout))

    def _claim_many(
        self, args: dict[str, Any], timeout: float, piggy: tuple[Lease, list[Any]] | None = None,
        only: dict[_Conn, list[int]] | None = None,
    ) -> Lease:
        # 1) probe every node without waiting (round-robin start; the ack's node goes first).
        self._rr += 1
        order = [self._conns[(self._rr + i) % len(self._conns)] for i in range(len(self._conns))]
        if only is not None:  # only the nodes serving the requested shards, each its own part
            order = [c for c in order if c in only]
            per = {c: {**args, "shards": only[c]} for c in order}
        else:
            per = {c: args for c in order}
        if piggy is not None:
            home = self._conn_for_shard(piggy[0].shard_id)
            order = [home, *(c for c in order if c is not home)]
        last: Lease | None = None
        for conn in order:
            lease = self._claim_one(conn, per[conn], 0.0, piggy if conn is order[0] else None)
            if lease.num_rows >= args["min_rows"] or (timeout <= 0 and lease.num_rows):
                return lease
            if lease.num_rows:  # fewer than min_rows: hand back, keep looking / waiting
                self.release(lease)
            last = lease
        if timeout <= 0:
            assert last is not None
            return last
        # 2) one long poll per node; the first non-empty lease wins, the others are cancelled.
        pending = {self._send(c, "claim", {**per[c], "timeout": timeout}): c for c in order}
        won: Lease | None = None
        failure: StoreError | None = None
        deadline = time.monotonic() + timeout + self.request_timeout
        poller = zmq.Poller()
        for c in order:
            poller.register(c.sock, zmq.POLLIN)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                for c in pending.values():
                    c.reset()
                raise failure or Unavailable(f"no claim reply within {timeout:.3g} s")
            ready = dict(poller.poll(int(left * 1000) + 1))
            for req_id, conn in list(pending.items()):
                if conn.sock not in ready:
                    continue
                while conn.sock.poll(0):
                    reply = wire.decode_reply(conn.sock.recv_multipart(copy=False))
                    if reply.req_id != req_id:
                        continue  # stale
                    del pending[req_id]
                    if reply.error is not None:
                        # ShuttingDown (or any error) ends the wait everywhere.
                        failure = failure or reply.error
                        self._cancel_all(pending)
                    else:
                        lease = self._lease(args, reply)
                        if lease.num_rows and won is None:
                            won = lease
                            self._cancel_all(pending)
                        elif lease.num_rows:
                            self.release(lease)  # lost the race: hand back cleanly
                        else:
                            last = lease
                    break
        if won is not None:
            return won
        if failure is not None:
            raise failure
        assert last is not None
        return last

    def _cancel_all(self, pending: dict[int, _Conn]) -> None:
        for req_id, conn in pending.items():
            self._send(conn, "cancel", {"target": req_id})  # its reply is dropped as stale

    def write(
        self, table: str, lease_or_row_ids: Lease | Sequence[int] | np.ndarray,
        columns: pa.RecordBatch | pa.Table, *, ack: bool = False, overwrite: bool = False,
    ) -> None:
        """Add columns to existing rows (in the order of the lease's rows / the row ids, unless
        ``columns`` has ``row_id``). With a Lease: fenced, and ``ack=True`` acks it atomically."""
        batch = wire.to_batch(columns)
        if isinstance(lease_or_row_ids, Lease):
            body = [_lease_body(lease_or_row_ids, batch)]
            self._on_lease(lease_or_row_ids, "write", body, table=table, ack=ack,
                           overwrite=overwrite)
            return
        if ack:
            raise ValueError("write(ack=True) needs a Lease, not row ids")
        row_ids = np.asarray(lease_or_row_ids, dtype=np.uint64)
        if ROW_ID not in batch.schema.names:
            batch = _with_row_ids(batch, pa.array(row_ids, type=pa.uint64()))
        else:
            row_ids = batch.column(ROW_ID).to_numpy()
        nodes = (row_ids >> np.uint64(SEQ_BITS + 8)).astype(np.int64)
        args = {"table": table, "lease_id": None, "ack": False, "overwrite": overwrite}
        for node in np.unique(nodes):
            part = batch if len(np.unique(nodes)) == 1 else batch.filter(pa.array(nodes == node))
            conn = self._conn_for_shard(int(node) << 8)
            self._call(conn, "write", args, [wire.write_batch(part)])

    def _on_lease(
        self, lease: Lease, verb: str, bodies: Sequence[Any] = (), **extra: Any
    ) -> wire.Reply:
        """A verb about ``lease``, sent to the node that issued it."""
        args = {"table": lease.table, "lease_id": lease.lease_id, **extra}
        return self._call(self._conn_for_shard(lease.shard_id), verb, args, bodies)

    def ack(self, lease: Lease) -> None:
        """Mark the lease's rows consumed by its task. Fenced: LeaseExpired/UnknownLease."""
        if lease.lease_id:
            self._on_lease(lease, "ack")

    def extend(self, lease: Lease, seconds: float | None = None) -> float:
        """Renew the lease (``seconds`` from now, default the table's); returns the new deadline."""
        return float(self._on_lease(lease, "extend", seconds=seconds).result["deadline"])

    def release(self, lease: Lease, error: str | None = None) -> None:
        """Hand the rows back now. ``error`` counts as a failed delivery (and is the dead-letter
        reason if the row ends DEAD); None is a clean hand-back."""
        if lease.lease_id:
            self._on_lease(lease, "release", error=error)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lease_body(lease: Lease, data: pa.RecordBatch | pa.Table) -> pa.Buffer:
    """``data`` as a write body for the lease's rows (``row_id`` added from the lease if absent)."""
    batch = wire.to_batch(data)
    if ROW_ID not in batch.schema.names:
        batch = _with_row_ids(batch, lease.batch.column(ROW_ID))
    return wire.write_batch(batch)


def _with_row_ids(batch: pa.RecordBatch, row_ids: pa.Array) -> pa.RecordBatch:
    if len(row_ids) != batch.num_rows:
        raise ValueError(f"columns batch has {batch.num_rows} rows but {len(row_ids)} row ids")
    return pa.RecordBatch.from_arrays(
        [row_ids, *batch.columns], names=[ROW_ID, *batch.schema.names]
    )


def connect(addresses: str | Sequence[str], **kwargs: Any) -> Client:
    """A Client for one node address or a list of them (one per node)."""
    return Client(addresses, **kwargs)
