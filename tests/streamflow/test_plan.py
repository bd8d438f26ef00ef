"""From a run config to what runs: the worker records carry the config's settings objects whole,
and the plan puts its prompts as the one prompt-row builder lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.config import ConfigError
from streamflow.plan import build_plan
from workers.config import from_json, to_json


def test_worker_records_carry_the_configs_settings_objects(tiny_config, tmp_path: Path) -> None:
    cfg = tiny_config("trainer.lr=0.003", "rollout.temperature=0.7", "trainer.packing=false",
                      "rollout.vllm_dtype=float32", "reward.timeout_s=3")
    plan = build_plan(cfg, tmp_path / "run")
    plan.cleanup()
    t, r = cfg.trainer, cfg.rollout
    assert plan.trainer.optim is t.optim and plan.trainer.optim.lr == 0.003
    assert plan.trainer.grpo == t.grpo.resolved(cfg.run.mode) and plan.trainer.pack is t.pack and not t.pack.packing
    assert plan.trainer.sampling is r.sampling is plan.rollout.sampling
    assert plan.rollout.sampling.temperature == 0.7
    assert plan.rollout.vllm is r.vllm and plan.rollout.generate is r.generate
    assert plan.reward.verifier is cfg.reward.verifier and plan.reward.timeout_s == 3.0
    assert plan.reference is not None and plan.reference.pack is t.pack
    assert plan.reference.sampling is r.sampling
    for role in ("rollout", "reward", "reference", "trainer"):  # what the worker process reads
        record = getattr(plan, role)
        assert from_json(role, to_json(record)) == record


def test_kl_coef_reaches_the_trainer_only_in_the_loss_settings(tiny_config, tmp_path: Path) -> None:
    on = tiny_config("trainer.kl_coef=0.05", "reference.placement=trainer")
    plan = build_plan(on, tmp_path / "on")
    plan.cleanup()
    assert plan.trainer.grpo == on.trainer.grpo.resolved(on.run.mode)
    assert plan.trainer.kl_coef == 0.05
    assert plan.trainer.reference_path == str(plan.model_path) and plan.reference is None
    off = tiny_config("trainer.kl_coef=0")  # tiny.yaml: reference.placement worker
    plan = build_plan(off, tmp_path / "off")
    plan.cleanup()
    assert plan.trainer.grpo.kl_coef == 0.0
    assert plan.reference is None and plan.trainer.reference_path is None
    assert not plan.trainer.reference_in_store and plan.rollout.reference_path is None
    assert "reference" not in {t.name for t in plan.table_spec.tasks}


def test_prompt_rows_of_an_iteration(tiny_config, tmp_path: Path) -> None:
    plan = build_plan(tiny_config(), tmp_path / "run")
    plan.cleanup()
    g, n = plan.cfg.data.group_size, plan.cfg.data.prompts_per_iteration
    batch = plan.prompt_rows(3, staleness=1).to_pydict()
    assert batch["group_id"] == [3 * n + i for i in range(n) for _ in range(g)]
    assert batch["iteration"] == [3] * (n * g) and batch["min_policy_version"] == [2] * (n * g)
    problems = plan.problems(3)
    assert batch["prompt_ids"][::g] == [plan.encode(p.prompt) for p in problems]
    assert batch["answer"][::g] == [p.answer for p in problems]


def test_reference_num_workers_starts_that_many_reference_workers(tiny_config,
                                                                   tmp_path: Path) -> None:
    cfg = tiny_config("trainer.kl_coef=0.05", "reference.num_workers=3", "reward.num_workers=2")
    plan = build_plan(cfg, tmp_path / "run")
    plan.cleanup()
    workers = plan.workers(["tcp://127.0.0.1:1"], None, "tcp://127.0.0.1:2")
    refs = [(name, record) for name, role, record, _ in workers if role == "reference"]
    assert [name for name, _ in refs] == ["reference-0", "reference-1", "reference-2"]
    assert [r.common.name for _, r in refs] == ["reference-0", "reference-1", "reference-2"]
    assert all(r.common.coordinator_address == "tcp://127.0.0.1:2" for _, r in refs)
    assert [n for n, role, *_ in workers if role == "reward"] == ["reward-0", "reward-1"]
    one = build_plan(tiny_config("trainer.kl_coef=0.05"), tmp_path / "one")
    one.cleanup()
    assert [n for n, role, *_ in one.workers([], None) if role == "reference"] == ["reference-0"]


def test_placement_counts_every_reference_worker(tiny_config) -> None:
    nodes = ("placement.nodes=[{host: a, store_nodes: 1, rollout: 1, reward: 1, reference: %d, "
             "trainer: 1}]")
    cfg = tiny_config("trainer.kl_coef=0.05", "reference.num_workers=2", nodes % 2)
    assert sum(n.reference for n in cfg.placement.nodes) == 2
    with pytest.raises(ConfigError, match=r"places 1 reference .*reference.num_workers"):
        tiny_config("trainer.kl_coef=0.05", "reference.num_workers=2", nodes % 1)


def test_host_threads_auto_shares_this_hosts_cpus_unless_deterministic(
        tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' (the default) hands the streaming workers this host's CPUs by phase; a fixed count
    is kept; trainer.deterministic and 0 keep each role's own threads. Breaks if 'auto' stops
    being the default, or resolves to anything but the CPUs this process may use."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cases = {("trainer.deterministic=false",): 3,
             ("trainer.deterministic=false", "run.host_threads=2"): 2,
             ("trainer.deterministic=false", "run.host_threads=0"): 0,
             ("trainer.deterministic=true",): 0}
    for i, (overrides, budget) in enumerate(cases.items()):
        cfg = tiny_config("run.mode=periodic", *overrides)
        assert cfg.run.host_threads == ("auto" if len(overrides) == 1 else cfg.run.host_threads)
        plan = build_plan(cfg, tmp_path / f"run{i}")
        try:
            assert plan.host_threads == budget
            assert (plan.cores_path is not None) == (budget > 0)
            shares = {name: rec.common.cores for name, _, rec, _ in plan.workers(["tcp://x"], None)}
            for name, share in shares.items():
                if name.startswith(("trainer", "rollout")):
                    assert (share is not None and share.total_threads == budget) == (budget > 0)
        finally:
            plan.cleanup()
    with pytest.raises(ConfigError, match="run.host_threads"):
        tiny_config("run.host_threads=many")
