"""The objective's keys (trainer.loss, trainer.advantage, clip bounds, importance_correction,
overlong shaping): defaults per loss, the former boolean switch, auto by run.mode, and bad input
as a one-line error naming the key at ``streamflow run --dry-run`` (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.cli import main
from streamflow.config import load_config
from workers.settings import GrpoSettings

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_clip_bounds_default_to_each_papers_and_explicit_ones_win() -> None:
    assert GrpoSettings().clip_bounds() == (0.2, 0.2)
    assert GrpoSettings(clip_eps=0.1, loss="dr_grpo").clip_bounds() == (0.1, 0.1)
    assert GrpoSettings(loss="dapo").clip_bounds() == (0.2, 0.28)
    assert GrpoSettings(loss="gspo").clip_bounds() == (3e-4, 4e-4)
    assert GrpoSettings(loss="cispo").clip_bounds() == (1.0, 0.2)
    assert GrpoSettings(loss="dapo", clip_eps_high=0.3, clip_eps_low=0.1).clip_bounds() == (0.1,
                                                                                          0.3)


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
