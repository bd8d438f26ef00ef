"""One run over several hosts: ``streamflow launch CONFIG --node-rank N --nodes M --coordinator``.

Every host reads ``placement.nodes`` the same way, so each knows what it runs. Node 0 runs the
coordinator and the controller over a ``MultiHostCluster``; a node N > 0 runs a ``RemoteNode``.
Both start their host's store nodes and workers through ``NodeRuntime``. The protocol (directory
keys, two-phase end, failure rules, weights across hosts, trainer ranks): docs/controller.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.coordinator import Coordinator, CoordinatorClient, LookupTimeout
from storage.errors import StoreError
from storage.ports import free_port
from streamflow.cluster import (
    LocalCluster,
    TorchRun,
    WorkerFailed,
    WorkerSpec,
    refuse_restart,
    start_store_node,
    start_worker,
)
from streamflow.config import RunConfig
from streamflow.metrics import Endpoint, with_metrics
from streamflow.supervisor import RestartPolicy, Supervisor
from workers.config import from_json, to_json

if TYPE_CHECKING:
    from streamflow.plan import RunPlan

log = logging.getLogger("streamflow.launch")

STORE, EVENTS, WORKER, WEIGHTS = "store/", "run/events", "worker/", "run/weights"
TRAINER_MASTER, STOP, END, EXIT = "run/trainer-master", "run/stop", "run/end", "exit/"
BEAT_S = 0.5

NOT_RESTARTED = "{name} is not restarted in a multi-host run; continue the run with run.resume=auto"


def node_key(rank: int, what: str) -> str:
    return f"node/{rank}/{what}"


class LaunchError(RuntimeError):
    """This node cannot take part in the run (the message names why)."""


def worker_nodes(cfg: RunConfig) -> dict[str, int]:
    """Worker name -> node rank, in ``placement.nodes`` order (rollout-0 on the first node that
    places a rollout worker, ...). ``trainer-0`` is on the first node with trainer ranks."""
    out: dict[str, int] = {}
    counters = dict.fromkeys(("rollout", "reward", "reference", "environment"), 0)
    for rank, node in enumerate(cfg.placement.nodes):
        for role in counters:
            for _ in range(getattr(node, role)):
                out[f"{role}-{counters[role]}"] = rank
                counters[role] += 1
    out["trainer-0"] = trainer_nodes(cfg)[0]
    return out


def trainer_nodes(cfg: RunConfig) -> list[int]:
    return [r for r, n in enumerate(cfg.placement.nodes) if n.trainer]


def store_slots(cfg: RunConfig, rank: int) -> list[int]:
    """Global store node indices placed on ``rank`` (indices count up over the nodes)."""
    first = sum(n.store_nodes for n in cfg.placement.nodes[:rank])
    return list(range(first, first + cfg.placement.nodes[rank].store_nodes))


def check_launch(cfg: RunConfig, rank: int, nodes: int) -> None:
    n = len(cfg.placement.nodes)
    if n == 0:
        raise LaunchError("the config has no placement.nodes: use `streamflow run` on one host, "
                          "or list the hosts under placement.nodes")
    if nodes != n:
        raise LaunchError(f"--nodes {nodes} but placement.nodes lists {n} nodes")
    if not 0 <= rank < n:
        raise LaunchError(f"--node-rank {rank} is not in [0, {n})")


def placement_override(cfg: RunConfig, hosts: list[str]) -> str:
    """The ``placement.nodes=[...]`` override that puts node r on ``hosts[r]`` (how the Ray and
    Slurm backends hand every launcher the addresses their engine chose)."""
    nodes = []
    for node, host in zip(cfg.placement.nodes, hosts, strict=True):
        items = [f"host: {host}", *(f"{k}: {getattr(node, k)}" for k in (
            "store_nodes", "rollout", "reward", "reference", "environment", "trainer"))]
        nodes.append("{" + ", ".join(items) + "}")
    return "placement.nodes=[" + ", ".join(nodes) + "]"


class NodeRuntime:
    """What one node starts: its store nodes and workers, finished for this host."""

    def __init__(self, cfg: RunConfig, rank: int, coord: CoordinatorClient, sup: Supervisor,
                 config_dir: Path, weights_dir: Path) -> None:
        self.cfg, self.rank, self.coord, self.sup = cfg, rank, coord, sup
        self.node = cfg.placement.nodes[rank]
        self.host = self.node.host
        self.config_dir, self.weights_dir = config_dir, weights_dir
        self.endpoints: list[Endpoint] = []  # its store nodes' /metrics

    def start_stores(self, deadline: float) -> None:
        """Start this node's store nodes on its host and register their addresses."""
        s = self.cfg.store
        started = {
            index: start_store_node(
                self.sup, f"store-{index}", bind=f"tcp://{self.host}:{s.port + k if s.port else 0}",
                shards=s.num_shards, node_index=index, metrics=self.cfg.metrics.enabled,
                # store.persist: this host's persistence root (the node's own config)
                persist_dir=str(Path(self.cfg.run.output_dir) / "store") if s.persist else None)
            for k, index in enumerate(store_slots(self.cfg, self.rank))
        }
        for index, node in started.items():
            address = node.wait(max(deadline - time.monotonic(), 0.0))[0]
            node.child.before_restart = refuse_restart(NOT_RESTARTED)
            self.endpoints += node.endpoint()
            self.coord.register(f"{STORE}{index}", address)

    def start_worker(self, name: str, role: str, wcfg: Any, threads: int) -> None:
        """Finish ``wcfg`` for this host, write it, start it (torchrun for DeepSpeed ranks)."""
        wcfg = self.finish(role, wcfg)
        path = self.config_dir / f"{name}.json"
        child_name, ranks = name, None
        if role == "trainer" and wcfg.engine == "deepspeed":
            hosts = trainer_nodes(self.cfg)
            j = hosts.index(self.rank)
            if j == 0:
                master = f"{self.host}:{free_port(self.host)}"
                self.coord.register(TRAINER_MASTER, master)
            else:
                master = self.coord.lookup(TRAINER_MASTER, self.cfg.run.startup_timeout_s)
            ranks = TorchRun(self.node.trainer, master, len(hosts), j, self.gloo_env(len(hosts)))
            child_name = name if j == 0 else f"{name}.{j}"
        child = start_worker(self.sup, child_name, role, wcfg, path, threads, ranks)
        if role == "trainer":
            child.before_restart = refuse_restart(NOT_RESTARTED)

    def gloo_env(self, trainer_hosts: int) -> tuple[str, ...]:
        """``GLOO_SOCKET_IFNAME=<interface of host>`` for torchrun when the ranks span hosts
        (docs/controller.md); a value already in the environment wins."""
        if trainer_hosts == 1 or self.sup.env.get("GLOO_SOCKET_IFNAME"):
            return ()
        import psutil

        iface = next((name for name, addrs in psutil.net_if_addrs().items() if any(
            a.family in (socket.AF_INET, socket.AF_INET6) and a.address == self.host
            for a in addrs)), None)
        if iface is None:
            raise LaunchError(
                f"placement host {self.host} of node {self.rank} is no address of this host's "
                "interfaces: trainer ranks need it (or GLOO_SOCKET_IFNAME) to reach the others")
        return (f"GLOO_SOCKET_IFNAME={iface}",)

    def finish(self, role: str, wcfg: Any) -> Any:
        common = wcfg.common
        if common.metrics_host in ("127.0.0.1", "localhost"):  # reachable from node 0's scraper
            common = replace(common, metrics_host=self.host)
        wcfg = replace(wcfg, common=common)
        if role == "trainer":
            announce = f"tcp://{self.host}:{free_port(self.host)}"
            serve = f"tcp://{self.host}:{free_port(self.host)}"
            wcfg = replace(wcfg, weights_dir=str(self.weights_dir), weights_bind=announce,
                           weights_serve=serve)
            if trainer_nodes(self.cfg)[0] == self.rank:  # rank 0 publishes, no other rank does
                self.coord.register(WEIGHTS, json.dumps({"announce": announce, "serve": serve}))
        elif role == "rollout":
            where = json.loads(self.coord.lookup(WEIGHTS, self.cfg.run.startup_timeout_s))
            wcfg = replace(wcfg, weights_dir=str(self.weights_dir),
                           weights_announce=where["announce"], weights_fetch=where["serve"])
        return wcfg


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
        mine = []
        for name, role, wcfg, threads in workers:
            wcfg = with_metrics(wcfg, self.cfg.metrics)
            here = self.where.get(name, 0) == 0
            if not here or (role == "trainer" and spread):
                spec = {"role": role, "threads": threads, "config": to_json(wcfg)}
                self.coord.register(f"{WORKER}{name}", json.dumps(spec))
            if here:
                mine.append((name, role, wcfg, threads))
        for name, role, wcfg, threads in sorted(mine, key=lambda w: w[1] != "trainer"):
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
        from workers.weights.net import WeightFetcher, WeightFetchError

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


def launch(cfg: RunConfig, *, node_rank: int, nodes: int, coordinator: str) -> int:
    """The CLI's ``streamflow launch``; returns the exit status of this node. Node 0 runs the
    coordinator (a thread of this process), then the controller over a ``MultiHostCluster``."""
    check_launch(cfg, node_rank, nodes)
    if node_rank == 0:
        try:
            coord = Coordinator(bind=f"tcp://{coordinator}").start()  # first: the others wait
            try:
                from streamflow import controller  # heavy (torch): after the coordinator is up

                cluster = partial(MultiHostCluster, nodes=nodes, coordinator=coord.address)
                summary = controller.run(cfg, cluster=cluster)
            finally:
                coord.stop()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the run failed: one line naming the cause, exit 1
            print(f"error: run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        if summary.status == "interrupted":  # as `streamflow run`: 128 + the signal, 130 = Ctrl-C
            name = summary.stopped_by
            print(f"error: run interrupted ({name or 'stopped'}) and stopped cleanly; continue it "
                  "with run.resume=auto", file=sys.stderr, flush=True)
            return 128 + signal.Signals[name].value if name else 130
        return 0 if summary.status == "ok" else 1
    return RemoteNode(cfg, node_rank, coordinator).run()


class RemoteNode:
    """A launcher N > 0: its children, its heartbeat, and the run's end as node 0 signals it."""

    def __init__(self, cfg: RunConfig, rank: int, coordinator: str) -> None:
        self.cfg, self.rank = cfg, rank
        self.coord = CoordinatorClient(f"tcp://{coordinator}", request_timeout=5.0)
        out = Path(cfg.run.output_dir)
        # nothing is restarted here: ``tick`` fails the run on a child's abnormal exit (node 0's
        # supervisor applies run.max_restarts)
        self.sup = Supervisor(out / "logs" / f"node-{rank}", RestartPolicy(max_restarts=0))
        shm = Path("/dev/shm")  # this host's own weights directory (in memory when it can)
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        prefix = f"streamflow-weights-node{rank}-"
        self.weights_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
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
                    return None if k == END and key != END else value
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
                    end = self._end()
                    raise LaunchError(f"the run ended before {name} got its config ({end})" if end
                                      else f"no config for {name} within run.startup_timeout_s")
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
            with contextlib.suppress(StoreError):
                self.coord.register(node_key(rank, "failed"), cause[-4000:])
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
        with contextlib.suppress(StoreError):
            self.coord.register(node_key(self.rank, "exited"), "1")
        value = end["value"]
        if value == "ok":
            print(f"node {self.rank}: run finished", file=sys.stderr, flush=True)
            return 0
        print(f"error: node {self.rank}: run {value or 'ended without a verdict'}",
              file=sys.stderr, flush=True)
        return 1
