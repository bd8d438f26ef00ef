"""Every knob of a run has one default. The worker records (workers.config) carry the run's
settings objects or take the value from the plan with no default of their own; the store's limits
are declared in storage and the run config takes its defaults from there."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest
from testkit import worker_plan

from storage.schema import TableSpec
from storage.server import ServerConfig
from streamflow.cli import main as cli_main
from streamflow.config import RunConfig, StoreSection, load_config
from streamflow.config.convert import section_keys
from workers import config as records
from workers.checked import Checked, embedded

ROLE_RECORDS = {"rollout": records.RolloutWorkerConfig, "reward": records.RewardWorkerConfig,
                "reference": records.ReferenceWorkerConfig,
                "trainer": records.TrainerWorkerConfig}

# Record fields with a default that no YAML key sets: the worker's own, and why.
WORKER_INTERNAL = {
    "WorkerCommon.events_address": "the controller's socket (None: reports kept in memory)",
    "WorkerCommon.claim_timeout_s": "how often the loop re-checks for shutdown",
    "WorkerCommon.metrics_host": "set by the cluster from metrics.* (None: no endpoint)",
    "WorkerCommon.metrics_port": "0: every worker picks a free port and reports it",
    "WorkerCommon.request_timeout_s": "how soon a dead store node is noticed",
    "WorkerCommon.coordinator_address": "the run's coordinator (None: claim from any shard)",
    "WorkerCommon.simulated": "None: a real engine (the plan sets simulated.* otherwise)",
    "WorkerCommon.cores": "None: own threads (the plan sets run.host_threads' share)",
    "WorkerCommon.trace_rows": "False: no row trace (the plan sets it from run.trace)",
    "CoreShareConfig.max_threads": "0: no cap (the plan caps the rollout at its threads)",
    "WeightGroupConfig.transport": "derived by the plan from the members' devices",
    "WeightGroupConfig.shm_dir": "derived by the plan (the weights directory)",
    "RolloutWorkerConfig.weight_wait_s": "longest wait for a required policy version",
    "RolloutWorkerConfig.weights_fetch": "set by a multi-host launch (None: one host)",
    "RolloutWorkerConfig.weights_group": "None: weights by file (the plan sets the group)",
    "RolloutWorkerConfig.reference_path": "None: no reference here (derived from kl_coef and "
                                          "reference.placement)",
    "RewardWorkerConfig.model_device": "derived by the plan from reward.device",
    "RewardWorkerConfig.model_dtype": "derived by the plan from reward.dtype",
    "TrainerWorkerConfig.checkpoint_dir": "derived from the run directory",
    "TrainerWorkerConfig.start_iteration": "derived from the resumed checkpoint",
    "TrainerWorkerConfig.resume_from": "derived from run.resume",
    "TrainerWorkerConfig.checkpoint_keep": "complete checkpoints kept",
    "TrainerWorkerConfig.weights_keep": "derived from run.max_staleness",
    "TrainerWorkerConfig.weights_serve": "set by a multi-host launch",
    "TrainerWorkerConfig.weights_group": "None: weights by file (the plan sets the group)",
}


def _inner(tp: typing.Any) -> typing.Any:
    """X of ``X | None``; ``tp`` otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _records() -> list[type]:
    """Every record class a worker process reads, reached from the role records' fields."""
    seen: list[type] = []
    todo = list(ROLE_RECORDS.values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = _inner(hints[f.name])
            if dataclasses.is_dataclass(tp) and not issubclass(tp, Checked):
                todo.append(tp)
    return seen


def _default(f: dataclasses.Field) -> typing.Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def test_every_record_is_walked():
    names = {cls.__name__ for cls in _records()}
    assert {"WorkerCommon", "WeightGroupConfig", "CoreShareConfig"} <= names


@pytest.mark.parametrize("cls", _records(), ids=lambda c: c.__name__)
def test_a_record_field_with_a_default_is_a_settings_object_or_the_workers_own(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue  # filled by the plan: the run config's default is the only one
        tp, name = _inner(hints[f.name]), f"{cls.__name__}.{f.name}"
        if isinstance(tp, type) and issubclass(tp, Checked):
            # a settings object: its class's defaults, never a record's own variant of them
            assert _default(f) in (None, tp()), f"{name}: defaults differ from {tp.__name__}'s"
        else:
            assert name in WORKER_INTERNAL, (
                f"{name} has a default of its own: take it from the plan (no default) or, if no "
                "YAML key sets it, list it in WORKER_INTERNAL")


def test_the_internal_list_names_no_yaml_key_and_no_stale_field():
    run_keys = set(section_keys(type(RunConfig().run)))
    role_keys = {role: set(section_keys(type(getattr(RunConfig(), role))))
                 for role in ROLE_RECORDS}
    section_of = {cls.__name__: role for role, cls in ROLE_RECORDS.items()}
    by_name = {cls.__name__: cls for cls in _records()}
    for name in WORKER_INTERNAL:
        owner, field = name.split(".")
        fields = {f.name: f for f in dataclasses.fields(by_name[owner])}
        assert field in fields and _default(fields[field]) is not dataclasses.MISSING, name
        keys = role_keys[section_of[owner]] if owner in section_of else set().union(
            run_keys, *role_keys.values())
        assert field not in keys, f"{name} is a YAML key: it must not have a default here"


def test_the_settings_objects_default_as_the_run_config_does():
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        for name, cls in embedded(type(value)).items():
            assert getattr(value, name) == cls(), f"{section.name}: embeds {cls.__name__} " \
                "with defaults of its own (the worker records would use the class's)"


# record (role, field) -> the YAML key the plan fills it from
FILLED = {
    ("rollout", "groups_per_claim"): "rollout.groups_per_claim",
    ("rollout", "engine"): "rollout.engine",
    ("reward", "rows_per_claim"): "reward.rows_per_claim",
    ("reference", "rows_per_claim"): "reference.rows_per_claim",
    ("trainer", "rows_per_claim"): "trainer.rows_per_claim",
    ("trainer", "engine"): "trainer.engine",
    ("trainer", "deterministic"): "trainer.deterministic",
    ("trainer", "zero_stage"): "trainer.zero_stage",
    ("trainer", "num_ranks"): "trainer.num_ranks",
    ("trainer", "checkpoint_every"): "run.checkpoint_every",
    ("trainer", "iterations"): "run.iterations",
    ("trainer", "group_size"): "data.group_size",
    ("rollout", "group_size"): "data.group_size",
}
CHANGED = ["reward.rows_per_claim=7", "reference.rows_per_claim=9", "trainer.rows_per_claim=5",
           "rollout.groups_per_claim=3", "trainer.deterministic=true", "trainer.zero_stage=1",
           "run.checkpoint_every=2", "run.iterations=4", "data.group_size=3", "run.seed=11",
           "rollout.threads=2", "reference.threads=3", "trainer.threads=4", "trainer.is_cap=3",
           "rollout.temperature=0.5", "trainer.packing=false", "trainer.lr=0.5"]


@pytest.mark.parametrize("overrides", [[], CHANGED], ids=["defaults", "changed"])
def test_the_plan_fills_each_record_from_its_yaml_key(overrides, tmp_path):
    cfg = load_config(None, overrides)
    plan = worker_plan(cfg, tmp_path)
    for (role, field), key in FILLED.items():
        section, name = key.split(".")
        assert getattr(getattr(plan, role), field) == getattr(getattr(cfg, section), name), key
    for role in ("rollout", "reference", "trainer"):
        assert getattr(plan, role).common.threads == getattr(cfg, role).threads
        assert getattr(plan, role).common.seed == cfg.run.seed
    t, r = plan.trainer, plan.rollout
    assert (t.optim, t.grpo, t.pack, t.sampling) == (
        cfg.trainer.optim, cfg.trainer.grpo.resolved(cfg.run.mode), cfg.trainer.pack,
        cfg.rollout.sampling)
    assert r.reference_pack == cfg.trainer.pack and plan.reward.verifier == cfg.reward.verifier


def test_the_stores_limits_are_declared_once_in_storage():
    shared = {f.name for f in dataclasses.fields(TableSpec)} & {
        f.name for f in dataclasses.fields(StoreSection)}
    assert shared == {"capacity_rows", "lease_seconds", "max_deliveries", "fsync"}
    for name in shared - {"fsync"}:  # (store.fsync: true = "always", false = "never")
        assert getattr(StoreSection(), name) == getattr(TableSpec, name), name
    plan = worker_plan(RunConfig(), Path("/nonexistent"))
    spec = plan.table_spec
    assert (spec.capacity_rows, spec.lease_seconds, spec.max_deliveries) == (
        TableSpec.capacity_rows, TableSpec.lease_seconds, TableSpec.max_deliveries)


def test_store_serve_flags_default_to_the_nodes_own_config(capsys):
    assert cli_main(["store", "serve", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == str(ServerConfig())


def test_the_builtin_model_size_is_declared_once():
    from streamflow.config.sections import TinyModelConfig
    from workers.models.spec import TinyModelSpec

    run_default = dataclasses.asdict(TinyModelConfig())
    spec_default = dataclasses.asdict(TinyModelSpec())
    assert run_default == {k: spec_default[k] for k in run_default}
