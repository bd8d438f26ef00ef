"""What each store verb does: the handlers of ``storage.server.Server`` (``_v_<verb>``).

Runs only on the server's loop thread; rules: docs/store-protocol.md."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from storage import wire
from storage.errors import BadRequest, StoreFull, UnknownTable
from storage.parking import ParkedRequest
from storage.schema import META_COLUMNS, ROW_ID


class StoreVerbs:
    """Mixin of ``Server``: one ``_v_<verb>(ident, req, t_recv)`` per verb of ``wire.VERBS``. Each
    queues its reply (``_queue``/``_reply_error``) or parks the request; none blocks."""

    node: Any
    config: Any
    _claims: dict[str, list[ParkedRequest]]
    _puts: dict[str, deque[ParkedRequest]]
    _empty_bodies: dict[tuple[str, tuple[str, ...]], pa.Buffer]
    _dirty: set[str]
    _take: Callable[..., list[ParkedRequest]]
    _fail: Callable[[ParkedRequest, Exception], None]
    parked: Callable[[], dict[str, int]]

    def _v_hello(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        shard_ids, protocol = list(self.node.shard_ids), wire.PROTOCOL_VERSION
        # parked: what waits on this node now (Server.parked), for operators and tests
        return {"node_index": self.config.node_index, "shard_ids": shard_ids, "protocol": protocol,
                "parked": self.parked()}

    def _v_tables(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        return {"tables": list(self.node.table_names())}

    def _v_create_table(self, ident: bytes, req: wire.Request, t: float) -> None:
        spec = wire.spec_from_wire(req.args.spec)
        self.node.create_table(spec)
        self._empty_bodies.clear()
        self._queue(ident, req, {}, t, mutated=spec.name)

    def _v_drop_table(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        table = req.args.table
        self.node.drop_table(table)
        self._empty_bodies.clear()
        for p in self._take(lambda p: True, [table]):
            self._fail(p, UnknownTable(f"table {table!r} was dropped"))
        self._claims.pop(table, None)
        self._puts.pop(table, None)
        return {}

    def _v_put(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        batch = wire.read_batch(req.bodies[0], "put body")
        self.node.table_spec(a.table)  # UnknownTable before parking anything
        if not self._puts.get(a.table) and self._try_put(ident, req, batch, t):
            return
        if a.timeout <= 0:
            raise StoreFull(f"table {a.table!r} is at capacity")
        deadline = time.monotonic() + a.timeout
        parked = ParkedRequest(ident, req, t, deadline, batch, nbytes=req.bodies[0].size)
        self._park(parked, "put")
        self._puts.setdefault(a.table, deque()).append(parked)

    def _try_put(self, ident: bytes, req: wire.Request, batch: pa.RecordBatch, t: float) -> bool:
        table = req.args.table
        try:
            row_ids = self.node.put(table, batch, shard_id=req.args.shard_id)
        except StoreFull:
            return False
        # depth: live rows of the table on this node, a hint for client-side placement
        result = {"row_ids": wire.row_ids_to_bytes(row_ids), "depth": self.node.live_rows(table)}
        self._queue(ident, req, result, t, mutated=table)
        return True

    def _v_claim(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        if a.wake:  # unknown task names fail before the piggybacked ack, like the claim's own
            self._wake_ready(a)
        if a.ack_lease_id is not None:
            self._piggybacked_ack(req)
        lease = self._try_claim(req, a.min_rows)
        if lease is None and a.timeout > 0 and not (a.wake and self._wake_ready(a)):
            parked = ParkedRequest(ident, req, t, time.monotonic() + a.timeout)
            self._park(parked, "claim")
            self._claims.setdefault(a.table, []).append(parked)
            return
        if lease is None:
            lease = self._try_claim(req, 1)
        self._reply_lease(ident, req, lease, t)

    def _piggybacked_ack(self, req: wire.Request) -> None:
        """A claim's ack (and write) of the previous lease, before the claim (protocol doc): the
        claim's own arguments are checked first, so any error up to the ack leaves nothing
        applied; ``req.acked`` then marks every later error reply of this request."""
        a = req.args
        self.node.check_claim(a.table, a.task, a.columns, a.max_rows, **self._claim_options(a))
        if req.bodies:
            batch = wire.read_batch(req.bodies[0], "claim body (columns to write)")
            self.node.write(a.table, batch, lease_id=a.ack_lease_id, ack=True)
        else:
            self.node.ack(a.table, a.ack_lease_id)
        req.bodies = []  # written: a claim that now waits must not hold the body's memory
        req.acked = True
        self._dirty.add(a.table)  # written columns may make rows ready for other tasks
        self._note_mutation(a.table)

    def _wake_ready(self, a: Any) -> bool:
        """Whether one of a claim's ``wake`` tasks has ready rows (on the claim's shards)."""
        return any(self.node.ready_count(a.table, task, shards=a.shards) > 0 for task in a.wake)

    @staticmethod
    def _claim_options(a: Any, min_rows: int | None = None) -> dict[str, Any]:
        return {
            "min_rows": a.min_rows if min_rows is None else min_rows,
            "whole_groups": a.whole_groups, "lease_seconds": a.lease_seconds, "shards": a.shards,
        }

    def _try_claim(self, req: wire.Request, min_rows: int) -> Any:
        a = req.args
        return self.node.claim(a.table, a.task, a.columns, a.max_rows,
                               **self._claim_options(a, min_rows))

    def _reply_lease(self, ident: bytes, req: wire.Request, lease: Any, t: float) -> None:
        a = req.args
        if lease is None:
            key = (a.table, tuple(a.columns))
            body = self._empty_bodies.get(key)
            if body is None:
                body = wire.write_batch(self._empty_batch(a.table, a.columns))
                if len(self._empty_bodies) >= 1024:  # bounded: columns come from clients
                    self._empty_bodies.clear()
                self._empty_bodies[key] = body
            empty = {"lease_id": 0, "shard_id": 0, "deadline": 0.0}
            self._queue(ident, req, empty, t, [body])
            return
        result = {"lease_id": lease.lease_id, "shard_id": lease.shard_id}
        result["deadline"] = lease.deadline

        # An undeliverable lease is handed back at once instead of stranding its rows.
        def undo() -> None:
            self.node.release(a.table, lease.lease_id)
            self._dirty.add(a.table)

        self._queue(ident, req, result, t, [wire.write_batch(lease.batch)], undo=undo)

    def _empty_batch(self, table: str, columns: Sequence[str]) -> pa.RecordBatch:
        schema = self.node.table_spec(table).schema
        fields = []
        for name in [*columns, ROW_ID, "deliveries"]:
            if name in META_COLUMNS:
                fields.append(pa.field(name, META_COLUMNS[name]))
            elif schema.get_field_index(name) >= 0:
                fields.append(schema.field(name))
            else:
                raise BadRequest(f"claim.columns: unknown column {name!r} in table {table!r}")
        return pa.RecordBatch.from_pylist([], schema=pa.schema(fields))

    def _v_write(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        batch = wire.read_batch(req.bodies[0], "write body")
        self.node.write(a.table, batch, lease_id=a.lease_id, ack=a.ack, overwrite=a.overwrite)
        self._queue(ident, req, {}, t, mutated=a.table)

    def _v_ack(self, ident: bytes, req: wire.Request, t: float) -> None:
        self.node.ack(req.args.table, req.args.lease_id)
        self._queue(ident, req, {}, t, mutated=req.args.table)

    def _v_extend(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        a = req.args
        return {"deadline": self.node.extend(a.table, a.lease_id, a.seconds)}

    def _v_release(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        self.node.release(a.table, a.lease_id, error=a.error)
        self._queue(ident, req, {}, t, mutated=a.table)

    def _v_stats(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        return {"stats": wire.stats_to_wire(self.node.stats(req.args.table))}

    def _v_clear(self, ident: bytes, req: wire.Request, t: float) -> None:
        freed = self.node.clear(req.args.table, dead=req.args.dead)
        self._queue(ident, req, {"freed": int(freed)}, t, mutated=req.args.table)

    def _v_snapshot(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        return {"path": str(self.node.snapshot(req.args.table))}

    def _v_cancel(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        """End a parked claim of the same peer early (its reply: an empty lease)."""
        target = req.args.target
        for p in self._take(lambda p: p.ident == ident and p.req.req_id == target
                            and p.req.verb == "claim"):
            self._reply_lease(p.ident, p.req, None, p.t_recv)
            return {"cancelled": True}
        return {"cancelled": False}
