"""Partial rollout wired into a run, below the processes: rollout.partial's one-line errors
through the CLI, and what the plan makes of it (the table's resume tasks, the records)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit import worker_plan

from streamflow.cli import main
from streamflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize(("overrides", "needle"), [
    (["run.mode=periodic"], "rollout.partial: needs run.mode async (got 'periodic')"),
    (["run.mode=sync"], "rollout.partial: needs run.mode async (got 'sync')"),
    (["run.mode=async", "rollout.partial_max_cuts=0"], "rollout.partial_max_cuts: must be >= 1"),
])
def test_bad_partial_settings_are_one_line_exit_2(capsys, tmp_path, overrides, needle) -> None:
    # Breaks if a bad combination starts a run, or fails with a traceback or an unnamed key.
    code = main(["run", TINY, "rollout.partial=true", *overrides, f"run.output_dir={tmp_path}",
                 "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err, err


def test_the_plan_adds_the_continuation_tasks_and_carries_the_cuts(tmp_path) -> None:
    # Breaks if the table lacks rollout.1..R or the rollout/trainer records lose rollout.partial
    # (the trainer would not claim response_version_runs).
    cfg = load_config(TINY, ["run.mode=async", "rollout.partial=true",
                             "rollout.partial_max_cuts=2", f"run.output_dir={tmp_path}"])
    plan = worker_plan(cfg, tmp_path)
    tasks = [t.name for t in plan.table_spec.tasks]
    assert tasks[:3] == ["rollout", "rollout.1", "rollout.2"]
    assert "response_version_runs" in plan.table_spec.schema.names
    assert plan.rollout.cuts.partial and plan.rollout.partial_max_cuts == 2
    assert plan.trainer.cuts.partial
    off = worker_plan(load_config(TINY, ["run.mode=async", f"run.output_dir={tmp_path}"]),
                      tmp_path / "off")
    assert [t.name for t in off.table_spec.tasks if t.name.startswith("rollout.")] == []


def test_partial_rollout_of_multi_turn_trajectories_plans_both_sides_of_each_piece(tmp_path):
    # Breaks if the combination is refused again, or a worker record loses the cuts (the
    # environment and reward workers would read a table of the wrong number of pieces).
    cfg = load_config(TINY, ["run.mode=async", "rollout.partial=true", "rollout.max_turns=2",
                             "rollout.partial_max_cuts=1", "env.fn=calculator",
                             f"run.output_dir={tmp_path}"])
    plan = worker_plan(cfg, tmp_path)
    tasks = [t.name for t in plan.table_spec.tasks]
    assert tasks[:6] == ["rollout", "rollout.1", "env.1", "rollout.2", "env.2", "rollout.3"]
    assert plan.environment is not None and plan.environment.cuts.max_cuts == 1
    assert plan.reward.cuts.max_cuts == 1 and plan.rollout.cuts.max_cuts == 1
    assert main(["run", TINY, "run.mode=async", "rollout.partial=true", "rollout.max_turns=2",
                 "env.fn=calculator", f"run.output_dir={tmp_path / 'dry'}", "--dry-run"]) == 0
