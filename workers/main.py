"""A worker process: ``python -m workers.main --role ROLE --config FILE``.

Builds one role from its typed config, runs its loop until the work is done or SIGTERM/SIGINT.
Exit 0 after a clean stop (held leases handed back) or completed work; 1 after an error, also
reported as ``WorkerStatus(state="failed")`` (docs/training.md "Worker processes").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

import storage
from workers.config import (
    ROLE_CONFIGS,
    AgentWorkerConfig,
    EnvironmentWorkerConfig,
    GatewayWorkerConfig,
    RewardWorkerConfig,
    RolloutWorkerConfig,
    TrainerWorkerConfig,
    WorkerConfig,
    from_json,
)
from workers.roles.build import (
    build_reference,
    build_reward,
    build_rollout_stages,
    build_trainer,
)
from workers.roles.environment import build_environment
from workers.roles.loop import serve_stage, serve_stages
from workers.runtime import cores, heap
from workers.runtime.events import EventSender, WorkerStatus
from workers.runtime.leases import LeaseKeeper
from workers.runtime.metrics import MeteredClient, MeteredEvents, WorkerMetrics


def run_worker(cfg: WorkerConfig, stop: threading.Event) -> int:
    common = cfg.common
    heap.keep_heap()  # a step's freed activations are reused, not faulted in again
    torch.set_num_threads(max(common.threads, 1))
    if common.cores is not None:  # the host's budget, shared by phase (workers.runtime.cores)
        cores.install(cores.CoreShare(common.cores))
    events: Any = EventSender(common.events_address, trace=common.trace_rows)
    timeout = common.request_timeout_s
    client: Any = storage.connect(common.store_addresses, request_timeout=timeout)
    keeper = LeaseKeeper(lambda: storage.connect(common.store_addresses, request_timeout=timeout))
    metrics, metrics_address = None, ""
    if common.metrics_host:  # taps on the reports and claims this worker makes anyway
        metrics = WorkerMetrics()
        port = metrics.start_http(common.metrics_host, common.metrics_port)
        host = common.metrics_host
        metrics_address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        events, client = MeteredEvents(events, metrics), MeteredClient(client, metrics, common.role)

    def ready() -> WorkerStatus:
        return WorkerStatus(common.name, common.role, "ready", metrics_address=metrics_address)

    session: Any = None  # storage.coordinator_session.ConsumerSession of a stage worker
    stages: list[Any] = []
    try:
        if isinstance(cfg, GatewayWorkerConfig):
            from workers.gateway.worker import run_gateway

            run_gateway(cfg, stop, lambda: events.send(ready()), events)
        elif isinstance(cfg, TrainerWorkerConfig):
            trainer = build_trainer(cfg, client, events, keeper, metrics)
            if trainer.ranks is not None and not trainer.ranks.is_leader:
                trainer.follow()  # rank > 0: rank 0 owns the store, the reports and the stop
                return 0
            trainer.publish_current()
            events.send(ready())
            while not stop.is_set() and trainer.step < cfg.iterations:
                trainer.poll(common.claim_timeout_s)
            trainer.release_held()
            trainer.stop_followers()
        else:
            if isinstance(cfg, RolloutWorkerConfig):
                stages = build_rollout_stages(cfg, events)
                if cfg.cuts.partial and metrics is not None:  # the cut and resume counters
                    metrics.follow_partial(stages[0])
            elif isinstance(cfg, EnvironmentWorkerConfig):
                stages = build_environment(cfg, metrics.tool_call if metrics else None)
            elif isinstance(cfg, AgentWorkerConfig):
                from workers.roles.agent import AgentStage

                stages = [AgentStage(cfg.fn, cfg.gateway_url, bytes.fromhex(cfg.secret),
                                     episodes=cfg.episodes, timeout_s=cfg.timeout_s,
                                     end_timeout_s=cfg.call_timeout_s, attempts=cfg.attempts)]
            elif isinstance(cfg, RewardWorkerConfig):
                stages = [build_reward(cfg)]
            else:
                stages = [build_reference(cfg)]
            events.send(ready())
            if len(stages) > 1:  # the tasks that continue rows (no balancer session yet)
                serve_stages(client, common.table, stages, stop, worker=common.name,
                             role=common.role, events=events, timeout_s=common.claim_timeout_s,
                             keeper=keeper)
            else:
                if common.coordinator_address:  # the balancer: claim from the shards we own
                    from storage.coordinator_session import ConsumerSession

                    session = ConsumerSession(
                        common.coordinator_address, common.table, stages[0].task, common.name,
                        registry=metrics.registry if metrics is not None else None,
                    )
                serve_stage(
                    client, common.table, stages[0], stop, worker=common.name, role=common.role,
                    events=events, timeout_s=common.claim_timeout_s, keeper=keeper,
                    session=session,
                )
        events.send(WorkerStatus(common.name, common.role, "stopped"))
        return 0
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc))[-4000:]
        error = f"{type(exc).__name__}: {exc}\n{detail}"
        events.send(WorkerStatus(common.name, common.role, "failed", error))
        print(detail, file=sys.stderr, flush=True)
        return 1
    finally:
        if session is not None:
            session.close()  # leave the group: its shards go to the others at once
        for stage in stages:  # e.g. a rollout's VersionWatch thread
            close = getattr(stage, "close", None)
            if close is not None:
                close()
        keeper.close()
        client.close()
        events.close()
        if metrics is not None:
            metrics.stop_http()
        cores.install(None)


EXIT_BOUND_S = 60.0  # after SIGTERM/SIGINT, a worker leaves within this, done or not


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.main", description=__doc__)
    parser.add_argument("--role", required=True,
                        choices=sorted(ROLE_CONFIGS))
    parser.add_argument("--config", required=True, help="JSON file written by the controller")
    args = parser.parse_args(argv)
    cfg = from_json(args.role, Path(args.config).read_text())
    # One line per event in the worker's log file (the controller keeps logs/<worker>.log).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    install_stop_handlers(stop)
    return run_worker(cfg, stop)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop`` (the loop finishes its turn and releases its rows)."""
    fired: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only the first signal acts. A handler runs in the main thread between two bytecodes,
        # so a second signal can land inside the first one's ``stop.set()`` while it holds the
        # event's (non-reentrant) lock: setting it again there waits on that lock forever (an
        # orphaned worker was found so, four handlers deep, never reaching its exit bound).
        if fired:
            return
        fired.append(signum)
        # The way out is bounded, and the bound is armed before anything that could block: a
        # worker whose store or controller is gone may never finish releasing its rows, and an
        # orphan (its controller SIGKILLed; PR_SET_PDEATHSIG sent this signal) has nobody to
        # SIGKILL it. A supervised worker is SIGKILLed long before (the supervisor's grace is 10 s).
        bound = threading.Timer(EXIT_BOUND_S, os._exit, args=(128 + signum,))
        bound.daemon = True
        bound.start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


if __name__ == "__main__":
    sys.exit(main())
