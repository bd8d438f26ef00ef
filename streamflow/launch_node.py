"""A launcher N > 0 of a multi-host run (``streamflow launch ... --node-rank N``, N > 0).

Owns: this host's children (its store nodes and workers, started through
``streamflow.node.NodeRuntime``), its heartbeat in the coordinator directory, and its side of the
two-phase end. The protocol and the directory's keys are described in ``streamflow/launch.py``.

Invariants: it exits 0 only after node 0 registered ``run/end = ok``; on a child's failure it
registers ``node/<r>/failed`` with the cause, stops its children and exits 1; it tolerates losing
the coordinator for up to ``placement.node_timeout_s`` (a network cut), then gives up with exit 1.
It never leaves children behind (``Supervisor.stop_all`` on every path; children also die with it).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from storage.coordinator import CoordinatorClient, LookupTimeout
from storage.errors import StoreError
from streamflow.cluster import WorkerFailed
from streamflow.config import RunConfig
from streamflow.node import (
    BEAT_S,
    END,
    EXIT,
    STOP,
    WORKER,
    LaunchError,
    NodeRuntime,
    local_weights_dir,
    node_key,
    store_slots,
    trainer_nodes,
    worker_nodes,
)
from streamflow.supervisor import Supervisor
from workers.config import from_json

log = logging.getLogger("streamflow.launch")


class RemoteNode:
    """A launcher N > 0: its children, its heartbeat, and the run's end as node 0 signals it."""

    def __init__(self, cfg: RunConfig, rank: int, coordinator: str) -> None:
        self.cfg, self.rank = cfg, rank
        self.coord = CoordinatorClient(f"tcp://{coordinator}", request_timeout=5.0)
        out = Path(cfg.run.output_dir)
        self.sup = Supervisor(out / "logs" / f"node-{rank}")
        self.weights_dir = local_weights_dir(rank)
        self.runtime = NodeRuntime(cfg, rank, self.coord, self.sup,
                                   out / "workers" / f"node-{rank}", self.weights_dir)
        self._beat = itertools.count()
        self._last_beat = 0.0
        self._reached = time.monotonic()  # last time the coordinator answered
        self._exits: set[str] = set()

    def _call(self, fn: Any, *args: Any) -> Any:
        """A coordinator call; a lost coordinator is tolerated up to ``node_timeout_s``."""
        try:
            value = fn(*args)
        except LookupTimeout:
            self._reached = time.monotonic()
            raise
        except StoreError as exc:
            silent = time.monotonic() - self._reached
            if silent > self.cfg.placement.node_timeout_s:
                raise LaunchError(f"lost the coordinator for {silent:.0f}s "
                                  f"(placement.node_timeout_s): {exc}") from None
            time.sleep(0.2)
            return None
        self._reached = time.monotonic()
        return value

    def tick(self, watch: bool = True) -> None:
        """Heartbeat, and (``watch``) fail fast when a child of this node failed."""
        if time.monotonic() - self._last_beat >= BEAT_S:
            self._last_beat = time.monotonic()
            self._call(self.coord.register, node_key(self.rank, "beat"), str(next(self._beat)))
        for child in self.sup.children.values() if watch else ():
            code = child.exit_code()
            if code is None:
                continue
            if code != 0:
                raise LaunchError(f"{child.name} exited with status {code}:\n{child.log_tail()}")
            if child.name not in self._exits and child.role != "store":
                self._exits.add(child.name)
                self._call(self.coord.register, f"{EXIT}{child.name}", "0")

    def wait_key(self, key: str, timeout_s: float, *, watch: bool = True) -> str | None:
        """Wait for ``key`` while heartbeating; None on ``run/end`` first or the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick(watch)
            for k, wait in ((key, BEAT_S), (END, 0.0)):
                try:
                    value = self._call(self.coord.lookup, k, wait)
                except LookupTimeout:
                    continue
                if value is not None:
                    if k == END and key != END:
                        return None
                    return value
        return None

    def run(self) -> int:
        cfg, rank = self.cfg, self.rank
        deadline = time.monotonic() + cfg.run.startup_timeout_s
        try:
            while True:  # node 0 may start later than this one
                try:
                    self.coord.register(node_key(rank, "beat"), "start")
                    break
                except StoreError as exc:
                    if time.monotonic() > deadline:
                        raise LaunchError(f"no coordinator at {self.coord.address} within "
                                          f"run.startup_timeout_s: {exc}") from None
                    time.sleep(0.2)
            self._reached = time.monotonic()
            self.tick()
            self.runtime.start_stores(deadline)
            mine = [n for n, r in worker_nodes(cfg).items() if r == rank]
            if rank in trainer_nodes(cfg) and "trainer-0" not in mine:
                mine.append("trainer-0")  # this host runs some of the trainer's ranks
            for name in sorted(mine, key=lambda n: not n.startswith("trainer")):
                spec = self.wait_key(f"{WORKER}{name}", deadline - time.monotonic())
                if spec is None:
                    return self._ended_before_start(name)
                spec = json.loads(spec)
                wcfg = from_json(spec["role"], spec["config"])
                self.runtime.start_worker(name, spec["role"], wcfg, int(spec["threads"]))
            log.info("node %d: %d store node(s) and %s running", rank,
                     len(store_slots(cfg, rank)), mine or "no workers")
            while self.wait_key(STOP, 3600.0) is None:
                if self._end() is not None:
                    break
            return self._finish()
        except (LaunchError, WorkerFailed, StoreError, OSError, ValueError) as exc:
            cause = str(exc)
            print(f"error: node {rank}: {cause}", file=sys.stderr, flush=True)
            try:
                self.coord.register(node_key(rank, "failed"), cause[-4000:])
            except StoreError:
                pass
            return 1  # its children are stopped below
        finally:
            self.sup.stop_all(grace_s=5.0)
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.coord.close()

    def _end(self) -> str | None:
        try:
            return self._call(self.coord.lookup, END, 0.0)
        except LookupTimeout:
            return None

    def _ended_before_start(self, name: str) -> int:
        end = self._end()
        raise LaunchError(f"the run ended before {name} got its config ({end})" if end
                          else f"no config for {name} within run.startup_timeout_s")

    def _finish(self) -> int:
        """Two-phase stop: workers (they release their leases), then the store nodes."""
        end: dict[str, str | None] = {"value": None}

        def between() -> None:  # workers are gone (whatever their status): wait for the verdict
            try:
                self._call(self.coord.register, node_key(self.rank, "stopped"), "1")
                end["value"] = self.wait_key(END, 60.0, watch=False)
            except Exception as exc:  # stop_all would swallow it: keep the cause
                end["value"] = f"ended while waiting for the verdict: {exc}"

        self.sup.stop_all(grace_s=10.0, between=between)
        try:
            self.coord.register(node_key(self.rank, "exited"), "1")
        except StoreError:
            pass
        value = end["value"]
        if value == "ok":
            print(f"node {self.rank}: run finished", file=sys.stderr, flush=True)
            return 0
        print(f"error: node {self.rank}: run {value or 'ended without a verdict'}",
              file=sys.stderr, flush=True)
        return 1
