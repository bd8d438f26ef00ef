"""The coordinator: a small key-value directory and the shard map of every (table, task).

One ROUTER loop thread serving the directory and group verbs over ``storage.balance.Balancer``;
in memory only. Details: docs/store-protocol.md ("Coordinator")."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from storage import errors, headers, rpc, wire
from storage.coordinator_client import CoordinatorClient, LookupTimeout, StatsPoller
from storage.coordinator_session import ConsumerSession
from storage.errors import BadRequest

__all__ = ["ConsumerSession", "Coordinator", "CoordinatorClient", "LookupTimeout", "main", "serve"]

log = logging.getLogger("storage.coordinator")

MAX_KEYS = 65536  # directory entries (a bound on memory, not a realistic size)
MAX_GROUPS = 1024  # (table, task) consumer groups


COORD_VERBS = headers.fields_by_verb(headers.COORD_HEADERS)
_DECODER = headers.decoder(headers.COORD_HEADERS)


@dataclass
class _Lookup(rpc.Parked):
    key: str = ""  # the directory key it waits for


class Coordinator(rpc.RouterService):
    """The coordinator service (``start()``/``stop()``). ``store_addresses``: the nodes whose
    stats feed depth to every group's balancer (``balancer``: a BalancerConfig; None: defaults)."""

    def __init__(
        self, bind: str = "tcp://127.0.0.1:0", *, store_addresses: Sequence[str] = (),
        balancer: Any = None, round_interval_s: float | None = None,
        metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
        context: zmq.Context | None = None,
    ) -> None:
        from storage.balance import BalancerConfig

        super().__init__()
        self.bind = bind
        self.store_addresses = list(store_addresses)
        self.balancer_config: BalancerConfig = balancer or BalancerConfig()
        hb = self.balancer_config.heartbeat_interval_s
        self.round_interval_s = hb if round_interval_s is None else round_interval_s
        self.metrics_port_requested = metrics_port
        self.metrics_addr = metrics_addr
        self.metrics_port: int | None = None
        self.context = context or zmq.Context.instance()
        self.address = ""
        self._directory: dict[str, str] = {}
        self._parked: list[_Lookup] = []
        self._groups: dict[tuple[str, str], Any] = {}  # (table, task) -> Balancer
        self._last_round = 0.0
        self.rounds = 0  # balancing rounds run so far (tests wait on it)
        self._poller: Any = None  # _StatsPoller, when store addresses are given
        from storage.metrics import CoordinatorMetrics

        self.metrics = CoordinatorMetrics()

    thread_name = "coordinator"

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Coordinator:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _open(self) -> None:
        # headers only: no Arrow bodies here
        self._sock, bound = rpc.bind_router(self.context, [self.bind], max_message_bytes=1 << 20)
        self.address = bound[0]
        if self.metrics_port_requested is not None:
            port = self.metrics_port_requested
            self.metrics_port = self.metrics.start_http(self.metrics_addr, port)
        if self.store_addresses:
            self._poller = StatsPoller(self.store_addresses, self.round_interval_s, self.context)
        log.info("coordinator serving %s", self.address)

    def _close(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        super()._close()
        self.metrics.stop_http()

    def _shutdown(self) -> None:
        for p in self._parked:
            self._reply_error(p.ident, p.req, errors.ShuttingDown("coordinator stopping"), 0.0)
        self._parked.clear()
        super()._shutdown()
        log.info("coordinator stopped")

    def parked(self) -> int:
        """Lookups waiting server-side now (any thread: a list's length)."""
        return len(self._parked)

    # -- the loop --------------------------------------------------------------------------------
    def _steps(self) -> Sequence[Callable[[], None]]:
        return (self._time_out_parked, self._round, self._flush)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wait = min(rpc.MAX_POLL_S, self._last_round + self.round_interval_s - now)
        return self._timeout_ms(rpc.earliest(self._parked, now + wait) - now)

    def _decode(self, frames: list) -> wire.Request:
        return wire.decode_request(frames, _DECODER, COORD_VERBS, {})  # no bodies here

    # -- directory verbs -------------------------------------------------------------------------
    def _v_hello(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        return {"protocol": wire.PROTOCOL_VERSION, "role": "coordinator"}

    def _v_register(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        key, value = req.args["key"], req.args["value"]
        if key not in self._directory and len(self._directory) >= MAX_KEYS:
            raise BadRequest(f"the directory is full ({MAX_KEYS} keys)")
        self._directory[key] = value
        for p in rpc.take(self._parked, lambda p: p.key == key):  # the lookups waiting for it
            self._reply(p.ident, p.req, {"value": value}, p.t_recv)
        return {}

    def _v_lookup(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any] | None:
        key, timeout = req.args["key"], req.args["timeout"]
        if key in self._directory:
            return {"value": self._directory[key]}
        if timeout <= 0:
            raise LookupTimeout(f"key {key!r} is not registered")
        self._parked.append(_Lookup(ident, req, t, time.monotonic() + timeout, key))
        return None  # answered by register() or at the deadline

    def _v_lookup_prefix(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        prefix = req.args["prefix"]
        return {"entries": {k: v for k, v in self._directory.items() if k.startswith(prefix)}}

    def _time_out_parked(self) -> None:
        now = time.monotonic()
        for p in rpc.take(self._parked, lambda p: p.deadline <= now):
            exc = LookupTimeout(f"key {p.key!r} was not registered within the timeout")
            self._reply_error(p.ident, p.req, exc, p.t_recv)

    # -- shard map verbs (storage.balance does the deciding) -------------------------------------
    def _round(self) -> None:
        """Once per round: feed the latest depth to every group's balancer and tick it."""
        now = time.monotonic()
        if now - self._last_round < self.round_interval_s:
            return
        self._last_round = now
        self.rounds += 1
        if self._poller is not None:
            self._poller.want({table for table, _ in self._groups})
            latest = self._poller.latest()
        else:
            latest = {}
        for (table, task), b in self._groups.items():
            stats = latest.get(table)
            depth = None
            if stats is not None:
                depth = {s.shard_id: s.tasks[task].ready for s in stats.shards if task in s.tasks}
            b.tick(now, depth)
            self._publish(table, task, b)

    def _publish(self, table: str, task: str, b: Any) -> None:
        for change in b.changes:
            self.metrics.reassignments.labels(table, task, change.reason).inc()
            log.info("%s/%s: shard %d %s -> %s (%s)", table, task, change.shard, change.source,
                     change.target, change.reason)
        b.changes.clear()
        self.metrics.set_owned(table, task, b.owned_counts())
        self.metrics.imbalance.labels(table, task).set(b.imbalance)
        self.metrics.consumers.labels(table, task).set(len(b.members))

    def _group(self, table: str, task: str) -> Any:
        from storage.balance import Balancer

        b = self._groups.get((table, task))
        if b is None:
            if len(self._groups) >= MAX_GROUPS:
                raise BadRequest(f"too many consumer groups (limit {MAX_GROUPS})")
            b = self._groups[(table, task)] = Balancer(self.balancer_config)
            latest = self._poller.latest() if self._poller is not None else {}
            if table in latest:  # a group created after the first round starts with its shards
                b.set_shards(s.shard_id for s in latest[table].shards if task in s.tasks)
        return b

    def _view(self, b: Any, consumer: str, generation: int, shards: list[int]) -> dict[str, Any]:
        """A member's reply: its assignment, the timing it must keep, and where to steal."""
        others = sorted((s for s, d in b.depth.items() if d > 0 and b.owner.get(s) != consumer),
                        key=lambda s: -b.depth[s])
        cfg = self.balancer_config
        return {
            "generation": generation, "shards": shards, "session_timeout_s": cfg.session_timeout_s,
            "heartbeat_interval_s": cfg.heartbeat_interval_s, "deepest": others[:4],
        }

    def _v_join(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        a = req.args
        b = self._group(a["table"], a["task"])
        gen, shards = b.join(a["consumer"], time.monotonic())
        return self._view(b, a["consumer"], gen, shards)

    def _v_heartbeat(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        a = req.args
        b = self._group(a["table"], a["task"])
        gen, shards = b.heartbeat(a["consumer"], time.monotonic(), confirmed=a["generation"],
                                  rate=a["rate"], in_flight=a["in_flight"])
        return self._view(b, a["consumer"], gen, shards)

    def _v_leave(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        a = req.args
        b = self._groups.get((a["table"], a["task"]))
        if b is not None:
            b.leave(a["consumer"], time.monotonic())
        return {}

    def _v_assignment(self, ident: bytes, req: wire.Request, t: float) -> dict[str, Any]:
        a = req.args
        b = self._groups.get((a["table"], a["task"]))
        if b is None:
            return {"generation": 0, "owners": [], "handoffs": [], "members": {},
                    "imbalance": 1.0, "depth": []}
        drain = b.drain_times()
        return {
            "generation": b.generation,
            "owners": [[s, c] for s, c in sorted(b.owner.items())],
            "handoffs": [[s, h.source, h.target] for s, h in sorted(b.handoffs.items())],
            "members": {
                c: {
                    "shards": b.assigned(c), "rate": m.rate, "in_flight": m.in_flight,
                    "confirmed": m.confirmed, "drain_s": drain[c],
                }
                for c, m in b.members.items()
            },
            "imbalance": b.imbalance,
            "depth": [[s, d] for s, d in sorted(b.depth.items())],
        }


# -- entry points ---------------------------------------------------------------------------------


def serve(coordinator: Coordinator, *, ready_file: str | None = None) -> None:
    """Run ``coordinator`` until SIGTERM/SIGINT. With ``ready_file``, write {"address",
    "metrics_port", "pid"} there as JSON (atomically) once bound."""
    c = coordinator
    rpc.run_until_signalled(c, ready_file, lambda: {"address": c.address,
                                                    "metrics_port": c.metrics_port})


def main(argv: Sequence[str] | None = None) -> int:
    """python -m storage.coordinator --bind tcp://127.0.0.1:5600 --store tcp://127.0.0.1:5555"""
    from storage.balance import BalancerConfig

    ap = argparse.ArgumentParser(prog="python -m storage.coordinator", description=main.__doc__)
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="tcp://HOST:PORT (0: a free port)")
    ap.add_argument("--store", action="append", default=[],
                    help="a store node address (repeatable)")
    ap.add_argument("--ready-file", help="write the bound address here (JSON) once serving")
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--metrics-addr", default="127.0.0.1")
    ap.add_argument("--session-timeout", type=float, default=BalancerConfig.session_timeout_s)
    ap.add_argument("--heartbeat-interval", type=float, default=BalancerConfig.heartbeat_interval_s)
    ap.add_argument("--static", action="store_true",
                    help="static round-robin assignment, no rebalancing")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=args.log_level, format=fmt)
    config = BalancerConfig(session_timeout_s=args.session_timeout,
                            heartbeat_interval_s=args.heartbeat_interval, rebalance=not args.static)
    coordinator = Coordinator(args.bind, store_addresses=args.store, balancer=config,
                              metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                              context=zmq.Context())
    serve(coordinator, ready_file=args.ready_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
