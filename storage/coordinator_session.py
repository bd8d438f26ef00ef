"""A consumer's membership in a (table, task) group: heartbeats, its owned shards, balanced claims.

``ConsumerSession``: a heartbeat thread, the adopted assignment, throughput and the claim policy
(docs/store-protocol.md, "Consumer sessions")."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from storage.coordinator_client import CoordinatorClient
from storage.errors import StoreError
from storage.metrics import SessionMetrics
from storage.schema import Lease

log = logging.getLogger("storage.coordinator")

RATE_WINDOW_S = 5.0  # throughput is measured over the work recorded in this window


class ConsumerSession:
    """Membership of ``consumer_id`` in a (table, task) group, started; ``close()`` leaves it.
    ``shards()`` and ``record()`` from any thread; ``claim`` from the consumer's one thread."""

    def __init__(
        self, coordinator_address: str, table: str, task: str, consumer_id: str, *,
        steal: bool = True, context: Any = None, request_timeout: float = 2.0, registry: Any = None,
    ) -> None:
        self.address = coordinator_address
        self.table, self.task, self.consumer_id = table, task, consumer_id
        self.steal = steal
        self._context = context
        self._request_timeout = request_timeout
        self._lock = threading.Lock()
        self._generation = 0
        self._shards: list[int] = []
        self._deepest: list[int] = []
        self._valid_until = 0.0  # monotonic; the assignment is void after it
        self._claim_gen: int | None = None  # generation of the claim in progress
        self._in_flight = 0
        self._work: collections.deque[tuple[float, int, float]] = collections.deque()
        self.heartbeat_interval_s = 0.5  # replaced by the coordinator's value on the first reply
        self.session_timeout_s = 3.0
        self.rows_owned = 0  # rows claimed from owned shards / by stealing (for reports)
        self.rows_stolen = 0
        # The same two numbers as Prometheus counters (in ``registry``, a worker's, or private).
        self.metrics = SessionMetrics.for_registry(registry)
        self._owned_rows = self.metrics.rows_claimed.labels(table, task, "owned")
        self._stolen_rows = self.metrics.rows_claimed.labels(table, task, "stolen")
        self._assigned = threading.Event()
        self._stop = threading.Event()
        name = f"session-{consumer_id}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the consumer's view ---------------------------------------------------------------------
    @property
    def claim_wait_s(self) -> float:
        return self.heartbeat_interval_s

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def shards(self) -> list[int]:
        """The shard ids this consumer owns now (empty when its assignment is void)."""
        with self._lock:
            return list(self._shards) if time.monotonic() < self._valid_until else []

    def wait_assigned(self, timeout: float) -> bool:
        """Wait for the first reply of the coordinator (the assignment may be empty)."""
        return self._assigned.wait(timeout)

    def record(self, rows: int, busy_s: float | None = None) -> None:
        """Report ``rows`` processed in ``busy_s`` seconds of work (None: since the last call);
        the rate heartbeats carry is rows over busy seconds of the last ``RATE_WINDOW_S``."""
        now = time.monotonic()
        with self._lock:
            if busy_s is None:
                busy_s = now - self._work[-1][0] if self._work else 0.0
            self._work.append((now, int(rows), max(float(busy_s), 0.0)))
            self._in_flight = 0

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._work and now - self._work[0][0] > RATE_WINDOW_S:
                self._work.popleft()
            rows = sum(w[1] for w in self._work)
            busy = sum(w[2] for w in self._work)
        return rows / busy if busy > 0 else 0.0

    # -- claims ----------------------------------------------------------------------------------
    def claim(
        self, client: Any, columns: Sequence[str], max_rows: int, *, timeout: float,
        ack: Lease | None = None, write: pa.RecordBatch | pa.Table | None = None, **kwargs: Any,
    ) -> Lease:
        """Claim by the policy in docs/store-protocol.md (``kwargs``: ``min_rows``,
        ``whole_groups``, ``lease_seconds`` as for ``Client.claim``)."""
        with self._lock:
            valid = time.monotonic() < self._valid_until
            own = list(self._shards) if valid else []
            self._claim_gen = self._generation
            deepest = [s for s in self._deepest if s not in own]
        t, task = self.table, self.task

        def probe(shards: list[int] | None, wait: float) -> Lease:
            nonlocal ack, write  # the previous lease rides on the first request only
            lease = client.claim(t, task, columns, max_rows, timeout=wait, ack=ack, write=write,
                                 shards=shards, **kwargs)
            ack = write = None
            return lease

        try:
            lease: Lease | None = None
            if own:
                lease = probe(own, 0.0)
                if lease.num_rows:
                    return self._took(lease, stolen=False)
            wait = min(float(timeout), self.claim_wait_s)
            if self.steal:
                for target in ([deepest[0]], None) if deepest else (None,):
                    # Owning nothing, the last probe waits server-side on every shard (a
                    # non-waiting one made a busy loop of empty claims).
                    lease = probe(target, wait if target is None and not own else 0.0)
                    if lease.num_rows:
                        return self._took(lease, stolen=True)
            if own:
                return self._took(probe(own, wait), stolen=False)
            if ack is not None and ack.lease_id:  # nothing to claim from: hand the result in
                if write is not None:
                    client.write(t, ack, write, ack=True)
                else:
                    client.ack(ack)
            if lease is not None:
                return lease  # the steal probe's empty lease
            self._stop.wait(wait)  # no shards, no stealing: idle for one claim wait
            return Lease(0, t, task, 0, 0.0, pa.record_batch([], names=[]))
        finally:
            with self._lock:
                self._claim_gen = None

    def _took(self, lease: Lease, *, stolen: bool) -> Lease:
        n = lease.num_rows
        if stolen:
            self.rows_stolen += n
            self._stolen_rows.inc(n)
        else:
            self.rows_owned += n
            self._owned_rows.inc(n)
        with self._lock:
            self._in_flight = n
        return lease

    # -- the heartbeat thread --------------------------------------------------------------------
    def _confirmable(self) -> int:
        with self._lock:
            gen = self._generation
            return gen if self._claim_gen is None else min(gen, self._claim_gen)

    def _adopt(self, reply: dict[str, Any], sent_at: float) -> None:
        with self._lock:
            self.heartbeat_interval_s = float(reply["heartbeat_interval_s"])
            self.session_timeout_s = float(reply["session_timeout_s"])
            gen = int(reply["generation"])
            changed = None
            if gen >= self._generation:
                shards = sorted(int(s) for s in reply["shards"])
                changed = shards if shards != self._shards else None
                self._generation = gen
                self._shards = shards
            self._deepest = [int(s) for s in reply.get("deepest", [])]
            self._valid_until = sent_at + self.session_timeout_s - self.claim_wait_s
        if changed is not None:  # one line per change of the owned set (a worker's log)
            log.info("%s: assigned shards %s (generation %d)", self.consumer_id, changed, gen)
        self._assigned.set()

    def _run(self) -> None:
        cl = CoordinatorClient(self.address, context=self._context,
                               request_timeout=self._request_timeout)
        try:
            joined = False
            while not self._stop.is_set():
                sent_at = time.monotonic()
                try:
                    if not joined:
                        reply = cl.join(self.table, self.task, self.consumer_id)
                        joined = True
                    else:
                        with self._lock:
                            in_flight = self._in_flight
                        reply = cl.heartbeat(
                            self.table, self.task, self.consumer_id, generation=self._confirmable(),
                            rate=self.rate(), in_flight=in_flight,
                        )
                    self._adopt(reply, sent_at)
                except StoreError as exc:  # coordinator down or slow: retry; expiry voids shards
                    log.warning("%s: heartbeat failed: %s", self.consumer_id, exc)
                self._stop.wait(max(0.0, sent_at + self.heartbeat_interval_s - time.monotonic()))
            try:
                cl.leave(self.table, self.task, self.consumer_id)
            except StoreError as exc:
                log.info("%s: leave failed (the session will expire): %s", self.consumer_id, exc)
        finally:
            cl.close()

    def close(self) -> None:
        """Stop heartbeating and leave the group (call after the last claim returned)."""
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            self._shards, self._valid_until = [], 0.0
