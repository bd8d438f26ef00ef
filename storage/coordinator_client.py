"""The client side of the coordinator: ``CoordinatorClient`` and ``StatsPoller``.

Use a ``CoordinatorClient`` from ONE thread; see docs/store-protocol.md ("Coordinator")."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from storage import rpc
from storage.errors import StoreError, Unavailable

log = logging.getLogger("storage.coordinator")

DEFAULT_REQUEST_TIMEOUT_S = 10.0


class LookupTimeout(StoreError):
    """``lookup(key, timeout)``: the key was not registered within the timeout."""


class CoordinatorClient:
    """Talks to one coordinator. Use from one thread; ``close()`` when done."""

    def __init__(
        self, address: str, *, context: zmq.Context | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        if not isinstance(address, str) or not address:
            raise ValueError(f"CoordinatorClient needs an address, got {address!r}")
        self.address = address
        self.context = context or zmq.Context.instance()
        self.request_timeout = request_timeout
        self._req_ids = itertools.count(1)
        options = [(zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000),
                   (zmq.MAXMSGSIZE, 1 << 24)]
        self._channel: rpc.Channel | None = rpc.Channel(
            self.context, address, name=f"coordinator {address}", timeout_error=Unavailable,
            options=options,
        )

    def call(self, verb: str, args: dict[str, Any], *, wait: float = 0.0) -> dict[str, Any]:
        """One request; returns the reply's result fields or raises its typed error."""
        if self._channel is None:
            raise StoreError("CoordinatorClient is closed")
        timeout = wait + self.request_timeout
        return self._channel.request(next(self._req_ids), verb, args, (), timeout).result

    # -- directory -------------------------------------------------------------------------------
    def register(self, key: str, value: str) -> None:
        """Set ``key`` to ``value`` (overwrites); wakes every ``lookup`` waiting for the key."""
        self.call("register", {"key": key, "value": value})

    def lookup(self, key: str, timeout: float = 0.0) -> str:
        """The value of ``key``, waiting server-side up to ``timeout`` s (else LookupTimeout)."""
        reply = self.call("lookup", {"key": key, "timeout": float(timeout)}, wait=timeout)
        return str(reply["value"])

    def lookup_prefix(self, prefix: str) -> dict[str, str]:
        """Every registered key starting with ``prefix`` (no wait)."""
        entries = self.call("lookup_prefix", {"prefix": prefix})["entries"]
        return {str(k): str(v) for k, v in entries.items()}

    # -- shard map (ConsumerSession wraps these) -------------------------------------------------
    def join(self, table: str, task: str, consumer: str) -> dict[str, Any]:
        return self.call("join", {"table": table, "task": task, "consumer": consumer})

    def heartbeat(
        self, table: str, task: str, consumer: str, *, generation: int, rate: float = 0.0,
        in_flight: int = 0,
    ) -> dict[str, Any]:
        member = {"table": table, "task": task, "consumer": consumer}
        load = {"generation": int(generation), "rate": float(rate), "in_flight": int(in_flight)}
        return self.call("heartbeat", {**member, **load})

    def leave(self, table: str, task: str, consumer: str) -> None:
        self.call("leave", {"table": table, "task": task, "consumer": consumer})

    def assignment(self, table: str, task: str) -> dict[str, Any]:
        """The group's state: generation, owners, handoffs in flight, members, imbalance."""
        return self.call("assignment", {"table": table, "task": task})

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StatsPoller:
    """The coordinator's depth feed: a thread reading ``stats`` of the tables set by ``want``
    every ``interval_s``; ``latest()``: the last stats per table (both from any thread)."""

    def __init__(
        self, addresses: Sequence[str], interval_s: float, context: zmq.Context | None = None
    ) -> None:
        self._addresses = list(addresses)
        self._interval = interval_s
        self._context = context
        self._lock = threading.Lock()
        self._tables: set[str] = set()
        self._latest: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-stats", daemon=True)
        self._thread.start()

    def want(self, tables: set[str]) -> None:
        with self._lock:
            self._tables = set(tables)

    def latest(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._latest)

    def _run(self) -> None:
        from storage.client import Client

        client = Client(self._addresses, context=self._context, request_timeout=2.0)
        try:
            while not self._stop.is_set():
                with self._lock:
                    tables = sorted(self._tables)
                for table in tables:
                    try:
                        stats = client.stats(table)
                    except StoreError as exc:  # unknown table (not created yet), node down
                        log.debug("stats(%s) failed: %s", table, exc)
                        continue
                    with self._lock:
                        self._latest[table] = stats
                self._stop.wait(self._interval)
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
