"""One run over several hosts: ``streamflow launch CONFIG --node-rank N --nodes M --coordinator H:P``.

Every host runs the same command with the same config and its own ``--node-rank``; the config's
``placement.nodes[N]`` says what runs there (store nodes, rollout/reward/reference workers, trainer
ranks) and which address its services bind. Node 0 also runs the coordinator (at ``--coordinator``)
and the controller. Nothing else is configured per host: every address is exchanged through the
coordinator's key-value directory (``storage.coordinator``), the rendezvous of the run:

    key                      written by                 value
    store/<i>                the node hosting store i   its ZeroMQ address (global node index i)
    run/events               controller                 its report (PULL) address
    worker/<name>            controller                 {"role", "threads", "config"}: the worker's
                                                        typed config (workers.config JSON)
    run/weights              the trainer's node         {"announce": PUB, "serve": fetch ROUTER}
    run/trainer-master       the first trainer node     host:port of torch's rendezvous
    node/<r>/beat            launcher r, every 0.5 s    a counter (liveness, no clocks compared)
    node/<r>/failed          launcher r                 the cause (a child failed, a lost peer)
    exit/<name>              launcher                   exit status of a worker that ended (trainer)
    run/stop                 controller                 "stop your workers" (the run is over)
    node/<r>/stopped         launcher r                 its workers exited (leases released)
    run/end                  controller                 "ok" or "failed: <cause>": stop and exit
    node/<r>/exited          launcher r                 its store nodes stopped; it exits now

Lifecycle. The controller (node 0) starts its own store nodes, waits until every ``store/<i>`` is
registered, creates the table, hands each remote worker its config through ``worker/<name>``,
starts its local workers and waits for every worker's "ready" report (reports travel to
``run/events`` from any host). A launcher N > 0 (``streamflow/launch_node.py``) starts its store
nodes, registers them, looks up its workers' configs, finishes them for its host (bind address, its
own weights directory, the trainer's weights endpoints) and starts them; then it heartbeats and
watches its children until ``run/stop``. The end is two-phase so the controller reads the store's
final counts after every worker everywhere has released its leases: ``run/stop`` -> workers stop ->
``node/<r>/stopped`` -> final counts -> ``run/end`` -> store nodes stop -> ``node/<r>/exited``.

Failure is bounded: a child failing on any node is registered under ``node/<r>/failed`` and
fails the run (the controller checks twice a second); a launcher whose beat has not changed for
``placement.node_timeout_s`` fails it too; a launcher that cannot reach the coordinator for that
long, or learns ``run/end = failed``, stops its children and exits 1 with the cause. A network cut
shorter than ``node_timeout_s`` is ridden out: leases of the cut-off workers expire, their rows go
to workers elsewhere, and their late writes are fenced by the store.

Weights: hosts share no ``/dev/shm``. Each node has its own weights directory; the trainer serves
its published versions over ZeroMQ (``workers/weights_net.py``) and a rollout worker on another
node copies each version into its own directory before loading it.

Trainer ranks (``trainer.engine=deepspeed``) spread over several nodes are started by torch's own
launcher on each of them (``python -m torch.distributed.run --nnodes K --node-rank j
--master-addr/--master-port`` of the first trainer node: torch's static rendezvous, whose TCP store
the first trainer node's torchrun hosts); rank 0 talks to the store. The ranks' gloo traffic is
pinned to the interface carrying this node's ``host`` (``GLOO_SOCKET_IFNAME``, unless already set):
left alone, gloo takes the address the machine's hostname resolves to, often a loopback address
the other nodes cannot reach.

Where it lives: node 0's side is ``MultiHostCluster`` below (the controller's ``Cluster``, see
``streamflow/cluster.py``); a node N > 0 is ``streamflow/launch_node.py``; what both start on
their host, the placement and the keys are ``streamflow/node.py``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from storage.coordinator import Coordinator, CoordinatorClient, LookupTimeout
from storage.errors import StoreError
from streamflow.cluster import LocalCluster, WorkerSpec
from streamflow.config import RunConfig
from streamflow.metrics import with_metrics
from streamflow.node import (
    BEAT_S,
    END,
    EVENTS,
    EXIT,
    STOP,
    STORE,
    WEIGHTS,
    WORKER,
    LaunchError,
    NodeRuntime,
    check_launch,
    node_key,
    trainer_nodes,
    worker_nodes,
)
from workers.config import to_json

if TYPE_CHECKING:
    from streamflow.stages import RunPlan

log = logging.getLogger("streamflow.launch")


class MultiHostCluster(LocalCluster):
    """Node 0's side of a multi-host run: node 0's processes (``LocalCluster``, placed by
    ``NodeRuntime``) plus the other nodes', reached through the coordinator's directory."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, *, nodes: int, coordinator: str) -> None:
        super().__init__(cfg, plan)
        self.nodes = nodes
        self.host = cfg.placement.nodes[0].host
        self.events_bind = f"tcp://{self.host}:*"
        self.coord = CoordinatorClient(coordinator, request_timeout=10.0)
        self.where = worker_nodes(cfg)
        self.runtime = NodeRuntime(cfg, 0, self.coord, self.sup, plan.run_dir / "workers",
                                   plan.weights_dir)
        self._entries: dict[str, str] = {}
        self._checked = 0.0
        self._beats: dict[int, tuple[str | None, float]] = {}

    def is_local(self, name: str) -> bool:
        return self.where.get(name, 0) == 0

    def start_store(self) -> list[str]:
        """Node 0's store nodes, then every node's (registered by their launchers), by index."""
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        self.runtime.start_stores(deadline)
        self.endpoints += self.runtime.endpoints
        total = sum(n.store_nodes for n in self.cfg.placement.nodes)
        addresses = []
        for index in range(total):
            while True:
                try:
                    addresses.append(self.coord.lookup(f"{STORE}{index}", 0.5))
                    break
                except LookupTimeout:
                    cause = self._check_nodes(force=True)
                    if cause:
                        raise LaunchError(cause) from None
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"store node {index} was not registered within "
                            f"run.startup_timeout_s={self.cfg.run.startup_timeout_s:.0f}s "
                            "(is every node's `streamflow launch` running?)") from None
        return addresses

    def start_workers(self, workers: list[WorkerSpec], events_address: str) -> None:
        """Hand the remote workers their configs, then start node 0's own (trainer first: it
        registers the weights endpoints a rollout worker looks up)."""
        self.coord.register(EVENTS, events_address)
        spread = len(trainer_nodes(self.cfg)) > 1
        local = []
        for name, role, wcfg, threads in workers:
            wcfg = with_metrics(wcfg, self.cfg.metrics)
            if not self.is_local(name) or (role == "trainer" and spread):
                spec = {"role": role, "threads": threads, "config": to_json(wcfg)}
                self.coord.register(f"{WORKER}{name}", json.dumps(spec))
            if self.is_local(name):
                local.append((name, role, wcfg, threads))
        for name, role, wcfg, threads in sorted(local, key=lambda w: w[1] != "trainer"):
            self.runtime.start_worker(name, role, wcfg, threads)

    def check(self) -> str | None:
        return super().check() or self._check_nodes()

    def _check_nodes(self, *, force: bool = False) -> str | None:
        """A remote node's failure or silence (``placement.node_timeout_s``), or None."""
        now = time.monotonic()
        if not force and now - self._checked < BEAT_S:
            return None
        self._checked = now
        self._entries = self.coord.lookup_prefix("")
        limit = self.cfg.placement.node_timeout_s
        for rank in range(1, self.nodes):
            host = self.cfg.placement.nodes[rank].host
            cause = self._entries.get(node_key(rank, "failed"))
            if cause:
                return f"node {rank} ({host}) failed: {cause}"
            beat = self._entries.get(node_key(rank, "beat"))
            last, since = self._beats.get(rank, (None, now))
            if beat != last or rank not in self._beats:
                self._beats[rank] = (beat, now)
            elif now - since > limit:
                return (f"node {rank} ({host}) silent for {now - since:.0f}s "
                        f"(placement.node_timeout_s={limit:g}): its launcher or network is gone")
        return None

    def trainer_exit_code(self) -> int | None:
        """The trainer's exit status: its process here, or as registered by its node's launcher
        (as of the last check)."""
        if "trainer-0" in self.children:
            return super().trainer_exit_code()
        value = self._entries.get(f"{EXIT}trainer-0")
        return int(value) if value is not None else None

    def fetch_weights(self, version: int) -> None:
        """Copy a published version from the trainer's node (for the controller's evaluation)."""
        from workers.weights_net import WeightFetcher, WeightFetchError

        try:
            serve = json.loads(self.coord.lookup(WEIGHTS, 0.0))["serve"]
            fetcher = WeightFetcher(serve, timeout_s=30.0)
            try:
                fetcher.fetch(version, self.plan.weights_dir)
            finally:
                fetcher.close()
        except (StoreError, WeightFetchError) as exc:  # evaluation is skipped, never fatal
            log.warning("could not fetch policy version %d for evaluation: %s", version, exc)

    def stop(self, between: Callable[[], None] | None, cause: str | None) -> None:
        """The two-phase end: every node's workers stop (releasing their leases) before
        ``between`` reads the final counts; then every node's store nodes stop."""
        try:
            self._tell(STOP, "1", "stopped", 30.0)
            super().stop(between, cause)
            self._tell(END, "ok" if cause is None else f"failed: {cause}"[:4000], "exited", 20.0)
        finally:
            self.coord.close()

    def _tell(self, key: str, value: str, answer: str, timeout_s: float) -> None:
        """Register ``key``, then wait (bounded) until every remote node registered
        ``node/<r>/<answer>`` (or failed or exited)."""
        try:
            self.coord.register(key, value)
        except StoreError as exc:
            log.warning("could not register %s for the other nodes: %s", key, exc)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                entries = self.coord.lookup_prefix("node/")
            except StoreError:
                entries = {}
            missing = [r for r in range(1, self.nodes) if not any(
                node_key(r, k) in entries for k in (answer, "failed", "exited"))]
            if not missing:
                return
            if time.monotonic() > deadline:
                log.warning("nodes %s did not register %s", missing, answer)
                return
            time.sleep(0.1)


def launch_node0(cfg: RunConfig, nodes: int, coordinator: str) -> Any:
    """Node 0: the coordinator (a thread of this process), then the controller over a
    ``MultiHostCluster``."""
    coord = Coordinator(bind=f"tcp://{coordinator}").start()  # first: the others wait on it
    try:
        from streamflow import controller  # heavy (torch): after the coordinator is up

        cluster = partial(MultiHostCluster, nodes=nodes, coordinator=coord.address)
        return controller.run(cfg, cluster=cluster)
    finally:
        coord.stop()


def launch(cfg: RunConfig, *, node_rank: int, nodes: int, coordinator: str) -> int:
    """The CLI's ``streamflow launch``; returns the exit status of this node."""
    check_launch(cfg, node_rank, nodes)
    if node_rank == 0:
        try:
            summary = launch_node0(cfg, nodes, coordinator)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the run failed: one line naming the cause, exit 1
            print(f"error: run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0 if summary.status in ("ok", "interrupted") else 1
    from streamflow.launch_node import RemoteNode

    return RemoteNode(cfg, node_rank, coordinator).run()
