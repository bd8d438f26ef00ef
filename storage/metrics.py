"""Prometheus metrics of one store node, of the shard coordinator and of a consumer session.

Each in a private ``CollectorRegistry``; threading and label bounds: docs/store-protocol.md."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from storage.schema import TableStats

DEAD_REASONS = ("lease_expired", "consumer_error", "other")
_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTS = ("table", "task", "shard")
TT = ("table", "task")
T, V = ("table",), ("verb",)


def dead_reason_label(reason: str) -> str:
    """A free-text dead-letter reason -> one of DEAD_REASONS (the text stays in stats)."""
    text = reason.lower()
    if "expired" in text:
        return "lease_expired"
    if text:
        return "consumer_error"
    return "other"


class _StatsSource(Protocol):
    def table_names(self) -> list[str]: ...

    def stats(self, table: str) -> TableStats: ...


class HttpEndpoint:
    """A process's ``/metrics`` HTTP endpoint; the user owns ``registry`` and sets ``_http``."""

    registry: CollectorRegistry
    _http: Any

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 = pick a free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class StoreMetrics(HttpEndpoint):
    """Implements the node's ``NodeEvents`` protocol plus the server-side request metrics."""

    def __init__(self, node_index: int = 0, registry: CollectorRegistry | None = None) -> None:
        self.node_index = node_index
        self.registry = registry if registry is not None else CollectorRegistry()
        m, G, C = _maker(self.registry, "streamflow_store_"), Gauge, Counter
        self.queue_depth = m(G, "queue_depth_rows", "Rows READY for a task (queue depth).", TTS)
        self.in_flight = m(G, "in_flight_rows", "Rows LEASED to a consumer of a task.", TTS)
        self.dead_rows = m(G, "dead_rows", "Rows quarantined (DEAD) for a task, held until clear.",
                           TTS)
        self.memory = m(G, "memory_bytes", "Column bytes held by a table on this node.", T)
        self.rows_held = m(G, "rows", "Live rows held by a table on this node.", T)
        self.rows_put = m(C, "rows_put_total", "Rows created by put.", T)
        self.rows_acked = m(C, "rows_acked_total", "Rows consumed (acked) by a task.", TT)
        self.rows_claimed = m(C, "rows_claimed_total", "Rows handed out in leases.", TT)
        self.rows_redelivered = m(C, "rows_redelivered_total", "Rows made claimable again after "
                                  "an expiry or failed release.", TT)
        self.rows_dead = m(C, "rows_dead_total", "Rows quarantined, by bounded reason.",
                           [*TT, "reason"])
        self.lease_expiries = m(C, "lease_expiries_total", "Leases that passed their deadline.", TT)
        self.bytes_received = m(C, "bytes_received_total", "Request bytes received.")
        self.bytes_sent = m(C, "bytes_sent_total", "Reply bytes sent.")
        self.bytes_written = m(C, "bytes_written_total", "Column bytes added by put and write.", T)
        self.request_duration = m(Histogram, "request_duration_seconds",
                                  "Time from request received to reply sent, per verb "
                                  "(long-polled claims and parked puts include their wait).", V,
                                  buckets=_DURATION_BUCKETS)
        self.bad_requests = m(C, "bad_requests_total", "Requests refused as malformed.")
        self.tables_recovered = m(G, "recovered_tables", "Tables recovered from the persistence "
                                  "root when this node started.")
        self.rows_recovered = m(G, "recovered_rows",
                                "Rows a table held when it was recovered at this node's start.", T)
        self.parked = m(G, "parked_requests", "Requests waiting server-side, by verb.", V)
        self.parked_bytes = m(G, "parked_put_bytes", "Body bytes held by puts waiting for room.")
        self.parked_refused = m(C, "parked_refused_total", "Requests refused instead of parked "
                                "(a parked-request limit was reached).", V)
        self.parked_dropped = m(C, "parked_dropped_total",
                                "Parked requests dropped because their peer was gone.")
        # labels() costs a lock per call: the hot callbacks keep their children (bounded).
        self._children: dict[tuple[Any, ...], Any] = {}
        self._gauge_keys: set[tuple[str, str, str]] = set()
        self._tables: set[str] = set()
        self._http: Any = None

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= 4096:
                self._children.clear()
            child = self._children[key] = metric.labels(*labels)
        return child

    def set_recovered(self, tables: dict[str, int]) -> None:
        """Tables recovered at start -> their rows (set once, when the node is built)."""
        self.tables_recovered.set(len(tables))
        for table, rows in tables.items():
            self.rows_recovered.labels(table).set(rows)

    def set_parked(self, parked: dict[str, int]) -> None:
        self.parked.labels("claim").set(parked["claims"])
        self.parked.labels("put").set(parked["puts"])
        self.parked_bytes.set(parked["put_bytes"])

    # -- NodeEvents ------------------------------------------------------------------------------
    def on_put(self, table: str, shard_id: int, rows: int, nbytes: int) -> None:
        self._child(self.rows_put, table).inc(rows)
        self._child(self.bytes_written, table).inc(nbytes)

    def on_write(self, table: str, shard_id: int, nbytes: int) -> None:
        self._child(self.bytes_written, table).inc(nbytes)

    def on_claim(self, table: str, task: str, shard_id: int, rows: int) -> None:
        self._child(self.rows_claimed, table, task).inc(rows)

    def on_ack(self, table: str, task: str, shard_id: int, rows: int) -> None:
        self._child(self.rows_acked, table, task).inc(rows)

    def on_redeliver(self, table: str, task: str, shard_id: int, rows: int) -> None:
        self.rows_redelivered.labels(table, task).inc(rows)

    def on_dead(self, table: str, task: str, shard_id: int, rows: int, reason: str) -> None:
        self.rows_dead.labels(table, task, dead_reason_label(reason)).inc(rows)

    def on_lease_expired(self, table: str, task: str, shard_id: int, leases: int) -> None:
        self.lease_expiries.labels(table, task).inc(leases)

    # -- server side -----------------------------------------------------------------------------
    def observe_request(self, verb: str, seconds: float) -> None:
        self._child(self.request_duration, verb).observe(seconds)

    def refresh(self, node: _StatsSource) -> None:
        """Set the gauges from node.stats(); label sets of dropped tables/shards are removed."""
        keys: set[tuple[str, str, str]] = set()
        tables = set(node.table_names())
        for table in tables:
            stats = node.stats(table)
            self.memory.labels(table).set(sum(s.bytes for s in stats.shards))
            self.rows_held.labels(table).set(sum(s.rows for s in stats.shards))
            for shard in stats.shards:
                for task, t in shard.tasks.items():
                    key = (table, task, str(shard.shard_id))
                    keys.add(key)
                    self.queue_depth.labels(*key).set(t.ready)
                    self.in_flight.labels(*key).set(t.in_flight)
                    self.dead_rows.labels(*key).set(t.dead)
        for key in self._gauge_keys - keys:
            for g in (self.queue_depth, self.in_flight, self.dead_rows):
                _remove(g, key)
        for table in self._tables - tables:
            _remove(self.memory, (table,))
            _remove(self.rows_held, (table,))
        if self._tables - tables:
            self._children.clear()  # children of dropped tables must not be kept alive
        self._gauge_keys, self._tables = keys, tables


class CoordinatorMetrics(HttpEndpoint):
    """The coordinator's shard-map metrics, in a private registry (labels bounded: groups,
    consumer ids, ``storage.balance.REASONS``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        m = _maker(self.registry, "streamflow_coordinator_")
        self.reassignments = m(Counter, "reassignments_total", "Shard ownership changes "
                               "(revocations and grants to an unowned shard), by reason.",
                               [*TT, "reason"])
        owners = [*TT, "consumer"]
        self.owned_shards = m(Gauge, "owned_shards", "Shards a consumer owns now.", owners)
        self.imbalance = m(Gauge, "depth_imbalance_ratio", "Max over mean of the consumers' "
                           "expected drain time (owned ready rows + in flight, over recent "
                           "throughput); 1 is even.", TT)
        self.consumers = m(Gauge, "consumers_alive", "Consumers with a live session.", TT)
        self._owned_keys: set[tuple[str, str, str]] = set()
        self._http: Any = None

    def set_owned(self, table: str, task: str, owned: dict[str, int]) -> None:
        """Set a group's owned-shards gauges; consumers no longer in ``owned`` are removed."""
        keys = {(table, task, c) for c in owned}
        for c, n in owned.items():
            self.owned_shards.labels(table, task, c).set(n)
        for key in {k for k in self._owned_keys if k[:2] == (table, task)} - keys:
            _remove(self.owned_shards, key)
        self._owned_keys = {k for k in self._owned_keys if k[:2] != (table, task)} | keys


class SessionMetrics:
    """A consumer session's rows claimed from its own shards and stolen from others', in the
    registry it is given (a worker's) or a private one; one instance per registry."""

    SOURCES = ("owned", "stolen")
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, SessionMetrics]
    _by_registry = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rows_claimed = _maker(self.registry, "streamflow_consumer_")(
            Counter, "rows_claimed_total", "Rows a consumer session claimed, by source: owned (its "
            "own shards) or stolen (a shard another consumer owns, taken while its own were "
            "empty).", [*TT, "source"])

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None) -> SessionMetrics:
        """The instance registered in ``registry`` (created once); None: a private registry."""
        if registry is None:
            return cls()
        with cls._lock:
            found = cls._by_registry.get(registry)
            if found is None:
                found = cls._by_registry[registry] = cls(registry)
            return found


def _maker(registry: CollectorRegistry, prefix: str) -> Callable[..., Any]:
    """A metric constructor: (kind, name without ``prefix``, help, labels, **options)."""

    def make(kind: Any, name: str, doc: str, labels: Sequence[str] = (), **kw: Any) -> Any:
        return kind(prefix + name, doc, list(labels), registry=registry, **kw)

    return make


def _remove(metric: Gauge, key: Iterable[str]) -> None:
    try:
        metric.remove(*key)
    except KeyError:
        pass
