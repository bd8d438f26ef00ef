"""The RL loop: one controller, three modes, every sample through the store.

Dataflow of one iteration k (G responses per prompt, P prompts per iteration)::

    controller ──put P×G prompt rows (iteration k, min_policy_version k-s)──►┌────────────────┐
        ▲                                                                    │  transfer      │
        │  reports: spans, steps,        rollout  ◄─claim whole groups───────┤  queue         │
        │  weight syncs, status            │ generate G with version ≥ k-s   │  (storage/)    │
        │                                  └─write response_ids, logprobs──► │  one row per   │
        │                                reward   ◄─claim response_ids──────┤  sample, one   │
        │                                  └─write reward──────────────────►│  column per    │
        │                                reference◄─claim response_ids──────┤  field         │
        │                                  └─write ref_logprobs────────────►│                │
        │                                trainer  ◄─claim whole groups ready─┤                │
        └────────────────────────────────  │ fwd/bwd per micro-batch, step   └────────────────┘
                                           └─publish weights v=k+1 ──► rollout loads at its next claim

What each loop consumes, produces, waits on, and what unblocks it:

    loop        consumes                 produces                 waits on              unblocked by
    controller  trainer step reports     prompt rows of k         version ≥ k - s       trainer publish
    rollout     prompt_ids (groups)      response, logprobs, v    rows ready; weights   controller put; publish
    environment tool-call piece (T>1)    observation piece        rows ready            rollout.{k} write
    reward      response_ids             reward                   rows ready            rollout write
    reference   response_ids             ref_logprobs             rows ready            rollout write
    trainer     all columns (groups)     weights v+1, advantages  all rows of k in      reward/ref writes

Multi-turn (``rollout.max_turns`` > 1), rollout and environment pass each row back and forth,
each continuing it with a piece, until one ends it with its response_ids (docs/training.md).
Modes: ``sync`` runs every role in this process, stages taking turns (``ColocatedLoop``);
``periodic`` (s = 0) and ``async`` (s = ``max_staleness``) stream between one process per worker
(``_run_streaming``), started and restarted by a ``Cluster`` (``LocalCluster`` or
``MultiHostCluster``).
Modes, lifecycle, stopping and failure rules: docs/controller.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import storage
from storage.errors import Unavailable, UnknownTable
from streamflow import interrupt, preflight, tracefile
from streamflow.admission import admissible
from streamflow.cluster import Cluster, LocalCluster, WorkerFailed
from streamflow.config import RunConfig, config_to_dict
from streamflow.metrics import ControllerMetrics, write_targets
from streamflow.plan import Evaluator, RunPlan, build_plan
from streamflow.progress import ProgressDisplay, StepProgress, describe_run
from streamflow.provision import PromptsSolved, Provisioner
from streamflow.rundir import RunDir, RunSummary, StageSpan
from streamflow.runstate import RunState
from workers.roles.build import (
    build_reference,
    build_reward,
    build_rollout_stages,
    build_trainer,
)
from workers.roles.environment import build_environment
from workers.roles.loop import StageLoop
from workers.runtime import cores, heap
from workers.runtime.cores import CoreShareConfig
from workers.runtime.events import (
    EventReceiver,
    EventSender,
    RowTrace,
    SamplingReport,
    Span,
    StepReport,
    WorkerStatus,
)
from workers.runtime.faults import dead_groups
from workers.runtime.leases import LeaseKeeper
from workers.runtime.metrics import MeteredEvents, WorkerMetrics
from workers.runtime.trace import put_trace

log = logging.getLogger("streamflow.controller")
ClusterFactory = Callable[[RunConfig, RunPlan], Cluster]


class Controller:
    def __init__(self, cfg: RunConfig, cluster: ClusterFactory = LocalCluster) -> None:
        created = time.time()
        self.cfg, self.make_cluster = cfg, cluster
        preflight.check_output_dir(cfg)  # never silently into an older run's directory
        if cfg.run.overwrite:
            preflight.clear_output_dir(cfg.run.output_dir)
        previous = RunDir(cfg.run.output_dir).read_summary() if cfg.run.resume else None
        self.rundir = RunDir(cfg.run.output_dir)
        self.rundir.write_config(cfg)  # the resolved config is in the run dir from the start
        # RUN/trace (streamflow.tracefile): started afresh; an older trace is removed either way
        self.trace = tracefile.TraceWriter(self.rundir.trace) if cfg.run.trace else None
        self._trace_due = False  # an iteration was recorded: write its part file (_flush_trace)
        if self.trace is None:
            tracefile.clear(self.rundir.trace)
        with StepProgress("warm start", enabled=cfg.run.progress) as warm:
            self.plan: RunPlan = build_plan(cfg, self.rundir.path, progress=warm)
        self.state = RunState.begin(created, self.rundir, self.plan.start_iteration,
                                    previous and previous.accuracy_before,
                                    (cfg.reward.hacking_window, cfg.reward.hacking_drop))
        self.staleness = cfg.max_staleness  # 0 unless async
        self.evaluator = Evaluator(self.plan)
        # the prompt rows of each put (dynamic sampling), going on from a resumed run's records
        self.provision = Provisioner(self.plan, self.state.records)
        self.metrics = (ControllerMetrics(cfg.run.mode, cfg.run.iterations)  # Prometheus
                        if cfg.metrics.enabled else None)
        self.display = ProgressDisplay(cfg.run.iterations, cfg.run.mode, enabled=cfg.run.progress)

    def run(self) -> RunSummary:
        cfg, st = self.cfg, self.state
        status, error = "ok", None
        with interrupt.installed() as stop:
            try:
                if self.metrics is not None:
                    address = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
                    st.endpoints.append((address, "controller", "controller"))
                    write_targets(self.rundir.path, st.endpoints, cfg.run.name)
                with self.display:
                    if cfg.run.eval_every and not self.plan.start_iteration:
                        self.display.set_phase("evaluating the starting policy")
                        st.accuracy_before = self.evaluator.accuracy(self.plan.start_iteration)
                    self.display.accuracy_before = st.accuracy_before
                    if cfg.run.mode == "sync":
                        self._run_colocated()
                    else:
                        self._run_streaming(stop)
            except PromptsSolved as exc:  # nothing left to train on: a stop, with its one line
                status, error = "solved", str(exc)
                log.warning("stopping: %s", exc)
            except BaseException as exc:
                if not stop.caused(exc):
                    status, error = "failed", f"{type(exc).__name__}: {exc}"
                    raise
                if not isinstance(exc, KeyboardInterrupt):  # the interrupt, as C code raised it
                    log.info("stopping: %s: %s raised by the interrupt", type(exc).__name__, exc)
                status = "interrupted"
                error = f"interrupted by {stop.signal_name}" if stop.signal_name else "interrupted"
            finally:
                if self.trace is not None:
                    self.trace.close()
                summary = st.finish(cfg.run.mode, cfg.run.name, status, error, stop.signal_name,
                                   plots=cfg.run.plots)
                cores.install(None)
                self.plan.cleanup()
                if self.metrics is not None:
                    self.metrics.stop_http()
        return summary

    def _run_colocated(self) -> None:
        # Colocated: this one process holds every model and gets the largest thread budget.
        heap.keep_heap()  # its stages' freed activations are reused, not faulted in again
        torch.set_num_threads(
            self.plan.host_threads or max(self.cfg.rollout.threads, self.cfg.trainer.threads))
        events: Any = EventSender(None, trace=self.cfg.run.trace)  # reports stay in memory
        if self.metrics is not None:  # the workers' series, from this one process's endpoint
            events = MeteredEvents(events, WorkerMetrics(self.metrics.registry))
        with ColocatedLoop(self.plan, events, self._dispatch, self._check_stall,
                           persist=True, provision=self.provision) as loop:
            self.display.start_loop(self.state.begin_loop())
            for k in range(self.plan.start_iteration, self.cfg.run.iterations):
                loop.iteration(k, self.staleness)
                self._flush_trace()
            self.state.loop_ended = self.state.loop_ended or time.time()

    def _run_streaming(self, stop: interrupt.StopSignals) -> None:
        cfg, plan, st = self.cfg, self.plan, self.state
        cluster = self.make_cluster(cfg, plan)
        self.evaluator.fetch = cluster.fetch_weights  # versions published on another host
        remove_force = stop.on_force(cluster.kill)  # a second Ctrl-C: no grace period
        receiver = EventReceiver(cluster.events_bind)
        addresses: list[str] = []
        client: storage.Client | None = None
        try:
            self.display.set_phase("starting the store node")
            addresses = list(cfg.store.addresses) or cluster.start_store()
            client = storage.connect(addresses, request_timeout=10.0)
            if cfg.store.addresses:  # a long-lived store: this run's table starts afresh
                with contextlib.suppress(UnknownTable):
                    client.drop_table(plan.table)
            client.create_table(plan.table_spec)
            coordinator = cluster.start_coordinator(client, addresses)
            st.endpoints += cluster.endpoints  # its store nodes' and coordinator's /metrics
            if self.metrics is not None:
                write_targets(self.rundir.path, st.endpoints, cfg.run.name)
            if plan.cores_path is not None:  # evaluation takes slot 0 of the host's budget
                cores.install(cores.CoreShare(CoreShareConfig(
                    str(plan.cores_path), 0, plan.host_threads)))
            workers = plan.workers(addresses, receiver.endpoint, coordinator)
            cluster.start_workers(workers, receiver.endpoint)
            self._wait_ready(cluster, receiver, {name for name, *_ in workers})
            self._stream(cluster, receiver, client)
        finally:
            exc = sys.exc_info()[1]
            if exc is not None and stop.caused(exc):
                log.warning("stopping: workers finish their turn and release their rows, then the "
                            "store node stops (Ctrl-C again to stop at once)")
            final = (lambda: st.read_store_totals(addresses, plan.table_spec, cluster.restarts())
                     ) if client is not None else None
            cluster.stop(final, None if exc is None else f"{type(exc).__name__}: {exc}")
            if self.trace is not None:  # the workers' last records (their final acks)
                self._dispatch([r for r in receiver.recv(0.1) if isinstance(r, RowTrace)])
            remove_force()
            if client is not None:
                client.close()
            receiver.close()

    def _wait_ready(self, cluster: Cluster, receiver: EventReceiver, names: set[str]) -> None:
        """Start-up (imports, model loads) is not RL time: the loop clock starts once all are up."""
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        total = len(names)
        while names:
            self.display.set_phase(f"starting workers: {total - len(names)}/{total} ready")
            for rec in self._receive(cluster, receiver, "during start-up: "):
                names.discard(rec.worker)
                self.state.endpoints.append((rec.metrics_address, rec.role, rec.worker))
            if time.monotonic() > deadline:
                raise WorkerFailed(f"workers not ready in time: {sorted(names)}")
        self.display.start_loop(self.state.begin_loop())  # start-up is not RL time
        if self.metrics is not None:  # every endpoint is known now: let Prometheus find them
            write_targets(self.rundir.path, self.state.endpoints, self.cfg.run.name)
            self.metrics.set_workers_alive(cluster.children)

    def _stream(self, cluster: Cluster, receiver: EventReceiver,
                client: storage.Client) -> None:
        """Admit, read reports, let the cluster restart what died, until the trainer is done."""
        st, iterations = self.state, self.cfg.run.iterations
        self._admit(client, self.plan.start_iteration)
        while True:
            self._receive(cluster, receiver)
            store_up = cluster.stores_up()
            if store_up:  # a put whose reply was lost could not be told from a lost put
                self._admit(client, st.version())
            self._flush_trace()  # after the put: the next iteration does not wait for the file
            if cluster.trainer_exit_code() == 0:
                # The trainer can exit before its last step report was read: read it, bounded.
                deadline = time.monotonic() + 10.0
                self._dispatch(receiver.recv(0.2))
                while st.version() < iterations and time.monotonic() < deadline:
                    self._dispatch(receiver.recv(0.2))
                st.loop_ended = st.loop_ended or time.time()
                if st.version() < iterations:  # the trainer alone was stopped (SIGTERM)
                    raise KeyboardInterrupt
                return
            self._check_stall()
            if store_up and time.monotonic() - st.last_depths > 1.0:
                self._refresh_depths(client)
                if self.metrics is not None:
                    self.metrics.set_workers_alive(cluster.children)

    def _receive(self, cluster: Cluster, receiver: EventReceiver,
                 context: str = "") -> list[WorkerStatus]:
        """Reports of the next 0.2 s, then the cluster's check (restarts); the "ready" ones."""
        ready = []
        for rec in receiver.recv(0.2):
            if isinstance(rec, WorkerStatus) and rec.state == "ready":
                cluster.mark_ready(rec.worker)
                ready.append(rec)
            else:
                self._dispatch([rec])
        cause = cluster.check()
        if cause is not None:
            raise WorkerFailed(context + cause)
        return ready

    def _admit(self, client: storage.Client, version: int) -> None:
        """Put every iteration the staleness bound allows: k is admitted once version ≥ k - s."""
        st = self.state
        while st.admitted < self.cfg.run.iterations and admissible(st.admitted, self.staleness,
                                                                   version):
            self._put(client, self.provision.first_put(st.admitted, self.staleness))
            st.admitted += 1
        for rows in self.provision.top_ups(self.staleness):  # dynamic sampling: short iterations
            self._put(client, rows)

    def _put(self, client: storage.Client, rows: Any) -> None:
        ids = client.put(self.plan.table, rows, timeout=600.0)
        if self.trace is not None:
            self.trace.add(put_trace(ids, rows))

    def _dispatch(self, records: list) -> None:
        st = self.state
        for rec in records:
            st.last_progress = time.monotonic()
            if isinstance(rec, Span):
                st.spans.append(StageSpan(rec.role, rec.worker, rec.start, rec.end, rec.iteration,
                                          rec.rows, rec.tokens))
            elif isinstance(rec, StepReport):
                self._on_step(rec)
            elif isinstance(rec, SamplingReport):
                self.provision.observe([rec])
            elif isinstance(rec, RowTrace):
                if self.trace is not None:
                    self.trace.add(rec)
            elif not isinstance(rec, WorkerStatus):  # the one other record: a WeightSyncReport
                st.syncs.append(rec)
            elif rec.state == "unrecoverable":  # the trainer's iteration can never be trained
                raise WorkerFailed(rec.error)
            elif rec.state == "failed":
                # The cluster decides (restart or fail) once the process has exited.
                log.warning("%s failed: %s", rec.worker, (rec.error or "").splitlines()[0:1])

    def _on_step(self, rep: StepReport) -> None:
        st, iterations = self.state, self.cfg.run.iterations
        if st.records and rep.iteration <= st.records[-1].iteration:
            return  # a restarted trainer retrains an iteration: the first report stands
        every = self.cfg.run.eval_every
        evaluate = every and (rep.policy_version % every == 0 or rep.iteration == iterations - 1)
        accuracy = self.evaluator.accuracy(rep.policy_version) if evaluate else None
        record = st.record(rep, accuracy, self.cfg.kl_active, iterations,
                           self.provision.step_fields(rep.iteration))
        self.provision.observe([rep])
        # the trainer sent the iteration's consume records before its report: they are in
        self._trace_due = self.trace is not None
        if self.metrics is not None:
            self.metrics.on_record(record)
        self.display.update(record)

    def _flush_trace(self) -> None:
        """The trace's next part file when one is due, looked at once per recorded iteration
        (streamflow.tracefile.TraceWriter.flush_due)."""
        if self._trace_due and self.trace is not None:
            self._trace_due = False
            self.trace.flush_due()

    def _refresh_depths(self, client: storage.Client) -> None:
        st = self.state
        st.last_depths = time.monotonic()
        try:
            stats = client.stats(self.plan.table)
        except (Unavailable, UnknownTable):  # the store node restarts: the cluster handles it
            return
        st.depths = {t.name: stats.task_total(t.name).ready for t in self.plan.table_spec.tasks}
        if self.provision.enabled:  # dead groups never reach the trainer: they count as back
            self.provision.observe_dead(dead_groups(stats, list(st.depths))[0])
        if self.metrics is not None:
            self.metrics.set_queue_depths(st.depths)
        self.display.set_queue_depths(st.depths)

    def _check_stall(self) -> None:
        limit = self.cfg.run.stall_timeout_s
        if limit and time.monotonic() - self.state.last_progress > limit:
            raise WorkerFailed(f"no progress for {limit:.0f}s (run.stall_timeout_s); see "
                               f"{self.rundir.path / 'logs'}")


@dataclass(frozen=True)
class StageSeconds:
    """Wall seconds of one colocated iteration: each stage's drain, the trainer's wait, in all."""

    rollout: float
    reward: float
    reference: float  # 0.0 without a reference worker
    trainer: float  # from the end of the last stage to the trainer's step report
    total: float  # from before the put to the step report
    # multi-turn: the env.{k} drains (the rollout.{k} drains count as rollout); 0.0 single-turn
    environment: float = 0.0


class ColocatedLoop:
    """``sync`` mode's loop: every role in this process over an embedded store, stages taking turns.

    ``Controller`` runs it to the last iteration; ``bench phases`` times its iterations one by
    one (the same code, no copy). ``dispatch`` gets the reports the workers sent after each
    stage and while the trainer finishes its step; ``check`` runs while it waits (stall rule).
    Invariant: ``iteration(k)`` returns once the trainer reported the step of k. ``provision``:
    the prompt rows of each put (the controller's, so its records carry the same numbers).
    ``persist``: the embedded store logs to ``plan.store_persist_dir`` (store.persist); False:
    never (a benchmark's throwaway iterations).
    """

    def __init__(self, plan: RunPlan, events: Any, dispatch: Callable[[list], None],
                 check: Callable[[], None] = lambda: None, *, persist: bool,
                 provision: Provisioner | None = None) -> None:
        self.plan, self.events, self.dispatch, self.check = plan, events, dispatch, check
        self.provision = provision or Provisioner(plan)
        self._stack = contextlib.ExitStack()
        try:
            self._open(persist)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, persist: bool) -> None:
        plan, events = self.plan, self.events
        store = self._stack.enter_context(storage.embedded(
            plan.store.num_shards, persist_dir=plan.store_persist_dir if persist else None))
        self.client = client = store.client()
        client.create_table(plan.table_spec)
        self.keeper = LeaseKeeper(store.client)
        envs = build_environment(plan.environment, _tool_tap(events)) if plan.environment else []
        self._stack.callback(lambda: [s.close() for s in envs])  # an MCP server, a user's child
        stages = _piece_order(build_rollout_stages(plan.rollout, events), envs)
        stages.append(("reward", reward := build_reward(plan.reward)))
        if plan.reference:
            stages.append(("reference", build_reference(plan.reference)))
        self._stack.callback(client.close)  # closed in the reverse order: keeper, reward, client
        self._stack.callback(reward.close)
        self._stack.callback(self.keeper.close)
        # the checkpoint gauge: the worker metrics this process serves, if any
        self.trainer = build_trainer(plan.trainer, client, events, self.keeper,
                                     getattr(events, "metrics", None))
        self.trainer.publish_current()
        self.loops = [StageLoop(client, plan.table, stage, worker=f"{role}-0", role=role,
                                events=events, keeper=self.keeper) for role, stage in stages]

    def iteration(self, k: int, staleness: int = 0) -> StageSeconds:
        """Put iteration k, drain each stage in turn, wait for the trainer's step of k (with
        dynamic sampling: put more prompts and drain again while k is short of groups)."""
        t0 = time.perf_counter()
        seconds = {"reference": 0.0, "rollout": 0.0, "environment": 0.0, "trainer": 0.0}
        puts = [self.provision.first_put(k, staleness)]
        while puts:
            for rows in puts:
                ids = self.client.put(self.plan.table, rows, timeout=600.0)
                if getattr(self.events, "trace", False):  # (run.trace: the stage loops trace too)
                    self.events.send(put_trace(ids, rows))
            for loop in self.loops:  # each stage drains the whole batch before the next
                start = time.perf_counter()
                while loop.turn(0.0):  # the last (empty) claim carries the last write+ack
                    pass
                seconds[loop.role] = seconds.get(loop.role, 0.0) + time.perf_counter() - start
                self._reports()
            start = time.perf_counter()
            puts = self._train(staleness)
            seconds["trainer"] += time.perf_counter() - start
        self._reports()
        return StageSeconds(**seconds, total=time.perf_counter() - t0)

    def _train(self, staleness: int) -> list:
        """Poll the trainer until its step ([]), or until the iteration is short of groups with
        variance and every one put came back: the rows of the next put (``top_ups``)."""
        dead_read = time.monotonic()
        while not self.trainer.poll(0.0):
            self._reports()  # an "unrecoverable" iteration fails the run here
            self.check()
            if not self.provision.enabled:
                continue
            if time.monotonic() - dead_read > 1.0:  # DEAD groups never reach the trainer
                dead_read = time.monotonic()
                tasks = [t.name for t in self.plan.table_spec.tasks]
                self.provision.observe_dead(dead_groups(self.client.stats(self.plan.table),
                                                        tasks)[0])
            more = self.provision.top_ups(staleness)
            if more:
                return more
        return []

    def _reports(self) -> None:
        sent = list(self.events.sent)
        self.events.sent.clear()
        self.dispatch(sent)
        self.provision.observe(sent)  # (idempotent: the controller's dispatch may have too)

    def __enter__(self) -> ColocatedLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _tool_tap(events: Any) -> Callable[[float, str | None], None] | None:
    """The environment stages' per-call tap: the worker metrics this process serves, if any."""
    metrics = getattr(events, "metrics", None)
    return metrics.tool_call if metrics is not None else None


def _piece_order(rollouts: list[Any], environments: list[Any]) -> list[tuple[str, Any]]:
    """sync's drain order of a trajectory's tasks, by the piece each writes: rollout, env.1,
    rollout.2, env.3, ... (each task's rows are ready only once the one before it wrote them)."""
    staged = [("rollout", s) for s in rollouts] + [("environment", s) for s in environments]
    return sorted(staged, key=lambda rs: rs[1].piece)


def run(cfg: RunConfig, cluster: ClusterFactory = LocalCluster) -> RunSummary:
    """Run one RL job to completion (``streamflow run``; ``streamflow.launch`` passes a cluster)."""
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(name)s %(message)s")
    log.debug("resolved config: %s", json.dumps(config_to_dict(cfg)))
    if logging.getLogger("streamflow").isEnabledFor(logging.INFO):
        print(describe_run(cfg), file=sys.stderr, flush=True)
    summary = Controller(cfg, cluster).run()
    if summary.status == "failed":
        raise WorkerFailed(summary.error or summary.status)
    # "ok"; "interrupted": a clean, requested stop (resume with resume=auto); "solved": dynamic
    # sampling found nothing left to train on (streamflow.provision.PromptsSolved)
    return summary
