"""Requests parked by a store server: the waiting claims and puts, their limits and deadlines.

``ParkedRequests`` (a mixin of ``storage.server.Server``) keeps them; ``ParkedBook`` accounts for
them per node and per peer and refuses what would pass a limit. Rules: docs/store-protocol.md."""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import zmq

from storage import rpc, wire
from storage.errors import StoreError, StoreFull, TooManyWaiting

log = logging.getLogger("storage.server")

# A liveness probe: req_id 0 (no request's), which clients drop; see docs/store-protocol.md.
PROBE_FRAME = wire.pack_header({"ok": True, "req_id": 0, "error": None, "probe": True})


class ParkedBook:
    """Counts of parked requests of one server, checked against its limits."""

    def __init__(self, node_index: int, max_bytes: int, max_per_peer: int, max_claims: int):
        self.node_index = node_index
        self.max_bytes, self.max_per_peer, self.max_claims = max_bytes, max_per_peer, max_claims
        self.claims = 0
        self.puts = 0
        self.put_bytes = 0  # body bytes of parked puts
        self.per_peer: dict[bytes, int] = {}
        self.since: dict[bytes, float] = {}  # monotonic: when a peer's parked count left 0

    def admit(self, ident: bytes, verb: str, nbytes: int, table: str) -> None:
        """Count a request about to be parked, or raise the typed refusal naming the limit."""
        held = self.per_peer.get(ident, 0)
        peer = f"this peer already has {held} requests waiting (max_parked_per_peer "
        peer += f"{self.max_per_peer})"
        full = f"table {table!r} is at capacity and "
        if verb == "claim":
            if held >= self.max_per_peer:
                raise TooManyWaiting(peer)
            if self.claims >= self.max_claims:
                raise TooManyWaiting(f"node {self.node_index} already has {self.claims} claims "
                                     f"waiting (max_parked_claims {self.max_claims})")
            self.claims += 1
        else:
            if held >= self.max_per_peer:
                raise StoreFull(full + peer)
            if self.put_bytes + nbytes > self.max_bytes:
                raise StoreFull(f"{full}node {self.node_index} already holds {self.put_bytes} "
                                f"bytes of waiting puts (max_parked_bytes {self.max_bytes})")
            self.puts += 1
            self.put_bytes += nbytes
        self.per_peer[ident] = held + 1
        if not held:
            self.since[ident] = time.monotonic()

    def release(self, ident: bytes, verb: str, nbytes: int) -> None:
        """Count a parked request that left (answered, timed out, cancelled, dropped)."""
        if verb == "claim":
            self.claims -= 1
        else:
            self.puts -= 1
            self.put_bytes -= nbytes
        left = self.per_peer.get(ident, 0) - 1
        if left > 0:
            self.per_peer[ident] = left
        else:
            self.per_peer.pop(ident, None)
            self.since.pop(ident, None)

    def waiting_since(self, before: float) -> list[bytes]:
        """Peers that have had requests parked since ``before`` (monotonic) or earlier."""
        return [ident for ident, since in self.since.items() if since <= before]



@dataclass
class ParkedRequest(rpc.Parked):
    batch: pa.RecordBatch | None = None  # a parked put's rows
    nbytes: int = 0  # a parked put's body bytes (held until it leaves)


class ParkedRequests:
    """Mixin of ``Server``: claims waiting for rows and puts waiting for room (per table, FIFO)."""

    node: Any
    config: Any
    metrics: Any
    _sock: Any
    _book: ParkedBook
    _claims: dict[str, list[ParkedRequest]]
    _puts: dict[str, deque[ParkedRequest]]
    _dirty: set[str]

    def parked(self) -> dict[str, int]:
        """What is parked now: {"claims", "puts", "put_bytes", "peers"} (any thread)."""
        return {
            "claims": self._book.claims, "puts": self._book.puts, "put_bytes": self._book.put_bytes,
            "peers": len(self._book.per_peer),
        }

    def _park(self, p: ParkedRequest, verb: str) -> None:
        """Count a request about to be parked, or refuse it (limits in ServerConfig)."""
        try:
            self._book.admit(p.ident, verb, p.nbytes, p.req.args["table"])
        except StoreError:
            self.metrics.parked_refused.labels(verb).inc()
            raise

    def _unpark(self, p: ParkedRequest) -> None:
        """Count a parked request that left (answered, timed out, cancelled, dropped)."""
        self._book.release(p.ident, p.req.verb, p.nbytes)
        p.batch = None

    def _probe_peers(self) -> None:
        """Drop the parked requests of every peer whose connection is gone (a probe to it fails
        with EHOSTUNREACH; docs/store-protocol.md, "Departed peers")."""
        sock = self._sock
        gone = set()
        old = time.monotonic() - self.config.peer_probe_interval_s
        for ident in self._book.waiting_since(old):
            try:
                sock.send_multipart([ident, PROBE_FRAME], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == errno.EHOSTUNREACH:
                    gone.add(ident)
                # EAGAIN: the peer is there but slow to read; it keeps its requests
        if gone:
            self._drop_peers(gone)

    def _drop_peers(self, gone: set[bytes]) -> None:
        dropped = self._take(lambda p: p.ident in gone)
        if dropped:
            self.metrics.parked_dropped.inc(len(dropped))
            log.info("dropped %d parked requests of %d departed peers", len(dropped), len(gone))

    def _take(
        self, pred: Callable[[ParkedRequest], bool], tables: Iterable[str] | None = None
    ) -> list[ParkedRequest]:
        """Remove (claims first) and count as left the parked requests ``pred`` selects, of
        ``tables`` (None: all); the others keep their FIFO order. The caller answers them."""
        taken: list[ParkedRequest] = []
        for parked in (self._claims, self._puts):
            for table in list(parked) if tables is None else tables:
                taken += rpc.take(parked.get(table, []), pred)
        for p in taken:
            self._unpark(p)
        return taken

    def _parked_deadline(self, default: float) -> float:
        """The soonest deadline (monotonic) of a parked request, or ``default``."""
        for ps in (*self._claims.values(), *self._puts.values()):
            default = rpc.earliest(ps, default)
        return default

    def _answer_parked(self, exc: StoreError) -> None:
        """Answer every parked request with ``exc`` (shutdown) and forget them."""
        for p in self._take(lambda p: True):
            self._fail(p, exc)

    def _fail(self, p: ParkedRequest, exc: Exception) -> None:
        """Answer a parked request with ``exc`` (not a StoreError: a bug, "internal")."""
        self._reply_error(p.ident, p.req, rpc.as_store_error(exc, "a parked request"), p.t_recv)

    def _retry_parked(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for table in dirty:
            puts = self._puts.get(table)
            while puts:
                p = puts[0]
                try:
                    if not self._try_put(p.ident, p.req, p.batch, p.t_recv):
                        break
                except Exception as exc:
                    self._fail(p, exc)
                self._unpark(puts.popleft())
            claims = self._claims.get(table)
            if claims:
                self._retry_claims(table, claims)
        self._dirty.clear()  # changes made while retrying were just served

    def _retry_claims(self, table: str, claims: list[ParkedRequest]) -> None:
        keep: list[ParkedRequest] = []
        # (task, whole_groups, shards) with nothing ready (one empty shard says nothing of others)
        dry: set[tuple[str, bool, tuple[int, ...] | None]] = set()
        for p in claims:
            a = p.req.args
            if a["wake"] and self._wake_ready(a):  # another task it waits on has rows: end the wait
                self._unpark(p)
                self._reply_lease(p.ident, p.req, None, p.t_recv)
                continue
            shards = a["shards"]
            key = (a["task"], a["whole_groups"], None if shards is None else tuple(shards))
            if key in dry:
                keep.append(p)
                continue
            try:
                ready = self.node.ready_count(table, a["task"], whole_groups=a["whole_groups"],
                                              shards=a["shards"])
                lease = self._try_claim(p.req, a["min_rows"]) if ready >= a["min_rows"] else None
            except Exception as exc:
                self._unpark(p)
                self._fail(p, exc)
                continue
            if lease is None:
                if ready == 0:
                    dry.add(key)
                keep.append(p)
            else:
                self._unpark(p)
                self._reply_lease(p.ident, p.req, lease, p.t_recv)
        claims[:] = keep

    def _time_out_parked(self) -> None:
        """Answer the parked requests whose wait ran out: a claim gets one last try with
        ``min_rows=1``, a put (even one behind the head of its queue) ``StoreFull``."""
        now = time.monotonic()
        for p in self._take(lambda p: p.deadline <= now):
            try:
                if p.req.verb == "claim":
                    self._reply_lease(p.ident, p.req, self._try_claim(p.req, 1), p.t_recv)
                    continue
                a = p.req.args
                raise StoreFull(f"table {a.table!r} stayed at capacity for the put's timeout "
                                f"({a.timeout:.3g} s)")
            except Exception as exc:
                self._fail(p, exc)
