"""Worker and controller metrics: what the taps observe, naming rules, the service-discovery file,
the catalogue in docs/metrics.md and the dashboards' references to it, metrics.enabled=false."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
from prometheus_client import CollectorRegistry

import storage
from storage.metrics import StoreMetrics
from storage.schema import TableSpec, TaskSpec
from streamflow.config import MetricsSection, load_config
from streamflow.metrics import ControllerMetrics, targets_path, with_metrics, write_targets
from streamflow.rundir import IterationRecord
from workers.config import RewardWorkerConfig, WorkerCommon
from workers.runtime.events import EventSender, Span, StepReport, WeightSyncReport
from workers.runtime.metrics import MeteredClient, MeteredEvents, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]


def _step(**over: float) -> StepReport:
    fields = dict(iteration=0, policy_version=1, samples=8, response_tokens=20, loss=0.1, kl=0.0,
                  clip_fraction=0.0, grad_norm=1.0, reward_mean=0.5, reward_std=0.1,
                  reward_failures=2, staleness_mean=0.5, staleness_max=1,
                  importance_weight_mean=1.0, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0,
                  step_seconds=1.5,
                  publish_seconds=0.02, publish_bytes=1000, busy_seconds=1.0)
    fields.update(over)
    return StepReport(**fields)  # type: ignore[arg-type]


def test_metered_events_observe_every_report_and_forward_it() -> None:
    m = WorkerMetrics()
    events = MeteredEvents(EventSender(None, trace=False), m)
    events.send(Span("rollout", "rollout-0", 10.0, 10.5, 0, rows=4, tokens=12))
    events.send(Span("rollout", "rollout-0", 11.0, 11.25, 0, rows=4, tokens=8))
    events.send(Span("trainer", "trainer-0", 12.0, 13.0, 0, rows=0, tokens=0))  # the step itself
    events.send(WeightSyncReport("rollout-0", 3, seconds=0.2, bytes=500))
    events.send(_step(clip_fraction=0.15, ratio_mean=1.01, ratio_min=0.6, ratio_max=1.55,
                      importance_weight_mean=0.9, grad_norm=0.7))
    assert len(events.sent) == 5  # forwarded unchanged
    value = m.registry.get_sample_value
    assert value("streamflow_stage_rows_total", {"stage": "rollout"}) == 8
    assert value("streamflow_stage_busy_seconds_total", {"stage": "rollout"}) == 0.75
    assert value("streamflow_stage_duration_seconds_count", {"stage": "rollout"}) == 2
    assert value("streamflow_stage_duration_seconds_count", {"stage": "trainer"}) is None
    assert value("streamflow_stage_busy_seconds_total", {"stage": "trainer"}) == 1.0
    assert value("streamflow_generated_tokens_total") == 20
    assert value("streamflow_weight_sync_bytes_total", {"side": "load"}) == 500
    assert value("streamflow_weight_sync_bytes_total", {"side": "publish"}) == 1000
    assert value("streamflow_weight_sync_duration_seconds_count", {"side": "publish"}) == 1
    assert value("streamflow_worker_policy_version") == 1  # the step report came last
    assert value("streamflow_trainer_steps_total") == 1
    assert value("streamflow_trainer_step_duration_seconds_sum") == 1.5
    assert value("streamflow_trainer_staleness_max_versions") == 1
    assert value("streamflow_trainer_reward_mean") == 0.5
    assert value("streamflow_trainer_reward_failures_total") == 2
    assert value("streamflow_trainer_clip_fraction_ratio") == 0.15
    assert [value("streamflow_trainer_policy_ratio", {"stat": s}) for s in ("mean", "min", "max")
            ] == [1.01, 0.6, 1.55]
    assert value("streamflow_trainer_importance_weight_mean") == 0.9
    assert value("streamflow_trainer_grad_norm_mean") == 0.7
    assert value("streamflow_trainer_last_checkpoint_timestamp_seconds") == 0  # none saved yet


def test_metered_client_observes_sample_age_and_keeps_the_stage_columns() -> None:
    spec = TableSpec("t", pa.schema([("group_id", pa.int64()), ("x", pa.int64())]),
                     tasks=(TaskSpec("reward", ("x",)),))
    m = WorkerMetrics()
    with storage.embedded(num_shards=1) as store:
        client = MeteredClient(store.client(), m, "reward")
        client.create_table(spec)  # passes through
        client.put("t", pa.table({"group_id": [1, 2, 3], "x": [1, 2, 3]}))
        time.sleep(0.05)  # the rows' age is what is measured: at least 50 ms at the claim
        lease = client.claim("t", "reward", ["x"], 8, timeout=1.0)
        assert lease.num_rows == 3 and "x" in lease.batch.schema.names
        client.ack(lease)
        empty = client.claim("t", "reward", ["x"], 8, timeout=0.0)
        assert empty.num_rows == 0
        client.close()
    value = m.registry.get_sample_value
    assert value("streamflow_sample_age_seconds_count", {"stage": "reward"}) == 3
    age = value("streamflow_sample_age_seconds_sum", {"stage": "reward"})
    assert 0.15 <= age < 30  # three rows, each at least 50 ms old


def test_worker_endpoint_serves_its_registry() -> None:
    m = WorkerMetrics()
    port = m.start_http("127.0.0.1", 0)
    try:
        m.observe(Span("reward", "reward-0", 0.0, 0.5, 0, rows=3))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        text = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.stop_http()
    assert 'streamflow_stage_rows_total{stage="reward"} 3.0' in text
    assert "process_resident_memory_bytes" in text


def _record(k: int, accuracy: float | None) -> IterationRecord:
    return IterationRecord(
        iteration=k, policy_version=k + 1, reward_mean=0.25, reward_std=0.5, accuracy=accuracy,
        samples=16, generated_tokens=40, loss=0.0, kl=None, clip_fraction=0.0, grad_norm=1.0,
        staleness_mean=0.0, staleness_max=0, weight_sync_seconds=0.01, weight_sync_bytes=10,
        reward_failures=0, wall_seconds=2.0, stage_busy_seconds={}, queue_depths={},
        timestamp=100.0 + k,
    )


class _Child:
    def __init__(self, role: str, code: int | None) -> None:
        self.role, self._code = role, code

    def exit_code(self) -> int | None:
        return self._code


def test_controller_metrics_follow_records_depths_and_children() -> None:
    m = ControllerMetrics("periodic", 10)
    m.on_record(_record(0, accuracy=0.4))
    m.on_record(_record(1, accuracy=None))  # not evaluated: the last accuracy stays
    m.set_queue_depths({"rollout": 3, "trainer": 0})
    m.set_workers_alive({"a": _Child("rollout", None), "b": _Child("rollout", None),
                         "c": _Child("trainer", 0), "d": _Child("store", None)})
    value = m.registry.get_sample_value
    assert value("streamflow_run_iterations_total") == 2
    assert value("streamflow_run_policy_version") == 2
    assert value("streamflow_run_samples_total") == 32
    assert value("streamflow_run_accuracy_ratio") == 0.4
    assert value("streamflow_run_info", {"mode": "periodic"}) == 1
    assert value("streamflow_run_queue_depth_rows", {"task": "rollout"}) == 3
    assert value("streamflow_run_workers_alive", {"role": "rollout"}) == 2
    assert value("streamflow_run_workers_alive", {"role": "trainer"}) == 0
    assert value("streamflow_run_workers_alive", {"role": "store"}) == 1


def _families(registry: CollectorRegistry) -> list:
    return [f for f in registry.collect() if not f.name.startswith("process_")]


def test_metric_names_follow_the_conventions() -> None:
    families = _families(WorkerMetrics().registry) + _families(ControllerMetrics("sync", 1).registry)
    families += _families(StoreMetrics().registry)
    assert len(families) >= 40
    units = ("_seconds", "_bytes", "_rows", "_versions", "_ratio", "_mean", "_std", "_version",
             "_iterations", "_alive", "_info", "_tokens", "_tables", "_requests")
    for f in families:
        name = f.name + ("_total" if f.type == "counter" else "")
        assert name.startswith("streamflow_"), name
        assert f.type != "summary", name
        assert (f.type == "counter") == name.endswith("_total"), name
        if f.type != "counter":
            assert name.endswith(units), f"{name}: no base-unit suffix"


def _catalogue() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"`(streamflow_[a-z_]+)`", text))


def test_catalogue_documents_every_metric_and_dashboards_use_only_documented_ones() -> None:
    documented = _catalogue()
    families = _families(WorkerMetrics().registry) + _families(ControllerMetrics("sync", 1).registry)
    families += _families(StoreMetrics().registry)
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert names - documented == set()
    datasource = (ROOT / "grafana/provisioning/datasources/streamflow.yaml").read_text()
    uid = re.search(r"uid: (\S+)", datasource).group(1)  # type: ignore[union-attr]
    used = set()
    for path in (ROOT / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        assert board["uid"] and board["panels"]
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == uid, (path.name, panel["title"])
            for target in panel["targets"]:
                used |= set(re.findall(r"streamflow_[a-z_]+", target["expr"]))
    base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert base - documented == set()
    assert len(base) >= 25


def test_targets_file_and_worker_configs(tmp_path: Path) -> None:
    path = write_targets(tmp_path, [("127.0.0.1:1", "controller", "controller"),
                                    ("", "rollout", "rollout-0"),  # metrics off: not listed
                                    ("127.0.0.1:2", "trainer", "trainer-0")], "demo")
    assert path == targets_path(tmp_path)
    groups = json.loads(path.read_text())
    assert groups == [
        {"targets": ["127.0.0.1:1"],
         "labels": {"role": "controller", "worker": "controller", "run": "demo"}},
        {"targets": ["127.0.0.1:2"],
         "labels": {"role": "trainer", "worker": "trainer-0", "run": "demo"}},
    ]
    w = RewardWorkerConfig(WorkerCommon("reward-0", "reward", [], "t", seed=0, threads=1,
                                        trace_rows=False), "m", rows_per_claim=32,
                           model_device="cpu", model_dtype="float32", fn="exact_match",
                           hub=None)
    assert with_metrics(w, MetricsSection(host="0.0.0.0")).common.metrics_host == "0.0.0.0"
    assert with_metrics(w, MetricsSection(enabled=False)).common.metrics_host is None


def test_metrics_disabled_binds_nothing_and_writes_no_targets(
    tmp_path: Path, model_cache: Path
) -> None:
    from streamflow.controller import Controller

    tmp_path = model_cache / tmp_path.name  # the warm-started tiny model is cached per session

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"run.output_dir={tmp_path / 'off'}", "run.mode=sync", "run.iterations=1",
        "metrics.enabled=false", "run.eval_every=0",
    ])
    controller = Controller(cfg)
    assert controller.metrics is None
    summary = controller.run()
    assert summary.status == "ok"
    assert not targets_path(tmp_path / "off").exists()
    on = load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"run.output_dir={tmp_path / 'on'}", "run.mode=sync", "run.iterations=1",
        "run.eval_every=0",
    ])
    controller = Controller(on)
    started = time.time()
    controller.run()
    groups = json.loads(targets_path(tmp_path / "on").read_text())
    assert [g["labels"]["role"] for g in groups] == ["controller"]
    # Sync mode: the stage series live in the controller's own registry.
    value = controller.metrics.registry.get_sample_value  # type: ignore[union-attr]
    assert value("streamflow_stage_rows_total", {"stage": "rollout"}) == 8
    assert value("streamflow_run_iterations_total") == 1
    # The trainer's checkpoint at the last iteration sets the gauge: to a time inside the run,
    # no later than the checkpoint's files (broken if the trainer here is built without them).
    saved = value("streamflow_trainer_last_checkpoint_timestamp_seconds")
    newest = max(f.stat().st_mtime for f in (tmp_path / "on" / "checkpoints").rglob("*")
                 if f.is_file())
    assert started <= saved and newest - 1.0 <= saved <= time.time(), (started, saved, newest)
