"""The processes of a streaming run: what the RL loop needs from them, and the one-host cluster.

The controller never starts a process itself: it asks a ``Cluster``. ``LocalCluster`` runs every
process on this host under one ``Supervisor``; the restart rules (docs/faults.md) are the
supervisor's ``before_restart`` hooks set here. Lifecycle and rules: docs/controller.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import storage
from storage.ports import free_port
from streamflow import preflight
from streamflow.config import RunConfig
from streamflow.metrics import Endpoint, scrape_address, with_metrics
from streamflow.supervisor import Child, RestartPolicy, Supervisor
from workers.config import to_json

if TYPE_CHECKING:  # the plan's module loads the model stack; a launcher's dry run does not
    from streamflow.plan import RunPlan

log = logging.getLogger("streamflow.cluster")

WorkerSpec = tuple[str, str, Any, int]  # (name, role, typed worker config, threads): plan.workers


class Cluster(Protocol):
    """What the RL loop needs from the processes of a streaming run: ``LocalCluster`` (this
    host), ``streamflow.launch.MultiHostCluster`` (several hosts)."""

    host: str  # where this host's services bind (the shard coordinator)
    events_bind: str  # where the controller's report socket binds
    endpoints: list[Endpoint]  # /metrics of the store nodes and the coordinator it started
    children: dict[str, Child]  # this host's processes (workers alive, for the metrics)

    def start_store(self) -> list[str]: ...
    def start_coordinator(self, client: Any, addresses: list[str]) -> str | None: ...
    def start_workers(self, workers: list[WorkerSpec], events_address: str) -> None: ...
    def mark_ready(self, name: str) -> None: ...
    def check(self) -> str | None: ...
    def stores_up(self) -> bool: ...
    def trainer_exit_code(self) -> int | None: ...
    def restarts(self) -> dict[str, int]: ...
    def fetch_weights(self, version: int) -> None: ...
    def stop(self, between: Callable[[], None] | None, cause: str | None) -> None: ...
    def kill(self) -> None: ...


class WorkerFailed(RuntimeError):
    """A worker process failed; the message carries its error."""


@dataclass
class StoreNode:
    """A store node process this run started; ``wait`` reads its ready file."""

    child: Child
    bind: str  # the address it was asked to bind (named when that port is taken)
    ready_file: Path  # written by the node once it serves; its directory is removed after
    addresses: list[str] = field(default_factory=list)
    metrics_port: int | None = None

    def wait(self, timeout_s: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.child.exit_code() is not None or time.monotonic() > deadline:
                if "Address already in use" in self.child.log_tail():
                    raise preflight.port_in_use("store.port", self.bind)
                last = (self.child.log_tail(1) or "no output").strip()
                raise WorkerFailed(f"{self.child.name} did not start ({last}); its log: "
                                   f"{self.child.log_path}")
            time.sleep(0.05)
        info = json.loads(self.ready_file.read_text())
        shutil.rmtree(self.ready_file.parent, ignore_errors=True)
        self.addresses, self.metrics_port = list(info["addresses"]), info.get("metrics_port")
        self.child.mark_ready()  # the controller admits prompts only while stores are ready
        return self.addresses

    def endpoint(self) -> list[Endpoint]:  # the node binds its metrics on 127.0.0.1
        port = self.metrics_port
        return [(f"127.0.0.1:{port}", "store", self.child.name)] if port else []

    def restart_in_place(self, on_back: Callable[[], None]) -> None:
        """The store restart rule (store.persist; docs/controller.md): back on the same address
        and --persist-dir; ``on_back`` runs once it serves again."""

        def before(child: Child) -> None:
            self.ready_file = Path(tempfile.mkdtemp(prefix="sf-store-")) / "ready.json"
            argv = list(child.argv)
            argv[argv.index("--bind") + 1] = self.addresses[0]  # clients reconnect to this address
            argv[argv.index("--ready-file") + 1] = str(self.ready_file)
            child.argv = argv

        def after(child: Child) -> None:
            self.wait()
            on_back()

        self.child.before_restart, self.child.on_restarted = before, after


def start_store_node(sup: Supervisor, name: str, *, bind: str, shards: int, metrics: bool,
                     node_index: int = 0, persist_dir: str | None = None) -> StoreNode:
    """Start ``python -m storage.server`` as the supervised child ``name`` (not yet waited for)."""
    ready = Path(tempfile.mkdtemp(prefix="sf-store-")) / "ready.json"
    child = sup.start(name, "store", [
        sys.executable, "-m", "storage.server", "--bind", bind, "--shards", str(shards),
        "--node-index", str(node_index),
        "--ready-file", str(ready),
        *(["--metrics-port", "0"] if metrics else []),
        *(["--persist-dir", persist_dir] if persist_dir else []),  # recovered at its start
    ], threads=1)  # a store node computes no tensors
    return StoreNode(child, bind, ready)


@dataclass(frozen=True)
class TorchRun:
    """torch's launcher for a DeepSpeed trainer's ranks on this host (static rendezvous: the
    first trainer host's ``master``); rank 0 is the one that talks to the store and reports."""

    nproc: int  # ranks on this host
    master: str  # host:port of the rendezvous
    nnodes: int = 1
    node_rank: int = 0
    env: tuple[str, ...] = ()  # NAME=value prefixed through env(1), e.g. GLOO_SOCKET_IFNAME


def start_worker(sup: Supervisor, name: str, role: str, wcfg: Any, path: Path, threads: int,
                 torchrun: TorchRun | None = None) -> Child:
    """Write ``wcfg`` to ``path`` and start ``python -m workers.main`` on it as child ``name``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(wcfg))
    args = ["--role", role, "--config", str(path)]
    if torchrun is None:
        return sup.start(name, role, [sys.executable, "-m", "workers.main", *args], threads=threads)
    addr, port = torchrun.master.rsplit(":", 1)
    return sup.start(name, role, [
        *(["env", *torchrun.env] if torchrun.env else []),
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(torchrun.nnodes),
        "--node-rank", str(torchrun.node_rank), "--nproc-per-node", str(torchrun.nproc),
        "--master-addr", addr, "--master-port", port, "-m", "workers.main", *args,
    ], threads=threads)


def trainer_restart(cfg: RunConfig, run_dir: Path, wcfg: Any,
                    path: Path) -> Callable[[Child], None]:
    """The trainer restart rule: resume from the newest checkpoint, which must hold every acked
    row, so only with ``run.checkpoint_every=1`` (docs/controller.md "Resume rules")."""

    def before_restart(child: Child) -> None:
        from workers.models.checkpoint import latest_checkpoint, read_state

        if cfg.trainer.engine != "torch":
            raise RuntimeError(f"a {cfg.trainer.engine} trainer is not restarted")
        if cfg.run.checkpoint_every != 1:
            raise RuntimeError(
                "restarting the trainer needs run.checkpoint_every=1: rows acked after the "
                f"newest checkpoint would be lost (checkpoint_every={cfg.run.checkpoint_every}); "
                "resume the run with run.resume=auto")
        latest = latest_checkpoint(run_dir / "checkpoints")
        resumed = wcfg if latest is None else dataclasses.replace(
            wcfg, resume_from=str(latest), start_iteration=read_state(latest).step)
        path.write_text(to_json(resumed))
        log.warning("restarting the trainer from %s", latest or "the initial model")

    return before_restart


def refuse_restart(why: str) -> Callable[[Child], None]:
    """A ``before_restart`` that refuses: ``why`` becomes the failure's cause."""

    def before_restart(child: Child) -> None:
        raise RuntimeError(why.format(name=child.name))

    return before_restart


class LocalCluster:
    """The ``Cluster`` of one host: one store node, the workers, the coordinator, under one
    ``Supervisor`` (``MultiHostCluster`` extends it with the other hosts)."""

    def __init__(self, cfg: RunConfig, plan: RunPlan) -> None:
        self.cfg, self.plan = cfg, plan
        self.sup = Supervisor(plan.run_dir / "logs",
                              policy=RestartPolicy(max_restarts=cfg.run.max_restarts))
        self.children = self.sup.children
        self.host = cfg.store.host  # where this host's services bind (the shard coordinator)
        self.events_bind = "tcp://127.0.0.1:*"  # where the controller's report socket binds
        self.endpoints: list[Endpoint] = []  # /metrics of the store nodes and the coordinator
        self._coordinator: Any = None  # storage.coordinator.Coordinator (a thread of ours)

    def start_store(self) -> list[str]:
        s = self.cfg.store
        node = start_store_node(self.sup, "store-0", bind=f"tcp://{s.host}:{s.port}",
                                shards=s.num_shards, metrics=self.cfg.metrics.enabled,
                                persist_dir=self.plan.store_persist_dir)
        addresses = node.wait()
        self.endpoints += node.endpoint()
        if s.persist:
            node.restart_in_place(lambda: self._create_table(addresses))
        else:
            node.child.before_restart = refuse_restart("store.persist is false: the rows it held "
                                                       "are lost")
        return addresses

    def _create_table(self, addresses: list[str]) -> None:
        """After a store restart: a no-op (the node recovered the table before it served)."""
        with storage.connect(addresses, request_timeout=10.0) as client:
            client.create_table(self.plan.table_spec)
        log.warning("store node restarted on %s; table %s recovered", addresses[0],
                    self.plan.table)

    def start_coordinator(self, client: Any, addresses: list[str]) -> str | None:
        """The shard coordinator thread (``store.balancer`` and >= 2 shards), else None."""
        if not self.cfg.store.balancer or len(client.stats(self.plan.table).shards) < 2:
            return None
        from storage.coordinator import Coordinator

        metrics = self.cfg.metrics
        self._coordinator = Coordinator(f"tcp://{self.host}:0", store_addresses=addresses,
                                        metrics_port=0 if metrics.enabled else None,
                                        metrics_addr=metrics.host).start()
        if self._coordinator.metrics_port:
            self.endpoints.append((scrape_address(metrics.host, self._coordinator.metrics_port),
                                   "coordinator", "coordinator"))
        return self._coordinator.address

    def start_workers(self, workers: list[WorkerSpec], events_address: str) -> None:
        for name, role, wcfg, threads in workers:
            wcfg = with_metrics(wcfg, self.cfg.metrics)
            path = self.plan.run_dir / "workers" / f"{name}.json"
            ranks = None
            if role == "trainer" and wcfg.engine == "deepspeed":
                ranks = TorchRun(wcfg.num_ranks, f"127.0.0.1:{free_port()}")
            child = start_worker(self.sup, name, role, wcfg, path, threads, ranks)
            if role == "trainer":
                child.before_restart = trainer_restart(self.cfg, self.plan.run_dir, wcfg, path)

    def mark_ready(self, name: str) -> None:
        child = self.children.get(name)  # None: it runs on another host
        if child is not None:
            child.mark_ready()
            if child.restarts:
                log.warning("%s is ready again (restart %d)", name, child.restarts)

    def check(self) -> str | None:
        failed = self.sup.check()  # restarts what may be restarted (docs/faults.md)
        return failed.describe_failure() if failed is not None else None

    def stores_up(self) -> bool:
        return all(c.ready for c in self.children.values() if c.role == "store")

    def trainer_exit_code(self) -> int | None:
        return self.children["trainer-0"].exit_code()

    def restarts(self) -> dict[str, int]:
        return {c.name: c.restarts for c in self.children.values() if c.restarts}

    def fetch_weights(self, version: int) -> None:
        """Nothing to fetch: the trainer publishes into this host's weights directory."""

    def stop(self, between: Callable[[], None] | None, cause: str | None) -> None:
        """Workers first (each releases its leases), then ``between``, then the store node."""
        self.sup.stop_all(between=between)
        if self._coordinator is not None:
            self._coordinator.stop()

    def kill(self) -> None:
        self.sup.kill_all()

