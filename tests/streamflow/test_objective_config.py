"""The objective's keys (trainer.loss, trainer.advantage, clip bounds, importance_correction,
overlong shaping): defaults per loss, the former boolean switch, auto by run.mode, and bad input
as a one-line error naming the key at ``streamflow run --dry-run`` (exit 2)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit import worker_plan

from streamflow.cli import main
from streamflow.config import load_config
from workers.rl.objectives import Objective, loss_sums
from workers.roles.trainer import Trainer
from workers.settings import GrpoSettings

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _trainer_objective(tmp_path: Path, *overrides: str) -> Objective:
    """The objective a trainer built from ``configs/tiny.yaml`` + ``overrides`` steps with (the
    real Trainer constructor over the plan's trainer record; no model, store or engine)."""
    plan = worker_plan(load_config(TINY, [f"run.output_dir={tmp_path}", *overrides]), tmp_path)
    return Trainer(None, "t", None, None, plan.trainer, None, keeper=None).objective


def _clipped(obj: Objective, ratio: float) -> str | None:
    """Where ``obj`` clips one token (one response for gspo) at ``ratio``: "low", "high", or None.
    The advantage's sign is the one whose term the bound caps (+ above 1, - below)."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = old + math.log(ratio)
    adv = torch.tensor([1.0 if ratio > 1 else -1.0], dtype=torch.float64)
    _, sums = loss_sums(obj, logp, old, adv, torch.ones(1, 1, dtype=torch.float64),
                        ref_logp=logp, behaviour_logp=old)  # on-policy: a weight of 1
    assert sums.clipped_low + sums.clipped_high <= 1
    return "low" if sums.clipped_low else "high" if sums.clipped_high else None


# (overrides, {ratio: where the trainer's objective clips it}) with clip_eps at its default 0.2
CLIPS = [
    (["trainer.loss=grpo"], {1.25: "high", 1.15: None, 0.75: "low", 0.85: None}),
    (["trainer.loss=dr_grpo", "trainer.clip_eps=0.1"], {1.15: "high", 1.05: None, 0.85: "low"}),
    # clip-higher: a token at 1.25 keeps its gradient, the lower bound stays at clip_eps
    (["trainer.loss=dapo"], {1.25: None, 1.3: "high", 0.75: "low", 0.85: None}),
    # a sequence ratio moves far less than a token's: its bounds are 1 - 3e-4 and 1 + 4e-4
    (["trainer.loss=gspo"], {1.0005: "high", 1.00035: None, 0.9996: "low", 0.99975: None}),
    # no lower bound: a weight that only caps a token's step never clips a small ratio
    (["trainer.loss=cispo"], {1e-3: None, 0.5: None, 1.25: "high", 1.15: None}),
    # explicit keys win over the loss's paper values
    (["trainer.loss=dapo", "trainer.clip_eps_high=0.3", "trainer.clip_eps_low=0.1"],
     {1.29: None, 1.31: "high", 0.85: "low", 0.95: None}),
]


@pytest.mark.parametrize(("overrides", "clips"), CLIPS, ids=[" ".join(o) for o, _ in CLIPS])
def test_the_trainer_clips_ratios_at_each_losss_paper_bounds_unless_set(
    tmp_path: Path, overrides: list[str], clips: dict[float, str | None]
) -> None:
    """Broken by a wrong paper value for a loss, swapped low/high bounds, a key that no longer
    overrides, or a trainer that builds its objective from anything but the configured bounds."""
    obj = _trainer_objective(tmp_path, *overrides)
    assert {ratio: _clipped(obj, ratio) for ratio in clips} == clips


def test_importance_correction_auto_is_tis_in_async_only_and_the_old_switch_loads() -> None:
    for mode, want in (("async", "tis"), ("periodic", "off"), ("sync", "off")):
        cfg = load_config(TINY, [f"run.mode={mode}"])
        assert cfg.trainer.grpo.resolved(mode).correction == want, mode
    assert load_config(TINY, ["trainer.importance_correction=true"]).trainer.importance_correction \
        == "tis"
    assert load_config(TINY, ["trainer.importance_correction=false"]).trainer.grpo.correction \
        == "off"
    kept = load_config(TINY, ["run.mode=async", "trainer.importance_correction=decoupled"])
    assert kept.trainer.grpo.resolved("async").correction == "decoupled"
    assert GrpoSettings(loss="dapo").overlong_tokens(20) == 4  # a fifth of the budget
    assert GrpoSettings().overlong_tokens(20) == 0 and GrpoSettings(
        overlong_buffer=3).overlong_tokens(20) == 3


@pytest.mark.parametrize(("override", "needle"), [
    (["trainer.loss=ppo"], "trainer.loss: must be one of 'grpo', 'dr_grpo', 'dapo', 'gspo'"),
    (["trainer.advantage=gae"], "trainer.advantage: must be one of 'grpo', 'rloo'"),
    (["trainer.importance_correction=maybe"], "trainer.importance_correction: must be one of"),
    (["trainer.clip_eps_low=1.5"], "trainer.clip_eps_low: must be > 0 and <= 1, got 1.5"),
    (["trainer.clip_eps_high=0"], "trainer.clip_eps_high: must be > 0"),
    (["trainer.loss=dr_grpo", "trainer.advantage=reinforce_pp"],
     "trainer.advantage: 'reinforce_pp' divides advantages by the batch's reward std"),
    (["trainer.overlong_buffer=999"], "trainer.overlong_buffer: 999 is longer than the "
                                      "generation budget"),
    (["run.mode=async", "rollout.top_p=0.9"], "rollout.top_p: 0.9 < 1 with "
                                              "trainer.importance_correction 'tis'"),
])
def test_bad_objective_settings_are_one_line_errors_at_dry_run(capsys, override, needle) -> None:
    assert main(["run", TINY, *override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_top_p_below_one_is_fine_without_a_correction(capsys) -> None:
    assert main(["run", TINY, "run.mode=async", "rollout.top_p=0.9",
                 "trainer.importance_correction=off", "--dry-run"]) == 0
    assert main(["run", TINY, "run.mode=periodic", "rollout.top_p=0.9", "--dry-run"]) == 0
