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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from storage.coordinator import Coordinator, CoordinatorClient, LookupTimeout
from storage.errors import StoreError
from storage.ports import free_port
from streamflow.config import RunConfig
from streamflow.metrics import with_metrics
from streamflow.supervisor import Supervisor
from workers.config import to_json

log = logging.getLogger("streamflow.launch")

STORE, EVENTS, WORKER, WEIGHTS = "store/", "run/events", "worker/", "run/weights"
TRAINER_MASTER, STOP, END, EXIT = "run/trainer-master", "run/stop", "run/end", "exit/"
BEAT_S = 0.5


def node_key(rank: int, what: str) -> str:
    return f"node/{rank}/{what}"


class LaunchError(RuntimeError):
    """This node cannot take part in the run (the message names why)."""


# -------------------------------------------------------------------------------- placement


def worker_nodes(cfg: RunConfig) -> dict[str, int]:
    """Worker name -> node rank, in ``placement.nodes`` order (rollout-0 on the first node that
    places a rollout worker, ...). ``trainer-0`` is on the first node with trainer ranks."""
    out: dict[str, int] = {}
    counters = dict.fromkeys(("rollout", "reward", "reference"), 0)
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


def interface_of(host: str) -> str | None:
    """The name of the network interface holding address ``host`` on this machine, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address == host for a in addrs):
            return name
    return None


def check_launch(cfg: RunConfig, rank: int, nodes: int) -> None:
    n = len(cfg.placement.nodes)
    if n == 0:
        raise LaunchError(
            "the config has no placement.nodes: use `streamflow run` on one host, "
            "or list the hosts under placement.nodes"
        )
    if nodes != n:
        raise LaunchError(f"--nodes {nodes} but placement.nodes lists {n} nodes")
    if not 0 <= rank < n:
        raise LaunchError(f"--node-rank {rank} is not in [0, {n})")


# -------------------------------------------------------------------------------- one node


class NodeRuntime:
    """What one node starts: its store nodes and workers, finished for this host."""

    def __init__(
        self,
        cfg: RunConfig,
        rank: int,
        coord: CoordinatorClient,
        sup: Supervisor,
        config_dir: Path,
        weights_dir: Path,
    ) -> None:
        self.cfg, self.rank, self.coord, self.sup = cfg, rank, coord, sup
        self.node = cfg.placement.nodes[rank]
        self.host = self.node.host
        self.config_dir, self.weights_dir = config_dir, weights_dir
        config_dir.mkdir(parents=True, exist_ok=True)
        self.endpoints: list[tuple[str, str, str]] = []  # store metrics (host:port, role, name)

    def start_stores(self, deadline: float) -> dict[int, str]:
        """Start this node's store nodes on its host; register and return their addresses."""
        s = self.cfg.store
        tmp = Path(tempfile.mkdtemp(prefix="sf-launch-"))
        ready: dict[int, Path] = {}
        try:
            for k, index in enumerate(store_slots(self.cfg, self.rank)):
                ready[index] = tmp / f"store-{index}.json"
                port = s.port + k if s.port else 0
                self.sup.start_python(
                    f"store-{index}",
                    "store",
                    "storage.server",
                    [
                        "--bind",
                        f"tcp://{self.host}:{port}",
                        "--shards",
                        str(s.num_shards),
                        "--node-index",
                        str(index),
                        "--ready-file",
                        str(ready[index]),
                        *(["--metrics-port", "0"] if self.cfg.metrics.enabled else []),
                        # store.persist: this host's persistence root (the node's own config)
                        *(["--persist-dir", str(Path(self.cfg.run.output_dir) / "store")]
                          if s.persist else []),
                    ],
                )
            addresses = {}
            for index, path in ready.items():
                while not path.exists():
                    child = self.sup.children[f"store-{index}"]
                    if child.exit_code() is not None or time.monotonic() > deadline:
                        raise LaunchError(f"store node {index} did not start:\n{child.log_tail()}")
                    time.sleep(0.05)
                info = json.loads(path.read_text())
                child = self.sup.children[f"store-{index}"]
                child.mark_ready()  # the controller admits prompts only while stores are ready
                child.before_restart = _not_restarted
                addresses[index] = info["addresses"][0]
                if info.get("metrics_port"):
                    self.endpoints.append(
                        (f"127.0.0.1:{info['metrics_port']}", "store", f"store-{index}")
                    )
                self.coord.register(f"{STORE}{index}", addresses[index])
            return addresses
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def start_worker(self, name: str, role: str, wcfg: Any, threads: int) -> None:
        """Finish ``wcfg`` for this host, write it, and start the process (torch's launcher for
        DeepSpeed ranks)."""
        wcfg = self.finish(role, wcfg)
        path = self.config_dir / f"{name}.json"
        path.write_text(to_json(wcfg))
        args = ["--role", role, "--config", str(path)]
        if role == "trainer" and wcfg.engine == "deepspeed":
            hosts = trainer_nodes(self.cfg)
            j = hosts.index(self.rank)
            if j == 0:
                master = f"{self.host}:{free_port(self.host)}"
                self.coord.register(TRAINER_MASTER, master)
            else:
                master = self.coord.lookup(TRAINER_MASTER, self.cfg.run.startup_timeout_s)
            addr, port = master.rsplit(":", 1)
            self.sup.start(
                name if j == 0 else f"{name}.{j}",
                role,
                [
                    *self.gloo_env(len(hosts)),
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(len(hosts)),
                    "--node-rank",
                    str(j),
                    "--nproc-per-node",
                    str(self.node.trainer),
                    "--master-addr",
                    addr,
                    "--master-port",
                    port,
                    "-m",
                    "workers.main",
                    *args,
                ],
                threads=threads,
            )
        else:
            self.sup.start_python(name, role, "workers.main", args, threads=threads)
        if role == "trainer":  # rollout/reward/reference rejoin as they are; a trainer does not
            for child in self.sup.children.values():
                if child.role == "trainer":
                    child.before_restart = _not_restarted

    def gloo_env(self, trainer_hosts: int) -> list[str]:
        """``env GLOO_SOCKET_IFNAME=<interface of host>`` to prefix torchrun with when the ranks
        span hosts (gloo would otherwise bind what the hostname resolves to, e.g. 127.0.1.1, and
        tell the other ranks to connect there). A value already in the environment wins."""
        if trainer_hosts == 1 or self.sup.env.get("GLOO_SOCKET_IFNAME"):
            return []
        iface = interface_of(self.host)
        if iface is None:
            raise LaunchError(
                f"placement host {self.host} of node {self.rank} is no address of this host's "
                "interfaces: trainer ranks need it (or GLOO_SOCKET_IFNAME) to reach the others"
            )
        return ["env", f"GLOO_SOCKET_IFNAME={iface}"]

    def finish(self, role: str, wcfg: Any) -> Any:
        common = wcfg.common
        if common.metrics_host in ("127.0.0.1", "localhost"):  # reachable from node 0's scraper
            common = replace(common, metrics_host=self.host)
        wcfg = replace(wcfg, common=common)
        if role == "trainer":
            first = trainer_nodes(self.cfg)[0] == self.rank
            announce = f"tcp://{self.host}:{free_port(self.host)}"
            serve = f"tcp://{self.host}:{free_port(self.host)}"
            wcfg = replace(
                wcfg, weights_dir=str(self.weights_dir), weights_bind=announce, weights_serve=serve
            )
            if first:  # rank 0 publishes; the other trainer hosts' ranks never do
                self.coord.register(WEIGHTS, json.dumps({"announce": announce, "serve": serve}))
        elif role == "rollout":
            where = json.loads(self.coord.lookup(WEIGHTS, self.cfg.run.startup_timeout_s))
            wcfg = replace(
                wcfg,
                weights_dir=str(self.weights_dir),
                weights_announce=where["announce"],
                weights_fetch=where["serve"],
            )
        return wcfg


def _not_restarted(child: Any) -> None:
    """Node 0's supervisor may restart children; placed stores and trainers are not (a store's
    address is registered in the directory; a trainer must resume from its checkpoint)."""
    raise RuntimeError(
        f"{child.name} is not restarted in a multi-host run; continue the run with run.resume=auto"
    )


def local_weights_dir(rank: int) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"streamflow-weights-node{rank}-", dir=base))


# -------------------------------------------------------------------------------- node 0


class Cluster:
    """Node 0's side, used by the controller (``Controller(cfg, cluster=...)``)."""

    def __init__(self, cfg: RunConfig, nodes: int, coordinator: str) -> None:
        self.cfg, self.nodes = cfg, nodes
        self.host = cfg.placement.nodes[0].host
        self.coord = CoordinatorClient(coordinator, request_timeout=10.0)
        self.where = worker_nodes(cfg)
        self.runtime: NodeRuntime | None = None
        self._entries: dict[str, str] = {}
        self._checked = 0.0
        self._beats: dict[int, tuple[str | None, float]] = {}

    @property
    def events_bind(self) -> str:
        return f"tcp://{self.host}:*"

    def is_local(self, name: str) -> bool:
        return self.where.get(name, 0) == 0

    def start_stores(
        self, sup: Supervisor, run_dir: Path, weights_dir: Path, endpoints: list
    ) -> list[str]:  # noqa: ANN001
        """Node 0's store nodes, then every node's (registered by their launchers), by index."""
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        self.runtime = NodeRuntime(self.cfg, 0, self.coord, sup, run_dir / "workers", weights_dir)
        self.runtime.start_stores(deadline)
        endpoints.extend(self.runtime.endpoints)
        total = sum(n.store_nodes for n in self.cfg.placement.nodes)
        addresses = []
        for index in range(total):
            while True:
                try:
                    addresses.append(self.coord.lookup(f"{STORE}{index}", 0.5))
                    break
                except LookupTimeout:
                    cause = self.check(force=True)
                    if cause:
                        raise LaunchError(cause) from None
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"store node {index} was not registered within "
                            f"run.startup_timeout_s={self.cfg.run.startup_timeout_s:.0f}s "
                            "(is every node's `streamflow launch` running?)"
                        ) from None
        return addresses

    def start_workers(self, workers: list, events_address: str) -> None:  # noqa: ANN001
        """Hand the remote workers their configs, then start node 0's own (trainer first: it
        registers the weights endpoints a rollout worker looks up)."""
        assert self.runtime is not None
        self.coord.register(EVENTS, events_address)
        spread = len(trainer_nodes(self.cfg)) > 1
        local = []
        for name, role, wcfg, threads in workers:
            wcfg = with_metrics(wcfg, self.cfg.metrics)
            if not self.is_local(name) or (role == "trainer" and spread):
                self.coord.register(
                    f"{WORKER}{name}",
                    json.dumps({"role": role, "threads": threads, "config": to_json(wcfg)}),
                )
            if self.is_local(name):
                local.append((name, role, wcfg, threads))
        for name, role, wcfg, threads in sorted(local, key=lambda w: w[1] != "trainer"):
            self.runtime.start_worker(name, role, wcfg, threads)

    def check(self, *, force: bool = False) -> str | None:
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
                return (
                    f"node {rank} ({host}) silent for {now - since:.0f}s "
                    f"(placement.node_timeout_s={limit:g}): its launcher or network is gone"
                )
        return None

    def exit_code(self, name: str) -> int | None:
        """Exit status of a remote worker that ended (as of the last ``check``)."""
        value = self._entries.get(f"{EXIT}{name}")
        return int(value) if value is not None else None

    def fetch_weights(self, version: int, directory: Path) -> None:
        """Copy a published version from the trainer's node (for the controller's evaluation)."""
        from workers.weights_net import WeightFetcher, WeightFetchError

        try:
            serve = json.loads(self.coord.lookup(WEIGHTS, 0.0))["serve"]
            fetcher = WeightFetcher(serve, timeout_s=30.0)
            try:
                fetcher.fetch(version, directory)
            finally:
                fetcher.close()
        except (StoreError, WeightFetchError) as exc:  # evaluation is skipped, never fatal
            log.warning("could not fetch policy version %d for evaluation: %s", version, exc)

    def _wait_all(self, what: str, timeout_s: float) -> list[int]:
        """Wait (bounded) until every remote node registered ``node/<r>/<what>`` (or failed or
        exited); returns the ranks that did not."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                entries = self.coord.lookup_prefix("node/")
            except StoreError:
                entries = {}
            missing = [
                r
                for r in range(1, self.nodes)
                if not any(node_key(r, k) in entries for k in (what, "failed", "exited"))
            ]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)

    def stop_remote_workers(self, timeout_s: float = 30.0) -> None:
        try:
            self.coord.register(STOP, "1")
        except StoreError as exc:
            log.warning("could not ask the other nodes to stop: %s", exc)
            return
        missing = self._wait_all("stopped", timeout_s)
        if missing:
            log.warning("nodes %s did not report their workers stopped", missing)

    def end(self, cause: str | None, timeout_s: float = 20.0) -> None:
        try:
            self.coord.register(END, "ok" if cause is None else f"failed: {cause}"[:4000])
        except StoreError as exc:
            log.warning("could not tell the other nodes the run ended: %s", exc)
            return
        missing = self._wait_all("exited", timeout_s)
        if missing:
            log.warning("nodes %s did not confirm their exit", missing)

    def close(self) -> None:
        self.coord.close()


def launch_node0(cfg: RunConfig, nodes: int, coordinator: str) -> Any:
    """Node 0: the coordinator (a thread of this process), then the controller with a Cluster."""
    coord = Coordinator(bind=f"tcp://{coordinator}").start()  # first: the others wait on it
    cluster = Cluster(cfg, nodes, coord.address)
    try:
        from streamflow import controller  # heavy (torch): after the coordinator is up

        return controller.run(cfg, cluster=cluster)
    finally:
        cluster.close()
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
