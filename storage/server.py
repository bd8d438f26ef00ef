"""A store node behind a ZeroMQ ROUTER socket: one loop thread that owns one ``StoreNode``.

Owns the node's configuration, sockets, loop timers, clean shutdown and ``python -m storage``;
verbs are ``storage.server_verbs``'s, parked requests ``storage.parking``'s (see the doc)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import zmq

from storage import rpc, wire
from storage.errors import ShuttingDown, StoreError
from storage.metrics import StoreMetrics
from storage.parking import ParkedBook, ParkedRequest, ParkedRequests
from storage.server_verbs import StoreVerbs

log = logging.getLogger("storage.server")

SYNC_TICK_S = 0.02  # how often node.sync() runs while an fsync="interval" table has been written
DEFAULT_PORT = 5555  # a node started by hand (`streamflow store serve`, this module's main)


class StartError(RuntimeError):
    """The node could not start: one line naming the address and the option (``--bind`` /
    ``--metrics-port``) that failed, e.g. a port already in use."""


@dataclass
class ServerConfig:
    """How a store node listens. Defaults are safe: loopback only, no metrics port."""

    bind: Sequence[str] = (f"tcp://127.0.0.1:{DEFAULT_PORT}",)  # port 0 picks a free port
    num_shards: int = 1
    node_index: int = 0
    metrics_port: int | None = None  # None = off; 0 = pick a free port
    metrics_addr: str = "127.0.0.1"
    metrics_interval_s: float = 1.0
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    # Persistence root: every table kept in <persist_dir>/<table>, recovered at start (None: off).
    persist_dir: str | None = None
    # Bounds on requests parked server-side (docs/store-protocol.md).
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


class Server(StoreVerbs, ParkedRequests, rpc.RouterService):
    """One store node. ``run()`` in the foreground, or ``start()``/``stop()`` for a thread."""

    thread_name = "store-server"

    def __init__(
        self, config: ServerConfig, *, context: zmq.Context | None = None, node: Any = None
    ) -> None:
        super().__init__()
        self.config = config
        self.context = context or zmq.Context.instance()
        self.metrics = StoreMetrics(config.node_index)
        if node is None:
            from storage.node import StoreNode  # lazy: the wire layer is usable without it

            node = StoreNode(config.node_index, config.num_shards, events=self.metrics,
                             persist_root=config.persist_dir)
            self.metrics.set_recovered(node.recovered)
        self.node = node
        self.addresses: list[str] = []
        self.metrics_port: int | None = None
        self._auth: Any = None
        self._claims: dict[str, list[ParkedRequest]] = {}
        # Encoded empty-lease bodies by (table, columns); cleared when a table is created/dropped.
        self._empty_bodies: dict[tuple[str, tuple[str, ...]], pa.Buffer] = {}
        self._puts: dict[str, deque[ParkedRequest]] = {}
        self._book = ParkedBook(config.node_index, config.max_parked_bytes,
                                config.max_parked_per_peer, config.max_parked_claims)
        self._last_probe = 0.0
        self._dirty: set[str] = set()
        self._needs_sync = False  # a queued reply acks a mutation of an fsync="always" table
        self._last_metrics = 0.0
        self._last_interval_sync = 0.0
        self._interval_dirty = False

    # -- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        cfg = self.config

        def setup(sock: zmq.Socket) -> None:
            # ZMTP heartbeats: a vanished peer loses its route within ~10 s (then probes drop it).
            for opt, value in ((zmq.SNDHWM, 100_000), (zmq.RCVHWM, 100_000),
                               (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10_000)):
                sock.setsockopt(opt, value)
            if cfg.curve_secret_key is not None:
                self._start_curve(sock)

        try:
            self._sock, self.addresses = rpc.bind_router(
                self.context, cfg.bind, max_message_bytes=cfg.max_message_bytes, setup=setup
            )
        except rpc.BindError as exc:
            raise StartError(f"--bind {exc}") from None
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http(cfg.metrics_addr, cfg.metrics_port)
            except OSError as exc:
                where = f"{cfg.metrics_addr}:{cfg.metrics_port}: cannot bind"
                raise StartError(f"--metrics-port {where}: {exc.strerror or exc}") from None
        log.info("store node %d serving %s", cfg.node_index, self.addresses)

    def _start_curve(self, sock: zmq.Socket) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        cfg = self.config
        allowed = {bytes(k) for k in cfg.curve_allowed_clients}

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return bytes(key) in allowed

        self._auth = ThreadAuthenticator(self.context)
        self._auth.start()
        self._auth.configure_curve_callback(domain="streamflow", credentials_provider=_Keys())
        for opt, value in ((zmq.CURVE_SERVER, 1), (zmq.CURVE_SECRETKEY, cfg.curve_secret_key),
                           (zmq.CURVE_PUBLICKEY, cfg.curve_public_key),
                           (zmq.ZAP_DOMAIN, b"streamflow")):
            sock.setsockopt(opt, value)

    def _close(self) -> None:
        super()._close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.metrics.stop_http()

    def _shutdown(self) -> None:
        self._answer_parked(ShuttingDown("store node is shutting down"))
        super()._shutdown()
        try:
            self.node.close()
        except Exception:
            log.exception("closing the store node")
        log.info("store node %d stopped", self.config.node_index)

    # -- the loop --------------------------------------------------------------------------------
    def _steps(self) -> Sequence[Callable[[], None]]:
        return (self._expire, self._retry_parked, self._time_out_parked, self._flush, self._timers)

    def _poll_timeout_ms(self) -> int:
        wait = SYNC_TICK_S if self._interval_dirty else rpc.MAX_POLL_S
        deadline = self.node.next_deadline()
        if deadline is not None:
            wait = min(wait, deadline - time.time())
        now = time.monotonic()
        return self._timeout_ms(self._parked_deadline(now + wait) - now)

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
        interval = self.config.metrics_interval_s
        if self.config.metrics_port is not None and now - self._last_metrics >= interval:
            self._last_metrics = now
            try:
                self.metrics.refresh(self.node)
                self.metrics.set_parked(self.parked())
            except Exception:
                log.exception("refreshing metrics")

    # -- requests and replies --------------------------------------------------------------------
    def _decode(self, frames: list) -> wire.Request:
        return wire.decode_request(frames)

    def _received(self, frames: list) -> None:
        self.metrics.bytes_received.inc(sum(len(f) for f in frames[1:]))

    def _bad_request(self) -> None:
        self.metrics.bad_requests.inc()

    def _queue(
        self, ident: bytes, req: wire.Request, result: dict[str, Any], t_recv: float,
        bodies: Sequence[Any] = (), *, mutated: str | None = None,
        undo: Callable[[], None] | None = None,
    ) -> None:
        self._reply(ident, req, result, t_recv, bodies, undo)
        if mutated is not None:
            self._dirty.add(mutated)
            if req.verb in wire.MUTATING_VERBS:
                self._note_mutation(mutated)

    def _note_mutation(self, table: str) -> None:
        try:
            policy = self.node.table_spec(table).fsync
        except StoreError:
            return
        if policy == "always":
            self._needs_sync = True
        elif policy == "interval":
            self._interval_dirty = True

    def _flush(self) -> None:
        if self._needs_sync:
            self._needs_sync = False
            self.node.sync()  # durable before acknowledged (fsync="always"): one fsync per batch
        super()._flush()

    def _sent(self, frames: list, verb: str, t_recv: float, now: float) -> None:
        self.metrics.bytes_sent.inc(sum(len(f) for f in frames))
        if verb in wire.VERBS:
            self.metrics.observe_request(verb, now - t_recv)


# -- entry points ---------------------------------------------------------------------------------


def serve(config: ServerConfig, *, ready_file: str | None = None) -> None:
    """Run a store node until SIGTERM/SIGINT; ``ready_file``: {"addresses", "metrics_port",
    "pid"} as JSON there once bound."""
    context = zmq.Context()
    try:
        server = Server(config, context=context)
        rpc.run_until_signalled(
            server, ready_file,
            lambda: {"addresses": server.addresses, "metrics_port": server.metrics_port},
        )
    finally:
        context.term()


def inproc_address() -> str:
    return f"inproc://streamflow-store-{uuid.uuid4().hex}"


def main(argv: Sequence[str] | None = None) -> int:
    """python -m storage.server --bind tcp://127.0.0.1:5555 --shards 2 --metrics-port 0
    [--persist-dir DIR]. Bad options or a failed start: one line on stderr, exit 2."""
    prog = "python -m storage"
    ap = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    ap.add_argument("--bind", action="append", help="address to bind (repeatable); "
                    f"default {ServerConfig.bind[0]}; tcp://127.0.0.1:0 picks a free port")
    ap.add_argument("--shards", type=int, default=ServerConfig.num_shards)
    ap.add_argument("--node-index", type=int, default=ServerConfig.node_index)
    ap.add_argument("--metrics-port", type=int, default=ServerConfig.metrics_port)
    ap.add_argument("--max-message-bytes", type=int, default=ServerConfig.max_message_bytes)
    ap.add_argument("--persist-dir", help="persistence root: keep and recover every table here")
    ap.add_argument("--max-parked-bytes", type=int, default=ServerConfig.max_parked_bytes)
    ap.add_argument("--max-parked-per-peer", type=int, default=ServerConfig.max_parked_per_peer)
    ap.add_argument("--ready-file", help="write the bound addresses here (JSON) once serving")
    ap.add_argument("--log-level", default="INFO", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = ap.parse_args(argv)
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=args.log_level, format=fmt)
    try:
        config = ServerConfig(
            bind=tuple(args.bind or ServerConfig.bind), num_shards=args.shards,
            node_index=args.node_index, metrics_port=args.metrics_port,
            max_message_bytes=args.max_message_bytes, persist_dir=args.persist_dir,
            max_parked_bytes=args.max_parked_bytes, max_parked_per_peer=args.max_parked_per_peer,
        )
        serve(config, ready_file=args.ready_file)
    except (StartError, StoreError, ValueError, OSError) as exc:
        print(f"{prog}: error: {start_error_line(exc)}", file=sys.stderr)
        return 2
    return 0


def start_error_line(exc: BaseException) -> str:
    """One line for a node that could not start (bad option, busy port, unrecoverable root)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, StoreError):
        return f"--persist-dir: {text}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
