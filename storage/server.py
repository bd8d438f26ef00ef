"""A store node behind a ZeroMQ ROUTER socket: one loop thread that owns one ``StoreNode``.

Owns: the socket(s), request validation (via ``wire``), long-poll claims and capacity-waiting puts
parked server-side (their limits counted by ``parking.ParkedBook``), the probes that find departed
peers, lease-expiry timers, fsync before replies, metrics, clean shutdown, and the node's command
line (``python -m storage``).

The loop (one thread; the node is never touched by any other thread, so it needs no locks)::

    poll(timeout = min(next lease deadline, next parked deadline, fsync/metrics timers, 100 ms))
      -> drain up to MAX_BATCH requests: validate, run the verb, queue the reply, or PARK it
      -> node.expire()                       leases past their deadline: rows READY again / DEAD
      -> retry parked claims/puts of tables that changed (FIFO; a put waits behind older puts)
      -> answer parked requests whose wait ran out (claim: one last try with min_rows=1, then an
         empty lease; put: StoreFull)
      -> node.sync() if a queued reply acknowledges a mutation of an fsync="always" table
      -> send the queued replies (group commit: one fsync covers the whole batch)

Delivery guarantees are stated in ``storage/wire.py``. What this module adds:
- Nothing from the network reaches the node unvalidated; a bad request gets a typed error reply.
- A handler exception that is not a ``StoreError`` is logged and answered with code "internal";
  the loop goes on. No request can block the loop: waits are parked, never slept.
- A reply is sent without blocking; if the peer is gone (ROUTER_MANDATORY) or its queue is full,
  the reply is dropped and logged (the client times out with ``Unavailable``).
- Shutdown (``stop()``, SIGTERM/SIGINT in ``serve``): every parked request is answered with
  ``ShuttingDown``, replies are flushed, sockets closed (linger 1 s), the node closed.
- Parked requests are bounded (limits in ``ServerConfig``, rules in ``storage/wire.py``): body
  bytes of parked puts per node, parked requests per peer, parked claims per node; and a peer
  that is gone loses its parked requests within ``peer_probe_interval_s`` (a probe to each
  peer with parked requests; ROUTER_MANDATORY says whether its connection still exists).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import zmq

from storage import wire
from storage.errors import (
    BadRequest,
    ShuttingDown,
    StoreError,
    StoreFull,
    UnknownTable,
)
from storage.metrics import StoreMetrics
from storage.parking import ParkedBook
from storage.schema import META_COLUMNS, ROW_ID

log = logging.getLogger("storage.server")

MAX_BATCH = 256  # requests handled between two expire/park/flush rounds
MAX_POLL_S = 0.1  # upper bound on one poll, so stop() is noticed promptly
SYNC_TICK_S = 0.02  # how often node.sync() runs while an fsync="interval" table has been written
# A message with req_id 0 sent by the node is a liveness probe (clients never use req_id 0 and
# drop replies that match none of their requests), see storage/wire.py.
PROBE_FRAME = wire.pack_header({"ok": True, "req_id": 0, "error": None, "probe": True})


class InternalError(StoreError):
    code = "internal"


class StartError(RuntimeError):
    """The node could not start: one line naming the address and the option (``--bind`` /
    ``--metrics-port``) that failed, e.g. a port already in use."""


@dataclass
class ServerConfig:
    """How a store node listens. Defaults are safe: loopback only, no metrics port."""

    bind: Sequence[str] = ("tcp://127.0.0.1:5555",)  # "tcp://127.0.0.1:0" picks a free port
    num_shards: int = 1
    node_index: int = 0
    metrics_port: int | None = None  # None = off; 0 = pick a free port
    metrics_addr: str = "127.0.0.1"
    metrics_interval_s: float = 1.0
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    # Persistence root (the node's own: clients only name tables): every table of this node is
    # kept in <persist_dir>/<table> and recovered at start. None = memory only.
    persist_dir: str | None = None
    # Bounds on requests parked server-side (see storage/wire.py "Parked requests").
    max_parked_bytes: int = 256 << 20  # body bytes of puts waiting for room, whole node
    max_parked_per_peer: int = 256  # claims + puts one peer (connection) may have parked
    max_parked_claims: int = 65536  # claims parked, whole node
    peer_probe_interval_s: float = 1.0  # how often peers with parked requests are checked
    # CURVE: all three or none. Clients whose public key is not listed are refused (fail closed).
    curve_secret_key: bytes | None = None
    curve_public_key: bytes | None = None
    curve_allowed_clients: Sequence[bytes] = ()

    def __post_init__(self) -> None:
        if isinstance(self.bind, str):
            self.bind = (self.bind,)
        if not self.bind:
            raise ValueError("ServerConfig.bind needs at least one address")
        if not 1 <= self.num_shards <= 256:
            raise ValueError(f"ServerConfig.num_shards must be in 1..256, got {self.num_shards}")
        if not 0 <= self.node_index <= 255:
            raise ValueError(f"ServerConfig.node_index must be in 0..255, got {self.node_index}")
        if self.max_message_bytes < 1024:
            raise ValueError("ServerConfig.max_message_bytes must be >= 1024")
        for name in ("max_parked_bytes", "max_parked_per_peer", "max_parked_claims"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"ServerConfig.{name} must be an int >= 0")
        if not 0.01 <= self.peer_probe_interval_s <= 3600:
            raise ValueError("ServerConfig.peer_probe_interval_s must be in [0.01, 3600]")
        if (self.curve_secret_key is None) != (self.curve_public_key is None):
            raise ValueError("ServerConfig: curve_secret_key and curve_public_key go together")


@dataclass
class _Parked:
    ident: bytes
    req: wire.Request
    t_recv: float  # perf_counter at receipt, for the duration histogram
    deadline: float  # monotonic
    batch: pa.RecordBatch | None = None  # a parked put's rows
    nbytes: int = 0  # a parked put's body bytes (held until it leaves)


@dataclass
class _Outbox:
    # (peer, frames, verb, t_recv, undo): undo runs if the reply cannot be delivered.
    replies: list[tuple[bytes, list, str, float, Callable[[], None] | None]] = field(
        default_factory=list
    )
    needs_sync: bool = False


class Server:
    """One store node. ``run()`` in the foreground, or ``start()``/``stop()`` for a thread."""

    def __init__(
        self, config: ServerConfig, *, context: zmq.Context | None = None, node: Any = None
    ) -> None:
        self.config = config
        self.context = context or zmq.Context.instance()
        self.metrics = StoreMetrics(config.node_index)
        if node is None:
            from storage.node import StoreNode  # lazy: the wire layer is usable without it

            node = StoreNode(
                config.node_index,
                config.num_shards,
                events=self.metrics,
                persist_root=config.persist_dir,
            )
            self.metrics.set_recovered(node.recovered)
        self.node = node
        self.addresses: list[str] = []
        self.metrics_port: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._auth: Any = None
        self._claims: dict[str, list[_Parked]] = {}
        # Encoded empty-lease bodies by (table, columns): an idle consumer's claim answers with
        # one, and building it (schema lookup + empty batch + IPC stream) cost more than the
        # rest of the request. Cleared whenever a table is created or dropped (its schema).
        self._empty_bodies: dict[tuple[str, tuple[str, ...]], pa.Buffer] = {}
        self._puts: dict[str, deque[_Parked]] = {}
        self._book = ParkedBook(
            config.node_index,
            config.max_parked_bytes,
            config.max_parked_per_peer,
            config.max_parked_claims,
        )
        self._last_probe = 0.0
        self._dirty: set[str] = set()
        self._out = _Outbox()
        self._last_metrics = 0.0
        self._last_interval_sync = 0.0
        self._interval_dirty = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> Server:
        """Run the loop in a daemon thread; returns once bound (raises the bind error if any)."""
        self._thread = threading.Thread(target=self._run_thread, name="store-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("store server did not start in time")
        if self._start_error is not None:
            raise self._start_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to shut down (thread-safe, signal-safe) and wait for it when threaded."""
        self._stop.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_thread(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            if exc is not self._start_error:  # a start error is raised by start() instead
                raise

    def run(self) -> None:
        """Bind, serve until stop(), shut down cleanly. Runs in the calling thread."""
        try:
            self._open()
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            self._close()
            raise
        self._ready.set()
        log.info("store node %d serving %s", self.config.node_index, self.addresses)
        try:
            self._loop()
        finally:
            self._shutdown()

    def _open(self) -> None:
        cfg = self.config
        sock = self.context.socket(zmq.ROUTER)
        self._sock = sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # ZMTP heartbeats: a peer whose host vanished (no FIN) loses its connection, and so its
        # route, within ~10 s; the peer probe then drops its parked requests.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
        if cfg.curve_secret_key is not None:
            from zmq.auth.thread import ThreadAuthenticator

            allowed = {bytes(k) for k in cfg.curve_allowed_clients}

            class _Keys:
                def callback(self, domain: str, key: bytes) -> bool:
                    return bytes(key) in allowed

            self._auth = ThreadAuthenticator(self.context)
            self._auth.start()
            self._auth.configure_curve_callback(domain="streamflow", credentials_provider=_Keys())
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve_secret_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve_public_key)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"streamflow")
        for addr in cfg.bind:
            if addr.startswith("tcp://") and addr.endswith(":0"):
                addr = addr[:-2] + ":*"
            try:
                sock.bind(addr)
            except zmq.ZMQError as exc:
                reason = zmq.strerror(exc.errno)  # exc.strerror repeats the address
                raise StartError(f"--bind {addr}: cannot bind: {reason}") from None
            self.addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http(cfg.metrics_addr, cfg.metrics_port)
            except OSError as exc:
                raise StartError(
                    f"--metrics-port {cfg.metrics_addr}:{cfg.metrics_port}: cannot bind: "
                    f"{exc.strerror or exc}"
                ) from None

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.metrics.stop_http()

    def _shutdown(self) -> None:
        for parked in [p for ps in self._claims.values() for p in ps] + [
            p for ps in self._puts.values() for p in ps
        ]:
            self._queue_error(
                parked.ident, parked.req, ShuttingDown("store node is shutting down"), parked.t_recv
            )
        self._claims.clear()
        self._puts.clear()
        self._book.clear()
        try:
            self._flush()
        except Exception:
            log.exception("flushing replies at shutdown")
        self._close()
        try:
            self.node.close()
        except Exception:
            log.exception("closing the store node")
        log.info("store node %d stopped", self.config.node_index)

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(self._poll_timeout_ms()))
            if sock in events:
                # Drain what is queued (up to MAX_BATCH) before the expire/retry/flush round, so
                # parked claims are retried once per batch, not once per request. ZMQ_EVENTS says
                # whether a message is waiting, which is cheaper than a recv raising Again.
                for _ in range(MAX_BATCH):
                    if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            for step in (
                self._expire,
                self._retry_parked,
                self._time_out_parked,
                self._flush,
                self._timers,
            ):
                try:
                    step()
                except Exception:  # a bug must not take the node down; log it and go on
                    log.exception("server loop step %s failed", step.__name__)

    def _poll_timeout_ms(self) -> int:
        now_wall, now_mono = time.time(), time.monotonic()
        wait = SYNC_TICK_S if self._interval_dirty else MAX_POLL_S
        deadline = self.node.next_deadline()
        if deadline is not None:
            wait = min(wait, deadline - now_wall)
        for ps in self._claims.values():
            for p in ps:
                wait = min(wait, p.deadline - now_mono)
        for ps in self._puts.values():
            if ps:
                wait = min(wait, min(p.deadline for p in ps) - now_mono)
        return max(0, int(wait * 1000) + 1)

    def _expire(self) -> None:
        deadline = self.node.next_deadline()
        if deadline is not None and deadline <= time.time() and self.node.expire():
            self._dirty.update(self._claims)  # expired rows are READY again
            self._dirty.update(self._puts)  # DEAD rows may have freed nothing, but cheap to check

    def _timers(self) -> None:
        now = time.monotonic()
        if self._book.per_peer and now - self._last_probe >= self.config.peer_probe_interval_s:
            self._last_probe = now
            self._probe_peers()
        if self._interval_dirty and now - self._last_interval_sync >= SYNC_TICK_S:
            # fsync="interval": the node syncs each table once its own interval has passed.
            self.node.sync()
            self._last_interval_sync = now
        if self.config.metrics_port is not None and now - self._last_metrics >= (
            self.config.metrics_interval_s
        ):
            self._last_metrics = now
            try:
                self.metrics.refresh(self.node)
                self.metrics.set_parked(self.parked())
            except Exception:
                log.exception("refreshing metrics")

    # -- parked-request bookkeeping --------------------------------------------------------------
    def parked(self) -> dict[str, int]:
        """What is parked now: {"claims", "puts", "put_bytes", "peers"}."""
        return {
            "claims": self._book.claims,
            "puts": sum(len(ps) for ps in self._puts.values()),
            "put_bytes": self._book.put_bytes,
            "peers": len(self._book.per_peer),
        }

    def _park(self, p: _Parked, verb: str) -> None:
        """Count a request about to be parked, or refuse it (limits in ServerConfig)."""
        try:
            self._book.admit(p.ident, verb, p.nbytes, p.req.args["table"])
        except StoreError:
            self.metrics.parked_refused.labels(verb).inc()
            raise

    def _unpark(self, p: _Parked) -> None:
        """Count a parked request that left (answered, timed out, cancelled, dropped)."""
        self._book.release(p.ident, p.req.verb, p.nbytes)
        p.batch = None

    def _probe_peers(self) -> None:
        """Drop the parked requests of every peer whose connection is gone: a send to it fails
        with EHOSTUNREACH (ROUTER_MANDATORY) once ZeroMQ removed its route (closed socket,
        closed TCP connection, or missed heartbeats). A live peer gets one small message with
        req_id 0, which clients ignore; only peers that have had requests parked for a whole
        interval are probed (a short long-poll never sees a probe)."""
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
        dropped = 0
        for claims in self._claims.values():
            keep = [p for p in claims if p.ident not in gone]
            for p in claims:
                if p.ident in gone:
                    self._unpark(p)
            dropped += len(claims) - len(keep)
            claims[:] = keep
        for puts in self._puts.values():
            for p in [p for p in puts if p.ident in gone]:
                puts.remove(p)
                self._unpark(p)
                dropped += 1
        if dropped:
            self.metrics.parked_dropped.inc(dropped)
            log.info("dropped %d parked requests of %d departed peers", dropped, len(gone))

    # -- one request -----------------------------------------------------------------------------
    def _handle(self, frames: list) -> None:
        t_recv = time.perf_counter()
        if len(frames) < 2:  # only a ROUTER identity: nothing to answer
            return
        ident = frames[0].bytes
        self.metrics.bytes_received.inc(sum(len(f) for f in frames[1:]))
        try:
            req = wire.decode_request(frames[1:])
        except BadRequest as exc:
            self.metrics.bad_requests.inc()
            req = wire.Request("invalid", getattr(exc, "req_id", 0), {})
            self._queue_error(ident, req, exc, t_recv)
            return
        except Exception as exc:  # a bug in validation must not kill the loop
            log.exception("decoding a request")
            self._queue_error(
                ident, wire.Request("invalid", 0, {}), InternalError(repr(exc)), t_recv
            )
            return
        try:
            handler = getattr(self, "_v_" + req.verb)
            handler(ident, req, t_recv)
        except StoreError as exc:
            if isinstance(exc, BadRequest):
                self.metrics.bad_requests.inc()
            self._queue_error(ident, req, exc, t_recv)
        except Exception as exc:
            log.exception("verb %s failed", req.verb)
            self._queue_error(ident, req, InternalError(f"{type(exc).__name__}: {exc}"), t_recv)

    def _queue(
        self,
        ident: bytes,
        req: wire.Request,
        result: dict[str, Any],
        t_recv: float,
        bodies: Sequence[Any] = (),
        *,
        mutated: str | None = None,
        undo: Callable[[], None] | None = None,
    ) -> None:
        self._out.replies.append(
            (ident, wire.encode_reply(req.req_id, result, bodies), req.verb, t_recv, undo)
        )
        if mutated is not None:
            self._dirty.add(mutated)
            if req.verb in wire.MUTATING_VERBS:
                self._note_mutation(mutated)

    def _queue_error(self, ident: bytes, req: wire.Request, exc: StoreError, t_recv: float) -> None:
        self._out.replies.append(
            (ident, wire.encode_error(req.req_id, exc, acked=req.acked), req.verb, t_recv, None)
        )

    def _note_mutation(self, table: str) -> None:
        try:
            policy = self.node.table_spec(table).fsync
        except StoreError:
            return
        if policy == "always":
            self._out.needs_sync = True
        elif policy == "interval":
            self._interval_dirty = True

    def _flush(self) -> None:
        out, self._out = self._out, _Outbox()
        if out.needs_sync:
            self.node.sync()  # durable before acknowledged (fsync="always")
        sock = self._sock
        now = time.perf_counter()
        for ident, frames, verb, t_recv, undo in out.replies:
            try:
                sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
                log.warning("dropping %s reply: %s", verb, exc)
                if undo is not None:
                    self._undo(undo)
                continue
            self.metrics.bytes_sent.inc(sum(len(f) for f in frames))
            if verb in wire.VERBS:
                self.metrics.observe_request(verb, now - t_recv)

    def _undo(self, undo: Callable[[], None]) -> None:
        try:
            undo()
        except StoreError:
            pass  # e.g. the lease expired meanwhile: nothing left to undo
        except Exception:
            log.exception("undoing an undeliverable reply")

    # -- verbs -----------------------------------------------------------------------------------
    def _v_hello(self, ident: bytes, req: wire.Request, t: float) -> None:
        self._queue(
            ident,
            req,
            {
                "node_index": self.config.node_index,
                "shard_ids": list(self.node.shard_ids),
                "protocol": wire.PROTOCOL_VERSION,
            },
            t,
        )

    def _v_tables(self, ident: bytes, req: wire.Request, t: float) -> None:
        self._queue(ident, req, {"tables": list(self.node.table_names())}, t)

    def _v_create_table(self, ident: bytes, req: wire.Request, t: float) -> None:
        spec = wire.spec_from_wire(req.args["spec"])
        self.node.create_table(spec)
        self._empty_bodies.clear()
        self._queue(ident, req, {}, t, mutated=spec.name)

    def _v_drop_table(self, ident: bytes, req: wire.Request, t: float) -> None:
        table = req.args["table"]
        self.node.drop_table(table)
        self._empty_bodies.clear()
        for p in self._claims.pop(table, []) + list(self._puts.pop(table, ())):
            self._unpark(p)
            self._queue_error(
                p.ident, p.req, UnknownTable(f"table {table!r} was dropped"), p.t_recv
            )
        self._queue(ident, req, {}, t)

    def _v_put(self, ident: bytes, req: wire.Request, t: float) -> None:
        table = req.args["table"]
        batch = wire.read_batch(req.bodies[0], "put body")
        self.node.table_spec(table)  # UnknownTable before parking anything
        waiting = self._puts.get(table)
        if not waiting and self._try_put(ident, req, batch, t):
            return
        if req.args["timeout"] <= 0:
            raise StoreFull(f"table {table!r} is at capacity")
        deadline = time.monotonic() + req.args["timeout"]
        parked = _Parked(ident, req, t, deadline, batch, nbytes=req.bodies[0].size)
        self._park(parked, "put")
        self._puts.setdefault(table, deque()).append(parked)

    def _try_put(self, ident: bytes, req: wire.Request, batch: pa.RecordBatch, t: float) -> bool:
        table = req.args["table"]
        try:
            row_ids = self.node.put(table, batch, shard_id=req.args["shard_id"])
        except StoreFull:
            return False
        self._queue(
            ident,
            req,
            {"row_ids": wire.row_ids_to_bytes(row_ids), "depth": self._depth(table)},
            t,
            mutated=table,
        )
        return True

    def _depth(self, table: str) -> int:
        """Live rows of a table on this node (a hint for client-side placement): O(shards)."""
        return self.node.live_rows(table)

    def _v_claim(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        if a["ack_lease_id"] is not None:
            self._piggybacked_ack(req)
        lease = self._try_claim(req, a["min_rows"])
        if lease is None and a["timeout"] > 0:
            parked = _Parked(ident, req, t, time.monotonic() + a["timeout"])
            self._park(parked, "claim")
            self._claims.setdefault(a["table"], []).append(parked)
            return
        if lease is None:
            lease = self._try_claim(req, 1)
        self._reply_lease(ident, req, lease, t)

    def _piggybacked_ack(self, req: wire.Request) -> None:
        """A claim's ack (and write) of the previous lease, before the claim (rules in wire.py):
        the claim's own arguments are checked first, so any error up to the ack leaves nothing
        applied; ``req.acked`` then marks every later error reply of this request."""
        a = req.args
        table = a["table"]
        self.node.check_claim(
            table,
            a["task"],
            a["columns"],
            a["max_rows"],
            min_rows=a["min_rows"],
            whole_groups=a["whole_groups"],
            lease_seconds=a["lease_seconds"],
            shards=a["shards"],
        )
        if req.bodies:
            batch = wire.read_batch(req.bodies[0], "claim body (columns to write)")
            self.node.write(table, batch, lease_id=a["ack_lease_id"], ack=True)
        else:
            self.node.ack(table, a["ack_lease_id"])
        req.bodies = []  # written: a claim that now waits must not hold the body's memory
        req.acked = True
        self._dirty.add(table)  # written columns may make rows ready for other tasks
        self._note_mutation(table)

    def _try_claim(self, req: wire.Request, min_rows: int) -> Any:
        a = req.args
        return self.node.claim(
            a["table"],
            a["task"],
            a["columns"],
            a["max_rows"],
            min_rows=min_rows,
            whole_groups=a["whole_groups"],
            lease_seconds=a["lease_seconds"],
            shards=a["shards"],
        )

    def _reply_lease(self, ident: bytes, req: wire.Request, lease: Any, t: float) -> None:
        a = req.args
        if lease is None:
            key = (a["table"], tuple(a["columns"]))
            body = self._empty_bodies.get(key)
            if body is None:
                body = wire.write_batch(self._empty_batch(a["table"], a["columns"]))
                if len(self._empty_bodies) >= 1024:  # bounded: columns come from clients
                    self._empty_bodies.clear()
                self._empty_bodies[key] = body
            empty = {"lease_id": 0, "shard_id": 0, "deadline": 0.0}
            self._queue(ident, req, empty, t, [body])
            return
        result = {
            "lease_id": lease.lease_id,
            "shard_id": lease.shard_id,
            "deadline": lease.deadline,
        }

        # A lease whose reply cannot be delivered (the consumer is gone) is handed back at once
        # instead of stranding its rows until the deadline.
        def undo() -> None:
            self.node.release(a["table"], lease.lease_id)
            self._dirty.add(a["table"])

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
        self.node.write(
            a["table"], batch, lease_id=a["lease_id"], ack=a["ack"], overwrite=a["overwrite"]
        )
        self._queue(ident, req, {}, t, mutated=a["table"])

    def _v_ack(self, ident: bytes, req: wire.Request, t: float) -> None:
        self.node.ack(req.args["table"], req.args["lease_id"])
        self._queue(ident, req, {}, t, mutated=req.args["table"])

    def _v_extend(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        deadline = self.node.extend(a["table"], a["lease_id"], a["seconds"])
        self._queue(ident, req, {"deadline": deadline}, t)

    def _v_release(self, ident: bytes, req: wire.Request, t: float) -> None:
        a = req.args
        self.node.release(a["table"], a["lease_id"], error=a["error"])
        self._queue(ident, req, {}, t, mutated=a["table"])

    def _v_stats(self, ident: bytes, req: wire.Request, t: float) -> None:
        stats = self.node.stats(req.args["table"])
        self._queue(ident, req, {"stats": wire.stats_to_wire(stats)}, t)

    def _v_clear(self, ident: bytes, req: wire.Request, t: float) -> None:
        freed = self.node.clear(req.args["table"], dead=req.args["dead"])
        self._queue(ident, req, {"freed": int(freed)}, t, mutated=req.args["table"])

    def _v_snapshot(self, ident: bytes, req: wire.Request, t: float) -> None:
        path = self.node.snapshot(req.args["table"])
        self._queue(ident, req, {"path": str(path)}, t)

    def _v_cancel(self, ident: bytes, req: wire.Request, t: float) -> None:
        """End a parked claim of the same peer early (its reply: an empty lease)."""
        target = req.args["target"]
        for ps in self._claims.values():
            for i, p in enumerate(ps):
                if p.ident == ident and p.req.req_id == target:
                    del ps[i]
                    self._unpark(p)
                    self._reply_lease(p.ident, p.req, None, p.t_recv)
                    self._queue(ident, req, {"cancelled": True}, t)
                    return
        self._queue(ident, req, {"cancelled": False}, t)

    # -- parked requests -------------------------------------------------------------------------
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
                    self._queue_error(p.ident, p.req, _as_store_error(exc), p.t_recv)
                self._unpark(puts.popleft())
            claims = self._claims.get(table)
            if claims:
                self._retry_claims(table, claims)
        self._dirty.clear()  # changes made while retrying were just served

    def _retry_claims(self, table: str, claims: list[_Parked]) -> None:
        keep: list[_Parked] = []
        # (task, whole_groups, shards) with nothing ready. The shards are part of the key: a
        # claim limited to one shard finding it empty says nothing about the other shards.
        dry: set[tuple[str, bool, tuple[int, ...] | None]] = set()
        for p in claims:
            a = p.req.args
            shards = a["shards"]
            key = (a["task"], a["whole_groups"], None if shards is None else tuple(shards))
            if key in dry:
                keep.append(p)
                continue
            try:
                ready = self.node.ready_count(
                    table, a["task"], whole_groups=a["whole_groups"], shards=a["shards"]
                )
                lease = self._try_claim(p.req, a["min_rows"]) if ready >= a["min_rows"] else None
            except Exception as exc:
                self._unpark(p)
                self._queue_error(p.ident, p.req, _as_store_error(exc), p.t_recv)
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
        now = time.monotonic()
        for claims in self._claims.values():
            if not any(p.deadline <= now for p in claims):
                continue
            keep = []
            for p in claims:
                if p.deadline > now:
                    keep.append(p)
                    continue
                self._unpark(p)
                try:
                    self._reply_lease(p.ident, p.req, self._try_claim(p.req, 1), p.t_recv)
                except Exception as exc:
                    self._queue_error(p.ident, p.req, _as_store_error(exc), p.t_recv)
            claims[:] = keep
        for table, puts in self._puts.items():
            while puts and puts[0].deadline <= now:
                p = puts.popleft()
                self._unpark(p)
                self._queue_error(
                    p.ident,
                    p.req,
                    StoreFull(
                        f"table {table!r} stayed at capacity for the put's timeout "
                        f"({p.req.args['timeout']:.3g} s)"
                    ),
                    p.t_recv,
                )
            # Later puts with shorter timeouts wait behind the head; expire them too.
            for p in [p for p in puts if p.deadline <= now]:
                puts.remove(p)
                self._unpark(p)
                self._queue_error(
                    p.ident, p.req, StoreFull(f"table {table!r} is at capacity"), p.t_recv
                )


def _as_store_error(exc: Exception) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    log.error("internal error in a parked request", exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {exc}")


# -- entry points ---------------------------------------------------------------------------------


def serve(config: ServerConfig, *, ready_file: str | None = None) -> None:
    """Run a store node in the foreground until SIGTERM/SIGINT (then shut down cleanly).

    With ``ready_file``, write {"addresses", "metrics_port", "pid"} as JSON there (atomically)
    once bound, so a parent process knows where to connect (``--bind tcp://127.0.0.1:0``)."""
    context = zmq.Context()
    try:
        server = Server(config, context=context)
    except BaseException:
        context.term()
        raise

    def _on_signal(signum: int, frame: Any) -> None:
        server.stop(timeout=0)

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(
                    {
                        "addresses": server.addresses,
                        "metrics_port": server.metrics_port,
                        "pid": os.getpid(),
                    },
                    fh,
                )
            os.replace(tmp, ready_file)
        while server.running:
            time.sleep(0.1)  # the main thread only waits for signals; the loop thread serves
    finally:
        server.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        server.context.term()


def spawn_node(
    shards: int, ready_dir: str | os.PathLike, *, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[str]]:
    """Start ``python -m storage.server`` on a free 127.0.0.1 port as a child process (for
    benchmarks and tests); returns (process, addresses) once it is bound, or kills it and raises
    RuntimeError if it exits or is not ready within 60 s."""
    ready = Path(ready_dir) / f"store-ready-{uuid.uuid4().hex[:8]}.json"
    cmd = [
        sys.executable,
        "-m",
        "storage.server",
        "--bind",
        "tcp://127.0.0.1:0",
        "--shards",
        str(shards),
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(15)
            raise RuntimeError("the store node did not start")
        time.sleep(0.02)
    return proc, list(json.loads(ready.read_text())["addresses"])


def inproc_address() -> str:
    return f"inproc://streamflow-store-{uuid.uuid4().hex}"


def main(argv: Sequence[str] | None = None) -> int:
    """python -m storage.server --bind tcp://127.0.0.1:5555 --shards 2 --metrics-port 0
    [--persist-dir DIR]. Bad options or a failed start: one line on stderr, exit 2."""
    prog = "python -m storage"
    ap = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    ap.add_argument(
        "--bind",
        action="append",
        help="address to bind (repeatable); "
        "default tcp://127.0.0.1:5555; tcp://127.0.0.1:0 picks a free port",
    )
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--node-index", type=int, default=0)
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--max-message-bytes", type=int, default=wire.DEFAULT_MAX_MESSAGE_BYTES)
    ap.add_argument("--persist-dir", help="persistence root: keep and recover every table here")
    ap.add_argument("--max-parked-bytes", type=int, default=ServerConfig.max_parked_bytes)
    ap.add_argument("--max-parked-per-peer", type=int, default=ServerConfig.max_parked_per_peer)
    ap.add_argument("--ready-file", help="write the bound addresses here (JSON) once serving")
    ap.add_argument("--log-level", default="INFO", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        config = ServerConfig(
            bind=tuple(args.bind or ("tcp://127.0.0.1:5555",)),
            num_shards=args.shards,
            node_index=args.node_index,
            metrics_port=args.metrics_port,
            max_message_bytes=args.max_message_bytes,
            persist_dir=args.persist_dir,
            max_parked_bytes=args.max_parked_bytes,
            max_parked_per_peer=args.max_parked_per_peer,
        )
        serve(config, ready_file=args.ready_file)
    except (StartError, StoreError, ValueError, OSError) as exc:
        print(f"{prog}: error: {start_error_line(exc)}", file=sys.stderr)
        return 2
    return 0


def start_error_line(exc: BaseException) -> str:
    """One line for a node that could not start (a bad option, a busy port, a root it cannot
    recover)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, StoreError):
        return f"--persist-dir: {text}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
