"""Prometheus metrics of the controller, and the run's service-discovery file.

``ControllerMetrics`` (run-level series), ``write_targets`` (``prometheus/targets.json``) and
``with_metrics`` (a worker config with its endpoint on or off). Nothing is created with
``metrics.enabled=false`` (docs/controller.md "Metrics").
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from storage.metrics import HttpEndpoint
from streamflow import preflight
from streamflow.config import MetricsSection
from streamflow.rundir import IterationRecord

Endpoint = tuple[str, str, str]  # (host:port of a /metrics, role, worker): one scrape target
ROLES = ("rollout", "reward", "reference", "environment", "trainer", "store")
_ITERATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                      1800.0, 3600.0)


# attribute, type, name (after streamflow_run_), help, labels: the run-level series
_SERIES: tuple[tuple[str, Any, str, str, tuple[str, ...]], ...] = (
    ("info", Gauge, "info", "Constant 1; the run's mode as a label.", ("mode",)),
    ("target", Gauge, "target_iterations", "Iterations the run is configured for.", ()),
    ("iterations", Counter, "iterations_total",
     "Iterations completed (trainer steps reported to the controller).", ()),
    ("policy_version", Gauge, "policy_version", "Newest published policy version.", ()),
    ("samples", Counter, "samples_total", "Samples trained on.", ()),
    ("generated_tokens", Counter, "generated_tokens_total",
     "Response tokens generated, summed over iterations.", ()),
    ("reward_mean", Gauge, "reward_mean", "Mean reward of the last iteration.", ()),
    ("reward_std", Gauge, "reward_std", "Reward standard deviation of the last iteration.", ()),
    ("accuracy", Gauge, "accuracy_ratio",
     "Held-out greedy accuracy of the last evaluated policy version (0..1).", ()),
    ("reward_hacking", Gauge, "reward_hacking_ratio",
     "1 while held-out accuracy falls as the reward rises (possible reward hacking: "
     "reward.hacking_window, reward.hacking_drop), else 0; averaged over time, the share of "
     "the time it held.", ()),
    ("turns_mean", Gauge, "turns_mean",
     "Mean model turns per trajectory of the last iteration (1: single-turn).", ()),
    ("tool_calls_mean", Gauge, "tool_calls_mean",
     "Mean tool calls answered with an observation per trajectory of the last iteration.", ()),
    ("staleness_mean", Gauge, "staleness_mean_versions",
     "Mean staleness of the last iteration's samples.", ()),
    ("staleness_max", Gauge, "staleness_max_versions",
     "Largest staleness of the last iteration's samples.", ()),
    ("staleness_token_mean", Gauge, "staleness_token_mean_versions",
     "Token-weighted staleness of the last iteration (each token by its own version).", ()),
    ("version_span", Gauge, "version_span_mean_tokens",
     "Mean tokens per run of one policy version in the last iteration's responses.", ()),
    ("partial_resumes", Counter, "partial_resumes_total",
     "Trained trajectories continued with newer weights after a cut (partial rollout).", ()),
    ("filtered_groups", Counter, "filtered_groups_total",
     "Groups acked untrained by dynamic sampling for zero reward variance.", ()),
    ("zero_variance", Gauge, "zero_variance_ratio",
     "Zero-reward-variance fraction of the last iteration's groups that reached the trainer.", ()),
    ("oversample_factor", Gauge, "oversample_ratio",
     "Prompts put per prompt a step needs, at the last iteration's first put (1: no over-"
     "provisioning).", ()),
    ("weight_sync", Gauge, "weight_sync_seconds",
     "Weight-sync cost of the last iteration (trainer publish + rollout loads).", ()),
    ("queue_depth", Gauge, "queue_depth_rows",
     "Rows ready for a task, all store nodes together (polled each second).", ("task",)),
    ("workers_alive", Gauge, "workers_alive", "Processes of a role still running.", ("role",)),
    ("last_iteration", Gauge, "last_iteration_timestamp_seconds",
     "Unix time of the last iteration report.", ()),
)


class ControllerMetrics(HttpEndpoint):
    def __init__(self, mode: str, iterations: int) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # CPU and memory of this process
        for attr, kind, name, doc, labels in _SERIES:
            setattr(self, attr, kind(f"streamflow_run_{name}", doc, labels, registry=r))
        self.iteration_duration = Histogram(
            "streamflow_run_iteration_duration_seconds",
            "Wall time between consecutive iteration reports.", buckets=_ITERATION_BUCKETS,
            registry=r)
        self.info.labels(mode).set(1)
        self.target.set(iterations)
        self._http: Any = None

    def serve(self, host: str, port: int) -> str:
        """Start /metrics on ``host:port`` (0: a free port); returns where Prometheus scrapes it.
        A port taken since the preflight checks is the same one-line error as theirs."""
        try:
            bound = self.start_http(host, port)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise preflight.port_in_use("metrics.port", f"{host}:{port}") from None
            raise
        return scrape_address(host, bound)

    def on_record(self, rec: IterationRecord) -> None:
        self.iterations.inc()
        self.policy_version.set(rec.policy_version)
        self.iteration_duration.observe(rec.wall_seconds)
        self.samples.inc(rec.samples)
        self.generated_tokens.inc(rec.generated_tokens)
        self.reward_mean.set(rec.reward_mean)
        self.reward_std.set(rec.reward_std)
        if rec.accuracy is not None:
            self.accuracy.set(rec.accuracy)
        self.reward_hacking.set(rec.reward_hacking)
        self.turns_mean.set(rec.turns_mean)
        self.tool_calls_mean.set(rec.tool_calls_mean)
        self.staleness_mean.set(rec.staleness_mean)
        self.staleness_max.set(rec.staleness_max)
        self.staleness_token_mean.set(rec.staleness_token_mean)
        self.partial_resumes.inc(rec.partial_resumes)
        self.version_span.set(rec.tokens_per_version_span)
        self.filtered_groups.inc(rec.filtered_groups)
        self.zero_variance.set(rec.zero_variance_rate)
        self.oversample_factor.set(rec.oversample_factor)
        self.weight_sync.set(rec.weight_sync_seconds)
        self.last_iteration.set(rec.timestamp)

    def set_queue_depths(self, depths: dict[str, int]) -> None:
        for task, depth in depths.items():
            self.queue_depth.labels(task).set(depth)

    def set_workers_alive(self, children: Any) -> None:
        """``children``: the supervisor's ``{name: Child}``; counts running ones per role."""
        for role in ROLES:
            alive = [c for c in children.values() if c.role == role and c.exit_code() is None]
            self.workers_alive.labels(role).set(len(alive))


def scrape_address(host: str, port: int) -> str:
    """Where Prometheus on this host reaches an endpoint bound to ``host``."""
    return f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"


def with_metrics(wcfg: Any, section: MetricsSection) -> Any:
    """The worker config with its /metrics endpoint on ``section.host`` (a free port), or off."""
    host = section.host if section.enabled else None
    return replace(wcfg, common=replace(wcfg.common, metrics_host=host, metrics_port=0))


def targets_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "prometheus" / "targets.json"


def write_targets(run_dir: str | os.PathLike, endpoints: list[Endpoint],
                  run_name: str = "") -> Path:
    """Write the file_sd list: one entry per (address "host:port", role, worker)."""
    groups = [{"targets": [address], "labels": {"role": role, "worker": worker, "run": run_name}}
              for address, role, worker in endpoints if address]
    path = targets_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(groups, indent=2))
    os.replace(tmp, path)
    return path
