"""``SimCluster``: the ``streamflow.cluster.Cluster`` of a simulated run with many workers on a few
cores, and its host process (``python -m bench.sim.simcluster --worker ROLE=CONFIG ...``).

The real controller (``streamflow.controller.Controller``) drives the run; only the processes
differ from ``LocalCluster``: the real store node (``storage.server``) and the shard coordinator
as in a real run, but the stage workers grouped into ``hosts`` processes that each run
``workers.main.run_worker(cfg, stop)`` in one thread per worker. The trainer gets a host of its
own, so its exit (the end of the run) is a process exit the controller can watch. Every worker
has its own store client, lease keeper and events socket and reports to the controller over the
normal events socket, exactly as a worker process does.

Invariants: a host process dies with the bench (``PR_SET_PDEATHSIG``, via the ``Supervisor``) and
exits once all its workers returned (SIGTERM sets their shared stop event, as in
``workers.main``); a host is ready once every worker in it reported ready; nothing is restarted
(a simulated run has no checkpoints to restart from).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from streamflow.cluster import LocalCluster, WorkerSpec
from streamflow.config import RunConfig
from workers.config import to_json

TRAINER_HOST = "sim-host-0"


@dataclass
class Usage:
    """CPU seconds spent from the moment every worker was ready to the start of the stop."""

    controller_s: float = 0.0  # the controller's thread (admission, reports)
    coordinator_s: float = 0.0  # the shard coordinator's thread
    store_s: float = 0.0  # the store node process
    hosts_s: float = 0.0  # the host processes (every worker thread)


def _process_cpu(pid: int, seen: dict[int, float]) -> float:
    """The process's CPU seconds; once it has exited, the last value read (``seen``)."""
    try:
        seen[pid] = sum(psutil.Process(pid).cpu_times()[:2])
    except psutil.Error:
        pass
    return seen.get(pid, 0.0)


def _thread_cpu(native_id: int | None) -> float:
    for t in psutil.Process().threads() if native_id is not None else ():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


class SimCluster(LocalCluster):
    """``LocalCluster`` whose workers run as threads of ``hosts`` stage host processes plus the
    trainer's own host. ``slowdown``: worker name -> factor its simulated device is slower by;
    ``rebalance``: the coordinator's rebalancing (False: the first ownership stays)."""

    def __init__(self, cfg: RunConfig, plan: Any, *, hosts: int = 2,
                 slowdown: dict[str, float] | None = None, rebalance: bool = True) -> None:
        super().__init__(cfg, plan)
        if hosts < 1:
            raise ValueError(f"SimCluster hosts must be >= 1, got {hosts}")
        self.hosts, self.slowdown, self.rebalance = hosts, dict(slowdown or {}), rebalance
        self.host_of: dict[str, str] = {}  # worker name -> its host process
        self.waiting: dict[str, set[str]] = {}  # host -> its workers not ready yet
        self.usage: Usage | None = None  # set at the stop, when every worker had been ready
        self._cpu0: Usage | None = None
        self._seen: dict[int, float] = {}  # pid -> CPU seconds last read (a host may exit first)

    def start_coordinator(self, client: Any, addresses: list[str]) -> str | None:
        if not self.cfg.store.balancer or len(client.stats(self.plan.table).shards) < 2:
            return None
        from storage.balance import BalancerConfig
        from storage.coordinator import Coordinator

        self._coordinator = Coordinator(f"tcp://{self.host}:0", store_addresses=addresses,
                                        balancer=BalancerConfig(rebalance=self.rebalance)).start()
        return self._coordinator.address

    def start_workers(self, workers: list[WorkerSpec], events_address: str) -> None:
        groups: dict[str, list[str]] = {}
        stage = 0  # stage workers dealt round-robin over the stage hosts
        for name, role, wcfg, _threads in workers:
            host = TRAINER_HOST
            if role != "trainer":
                host, stage = f"sim-host-{1 + stage % self.hosts}", stage + 1
            factor = self.slowdown.get(name, 1.0)
            if factor != 1.0:  # a slower device: the same simulated seconds, longer in real time
                sim = wcfg.common.simulated
                wcfg = dataclasses.replace(wcfg, common=dataclasses.replace(
                    wcfg.common, simulated=dataclasses.replace(
                        sim, time_scale=sim.time_scale / factor)))
            path = self.plan.run_dir / "workers" / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(to_json(wcfg))
            groups.setdefault(host, []).append(f"{role}={path}")
            self.host_of[name] = host
            self.waiting.setdefault(host, set()).add(name)
        for host, specs in sorted(groups.items()):
            role = "trainer" if host == TRAINER_HOST else "host"
            argv = [sys.executable, "-m", "bench.sim.simcluster"]
            for spec in specs:
                argv += ["--worker", spec]
            self.sup.start(host, role, argv, threads=1)

    def mark_ready(self, name: str) -> None:
        host = self.host_of.get(name)
        if host is None:
            return
        self.waiting[host].discard(name)
        if not self.waiting[host]:
            self.children[host].mark_ready()
        if not any(self.waiting.values()) and self._cpu0 is None:  # the loop's clock starts
            self._cpu0 = self._cpu()

    def _cpu(self) -> Usage:
        coordinator = self._coordinator._thread.native_id if self._coordinator else None
        return Usage(time.thread_time(), _thread_cpu(coordinator),
                     sum(_process_cpu(c.popen.pid, self._seen) for c in self.children.values()
                         if c.role == "store"),
                     sum(_process_cpu(c.popen.pid, self._seen) for c in self.children.values()
                         if c.role != "store"))

    def stop(self, between: Callable[[], None] | None, cause: str | None) -> None:
        if self._cpu0 is not None:
            now, then = self._cpu(), self._cpu0
            self.usage = Usage(*(getattr(now, f.name) - getattr(then, f.name)
                                 for f in dataclasses.fields(Usage)))
        super().stop(between, cause)

    def trainer_exit_code(self) -> int | None:
        code = self.children[TRAINER_HOST].exit_code()
        if code is None and self._cpu0 is not None:  # its CPU, read while it still runs
            _process_cpu(self.children[TRAINER_HOST].popen.pid, self._seen)
        return code


def serve(workers: list[tuple[str, Any]]) -> int:
    """Run every worker config in a thread of this process until all returned; the worst exit."""
    from workers.main import install_stop_handlers, run_worker

    stop = threading.Event()
    install_stop_handlers(stop)
    codes: list[int] = []

    def one(cfg: Any) -> None:
        codes.append(run_worker(cfg, stop))

    threads = [threading.Thread(target=one, args=(cfg,), name=cfg.common.name, daemon=True)
               for _, cfg in workers]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a timed join: the main thread stays free for the signal handler
            t.join(0.5)
    return max(codes, default=0) if len(codes) == len(threads) else 1


def main(argv: list[str] | None = None) -> int:
    from workers.config import from_json

    parser = argparse.ArgumentParser(prog="python -m bench.sim.simcluster", description=__doc__)
    parser.add_argument("--worker", action="append", required=True,
                        help="ROLE=CONFIG: a worker config file written by SimCluster")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    workers = []
    for spec in args.worker:
        role, _, path = spec.partition("=")
        workers.append((role, from_json(role, Path(path).read_text())))
    return serve(workers)


if __name__ == "__main__":
    sys.exit(main())
