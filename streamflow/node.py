"""One host of a multi-host run: placement, the directory's keys, and what a node starts there.

Shared by node 0 (``MultiHostCluster``) and the other nodes (``RemoteNode``), both in
``streamflow/launch.py``; the protocol: docs/controller.md "Several hosts".
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from storage.coordinator import CoordinatorClient
from storage.ports import free_port
from streamflow.cluster import TorchRun, refuse_restart, start_store_node, start_worker
from streamflow.config import RunConfig
from streamflow.metrics import Endpoint
from streamflow.supervisor import Supervisor

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
        raise LaunchError("the config has no placement.nodes: use `streamflow run` on one host, "
                          "or list the hosts under placement.nodes")
    if nodes != n:
        raise LaunchError(f"--nodes {nodes} but placement.nodes lists {n} nodes")
    if not 0 <= rank < n:
        raise LaunchError(f"--node-rank {rank} is not in [0, {n})")


def local_weights_dir(rank: int) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"streamflow-weights-node{rank}-", dir=base))


class NodeRuntime:
    """What one node starts: its store nodes and workers, finished for this host."""

    def __init__(self, cfg: RunConfig, rank: int, coord: CoordinatorClient, sup: Supervisor,
                 config_dir: Path, weights_dir: Path) -> None:
        self.cfg, self.rank, self.coord, self.sup = cfg, rank, coord, sup
        self.node = cfg.placement.nodes[rank]
        self.host = self.node.host
        self.config_dir, self.weights_dir = config_dir, weights_dir
        self.endpoints: list[Endpoint] = []  # its store nodes' /metrics

    def start_stores(self, deadline: float) -> dict[int, str]:
        """Start this node's store nodes on its host; register and return their addresses."""
        s = self.cfg.store
        started = {
            index: start_store_node(
                self.sup, f"store-{index}", bind=f"tcp://{self.host}:{s.port + k if s.port else 0}",
                shards=s.num_shards, node_index=index, metrics=self.cfg.metrics.enabled,
                # store.persist: this host's persistence root (the node's own config)
                persist_dir=str(Path(self.cfg.run.output_dir) / "store") if s.persist else None)
            for k, index in enumerate(store_slots(self.cfg, self.rank))
        }
        addresses = {}
        for index, node in started.items():
            addresses[index] = node.wait(max(deadline - time.monotonic(), 0.0))[0]
            node.child.before_restart = refuse_restart(NOT_RESTARTED)
            self.endpoints += node.endpoint()
            self.coord.register(f"{STORE}{index}", addresses[index])
        return addresses

    def start_worker(self, name: str, role: str, wcfg: Any, threads: int) -> None:
        """Finish ``wcfg`` for this host, write it, and start the process (torch's launcher for
        DeepSpeed ranks)."""
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
        iface = interface_of(self.host)
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
            first = trainer_nodes(self.cfg)[0] == self.rank
            announce = f"tcp://{self.host}:{free_port(self.host)}"
            serve = f"tcp://{self.host}:{free_port(self.host)}"
            wcfg = replace(wcfg, weights_dir=str(self.weights_dir), weights_bind=announce,
                           weights_serve=serve)
            if first:  # rank 0 publishes; the other trainer hosts' ranks never do
                self.coord.register(WEIGHTS, json.dumps({"announce": announce, "serve": serve}))
        elif role == "rollout":
            where = json.loads(self.coord.lookup(WEIGHTS, self.cfg.run.startup_timeout_s))
            wcfg = replace(wcfg, weights_dir=str(self.weights_dir),
                           weights_announce=where["announce"], weights_fetch=where["serve"])
        return wcfg
