"""What the controller learns while a run goes on: ``RunState``, made once per run.

Records, spans, weight syncs, clocks, /metrics endpoints and the store's final counts; turns a
step report into an ``IterationRecord`` and the run's end into its ``RunSummary``
(docs/controller.md "Clocks and the run state").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import storage
from streamflow.hacking import detect_records
from streamflow.metrics import Endpoint
from streamflow.rundir import IterationRecord, RunDir, RunSummary, StageSpan
from workers.runtime.events import StepReport, WeightSyncReport

log = logging.getLogger("streamflow.controller")
# StepReport fields an IterationRecord carries unchanged
_STEP_FIELDS = ("reward_mean", "reward_std", "samples", "loss", "clip_fraction", "grad_norm",
                "ratio_mean", "ratio_min", "ratio_max", "importance_weight_mean", "staleness_mean",
                "staleness_max", "reward_failures", "turns_mean", "tool_calls_mean",
                "partial_resumes", "tokens_per_version_span", "staleness_token_mean",
                "clip_low_fraction", "clip_high_fraction", "sequence_ratio_mean",
                "importance_capped_fraction", "passes", "filtered_groups", "surplus_groups",
                "zero_variance_rate")


@dataclass
class RunState:
    rundir: RunDir
    created: float
    start_iteration: int  # the policy version the run started from (a resumed run's checkpoint)
    admitted: int  # next iteration whose prompts are not yet put
    records: list[IterationRecord]  # one per trained iteration (a resumed run's earlier ones too)
    spans: list[StageSpan]
    accuracy_before: float | None  # the starting policy's held-out accuracy
    # (reward.hacking_window, reward.hacking_drop): the rule that sets each record's reward_hacking
    hacking: tuple[int, float]
    syncs: list[WeightSyncReport] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    depths: dict[str, int] = field(default_factory=dict)  # READY rows per task, as last read
    store_totals: dict[str, Any] = field(default_factory=dict)  # the store's final counts
    startup_seconds: float | None = None  # None until the loop began
    loop_started: float = 0.0
    iteration_started: float = 0.0
    loop_ended: float | None = None
    last_progress: float = field(default_factory=time.monotonic)
    last_depths: float = 0.0

    @classmethod
    def begin(cls, created: float, rundir: RunDir, start: int,
              accuracy_before: float | None, hacking: tuple[int, float]) -> RunState:
        """A fresh run never appends to an older run's files; a run resumed at iteration
        ``start`` keeps the iterations before its checkpoint (rewritten) and drops the rest, and
        the first run's ``accuracy_before`` (the one "accuracy before RL")."""
        kept = [r for r in rundir.read_metrics() if r.iteration < start] if start else []
        spans = [s for s in rundir.read_spans() if s.iteration < start] if start else []
        for stale in (rundir.metrics_path, rundir.timeline_path, rundir.summary_path):
            stale.unlink(missing_ok=True)
        for record in kept:
            rundir.append_metrics(record)
        rundir.append_spans(spans)
        return cls(rundir, created, start, start, kept, spans, accuracy_before if start else None,
                   hacking, loop_started=created)

    def version(self) -> int:
        """The newest policy version the trainer reported (or resumed from)."""
        return max(self.records[-1].policy_version if self.records else 0, self.start_iteration)

    def begin_loop(self) -> float:
        """The RL loop's clock starts (returned): everything before it is start-up."""
        self.loop_started = self.iteration_started = time.time()
        self.startup_seconds = self.loop_started - self.created
        self.last_progress = time.monotonic()
        return self.loop_started

    def record(self, rep: StepReport, accuracy: float | None, kl_active: bool,
               last_version: int, provisioned: dict[str, Any] | None = None) -> IterationRecord:
        """The iteration ``rep`` ended: its record, appended with its spans to the run's files.
        ``provisioned``: the controller's own fields of it (``Provisioner.step_fields``)."""
        now, k = time.time(), rep.iteration
        mine = [s for s in self.spans if s.iteration == k]
        busy: dict[str, float] = {}
        for s in mine:
            busy[s.stage] = busy.get(s.stage, 0.0) + (s.end - s.start)
        syncs = [s for s in self.syncs if s.policy_version == k]
        record = IterationRecord(
            iteration=k, policy_version=rep.policy_version, accuracy=accuracy,
            generated_tokens=sum(s.tokens for s in mine if s.stage == "rollout"),
            kl=rep.kl if kl_active else None,
            # Seconds: the trainer writing version k+1 plus the rollout engines loading version k.
            # Bytes: what reached the rollout engines (each loads the whole state once per version).
            weight_sync_seconds=rep.publish_seconds + sum(s.seconds for s in syncs),
            weight_sync_bytes=sum(s.bytes for s in syncs),
            wall_seconds=now - self.iteration_started, stage_busy_seconds=busy,
            queue_depths=dict(self.depths), timestamp=now, **(provisioned or {}),
            **{name: getattr(rep, name) for name in _STEP_FIELDS})
        self.iteration_started = now
        window, drop = self.hacking
        record.reward_hacking = int(detect_records([*self.records, record], self.accuracy_before,
                                                   window=window, drop=drop) is not None)
        if rep.policy_version >= last_version:
            # The loop ends with the last optimizer step: the final checkpoint and teardown that
            # follow are not RL time.
            ends = [s.end for s in mine if s.stage == "trainer"]
            self.loop_ended = max(ends) if ends else now
        self.records.append(record)
        self.rundir.append_metrics(record)
        self.rundir.append_spans(mine)
        return record

    def read_store_totals(self, addresses: list[str], table_spec: Any,
                          restarts: dict[str, int]) -> None:
        """After every worker stopped: what the store saw (a fresh client with a short timeout:
        the loop's may have been interrupted mid-request)."""
        with storage.connect(addresses, request_timeout=3.0) as client:
            stats = client.stats(table_spec.name)
        totals = {t.name: stats.task_total(t.name) for t in table_spec.tasks}
        redelivered = {t: s.redelivered_total for t, s in totals.items() if s.redelivered_total}
        self.store_totals = {
            "redelivered_rows": sum(redelivered.values()),
            "redelivered_by_task": redelivered,
            "dead_rows": sum(s.dead for s in totals.values()),
            "in_flight_rows": sum(s.in_flight for s in totals.values()),
            "dead_reasons": {f"{t}: {reason}": n for t, s in totals.items()
                             for reason, n in s.dead_reasons.items()},
            "worker_restarts": restarts,
        }

    def finish(self, mode: str, name: str, status: str, error: str | None,
               stopped_by: str | None, *, plots: bool) -> RunSummary:
        """The run's summary, written with its plots (``plots``); the run directory is closed."""
        wall = (self.loop_ended or time.time()) - self.loop_started
        if self.startup_seconds is None:  # stopped or failed before the loop began
            self.startup_seconds, wall = time.time() - self.created, 0.0
        summary = RunSummary.from_records(
            mode, self.records, wall_seconds=wall, name=name, status=status, error=error,
            accuracy_before=self.accuracy_before, startup_seconds=self.startup_seconds,
            total_seconds=time.time() - self.created,
            stopped_by=stopped_by if status == "interrupted" else None, **self.store_totals)
        summary.weight_sync_count = len(self.syncs)  # version loads by rollout engines
        self.rundir.write_summary(summary)
        try:
            if plots:
                self.rundir.write_plots(self.records[-1].iteration if self.records else None)
        except Exception as exc:  # plots are a convenience; never mask the run's own outcome
            log.warning("could not draw plots: %s", exc)
        self.rundir.close()
        return summary
