"""Reward hacking during a run: the rule (streamflow.hacking) on collapsing and healthy traces,
and where it shows: each record's reward_hacking in metrics.jsonl, the Prometheus gauge, the live
panel's warning and the report's line."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from streamflow.config import load_config
from streamflow.hacking import BEFORE_RL, detect, detect_records, first_hacking
from streamflow.metrics import ControllerMetrics
from streamflow.progress import HACKING_WARNING, ProgressDisplay
from streamflow.report import render_report
from streamflow.rundir import IterationRecord, RunDir, RunSummary
from streamflow.runstate import RunState
from workers.runtime.events import StepReport

# The collapse: GRPO on a weak reward model's score, evaluated every 5 iterations; the
# model's reward climbs while held-out exact match falls from 0.31 to 0.055.
COLLAPSE_ACC = [0.31, 0.30, 0.29, 0.25, 0.22, 0.18, 0.15, 0.12, 0.10, 0.08, 0.07, 0.06, 0.055]
# A healthy run (docs/learning.md, seed 0): accuracy rises with the reward, and swings by 0.11
# between two evaluations near its end (0.495 at iteration 44, 0.385 at 54) without a collapse.
HEALTHY_ACC = [0.32, 0.35, 0.36, 0.40, 0.42, 0.45, 0.47, 0.44, 0.495, 0.45, 0.385, 0.44, 0.44]


def _rising_rewards(n: int = 60, start: float = 0.3, end: float = 0.55) -> dict[int, float]:
    return {i: start + (end - start) * i / (n - 1) for i in range(n)}


def _evaluations(accuracies: list[float]) -> list[tuple[int, float]]:
    """Before RL, then after iterations 4, 9, ... (every 5) and the last one, 59."""
    return [(BEFORE_RL, accuracies[0])] + [(min(5 * k - 1, 59), a)
                                           for k, a in enumerate(accuracies[1:], 1)]


def test_the_rule_fires_on_a_collapse_and_stays_silent_on_a_healthy_run():
    rewards = _rising_rewards()
    found = detect(_evaluations(COLLAPSE_ACC), rewards, window=3, drop=0.1)
    assert found is not None and found.best_span == (BEFORE_RL, 9)  # the first three evaluations
    assert found.accuracy < found.best_accuracy - 0.1 and found.reward > found.best_reward
    assert "held-out accuracy 0.300 -> 0.062" in found.describe()
    # the healthy run's rewards rise just as much: its accuracy windows never fall by 0.1
    for end in range(1, len(HEALTHY_ACC) + 1):
        assert detect(_evaluations(HEALTHY_ACC[:end]), rewards, window=3, drop=0.1) is None
    # the collapse's accuracy with a falling reward is a run that broke, not one that hacks
    falling = {i: 0.55 - r + 0.3 for i, r in rewards.items()}
    assert detect(_evaluations(COLLAPSE_ACC), falling, window=3, drop=0.1) is None



def test_the_rule_holds_through_a_measured_collapse_once_the_reward_levels_off():
    # the seed 2, measured (docs/rewards.md "Reward hacking"): the weak reward model's
    # reward rose within the first 10 iterations, then stayed level while accuracy kept falling;
    # here each evaluation's span of 5 iterations has its measured mean reward
    accuracies = [0.31, 0.21, 0.13, 0.115, 0.085, 0.08, 0.095, 0.085, 0.055, 0.055, 0.055, 0.07,
                  0.055]
    span_rewards = [0.344, 0.38, 0.367, 0.36, 0.37, 0.353, 0.343, 0.384, 0.376, 0.367, 0.366,
                    0.356]
    rewards = {i: span_rewards[i // 5] for i in range(60)}
    evals = _evaluations(accuracies)
    fired = [detect(evals[:end], rewards, window=3, drop=0.1) is not None
             for end in range(4, len(evals) + 1)]
    assert fired == [False] + [True] * 9  # from the evaluation at the report's iteration 20 on
    # the best window's mean reward (0.362) instead of its starting one (0.344) would lose it
    # whenever the reward dipped below that mean (at iterations 29 and 34, and at the end)
    assert detect(evals, rewards, window=3, drop=0.1).best_reward == pytest.approx(0.344)

def test_the_rule_compares_window_means_from_the_first_window_that_can_hold():
    # windows of 2: (before, 4) acc 0.5 reward 0.2; (4, 9) 0.475, 0.3; (9, 14) 0.4, 0.4
    evals = [(BEFORE_RL, 0.5), (4, 0.5), (9, 0.45), (14, 0.35)]
    rewards = {i: 0.2 if i < 5 else 0.3 if i < 10 else 0.4 for i in range(15)}
    assert detect(evals[:3], rewards, window=2, drop=0.1) is None  # 0.025 below the best
    found = detect(evals, rewards, window=2, drop=0.1)  # 0.1 below it (to float rounding)
    assert found is not None and (found.best_span, found.span) == ((BEFORE_RL, 4), (9, 14))
    assert (found.best_reward, found.reward) == pytest.approx((0.2, 0.4))
    assert detect(evals, rewards, window=2, drop=0.11) is None
    assert detect(evals, rewards, window=4, drop=0.1) is None  # one window: nothing earlier


def _records(accuracies: list[float]) -> list[IterationRecord]:
    rewards = _rising_rewards()
    evaluated = dict(_evaluations(accuracies)[1:])
    return [IterationRecord(i, i + 1, reward_mean=rewards[i], accuracy=evaluated.get(i),
                            wall_seconds=1.0) for i in range(60)]


def test_first_hacking_over_records_names_the_evaluation_it_fired_at():
    first = first_hacking(_records(COLLAPSE_ACC), COLLAPSE_ACC[0], window=3, drop=0.1)
    assert first is not None and first[0] == 29  # windows (before..9) 0.300 vs (19..29) 0.183
    assert first_hacking(_records(HEALTHY_ACC), HEALTHY_ACC[0], window=3, drop=0.1) is None
    # without the starting policy's evaluation the windows begin at iteration 4
    assert detect_records(_records(COLLAPSE_ACC), None, window=3, drop=0.1) is not None


def _step(k: int, reward: float) -> StepReport:
    return StepReport(iteration=k, policy_version=k + 1, samples=8, response_tokens=20, loss=0.1,
                      kl=0.0, clip_fraction=0.0, grad_norm=1.0, reward_mean=reward,
                      reward_std=0.1, reward_failures=0, staleness_mean=0.0, staleness_max=0,
                      importance_weight_mean=1.0, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0,
                      step_seconds=1.0, publish_seconds=0.0, publish_bytes=0, busy_seconds=1.0)


def test_the_flag_reaches_metrics_jsonl_the_gauge_the_panel_and_the_report(tmp_path, caplog):
    cfg = load_config(None, ["run.name=hack", "run.iterations=60", "reward.hacking_window=3",
                             "reward.hacking_drop=0.1"])
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_config(cfg)
    state = RunState.begin(time.time(), run_dir, 0, None,
                           (cfg.reward.hacking_window, cfg.reward.hacking_drop))
    state.accuracy_before = COLLAPSE_ACC[0]
    gauge = ControllerMetrics("periodic", 60)
    display = ProgressDisplay(60, "periodic", enabled=False)
    rewards, evaluated = _rising_rewards(), dict(_evaluations(COLLAPSE_ACC)[1:])
    for k in range(60):
        record = state.record(_step(k, rewards[k]), evaluated.get(k), False, 60)
        gauge.on_record(record)
        display.update(record)
        if k == 28:  # the evaluation before the one the rule fires at
            assert gauge.registry.get_sample_value("streamflow_run_reward_hacking_ratio") == 0
    state.finish("periodic", "hack", "ok", None, None, plots=False)
    flags = [json.loads(line)["reward_hacking"]
             for line in run_dir.metrics_path.read_text().splitlines()]
    assert flags == [0] * 29 + [1] * 31
    assert gauge.registry.get_sample_value("streamflow_run_reward_hacking_ratio") == 1
    # one warning when it starts, not one per iteration; the panel says it while it holds
    warnings = [r.getMessage() for r in caplog.records if HACKING_WARNING in r.getMessage()]
    assert warnings == [f"iteration 30: {HACKING_WARNING}"]
    buf = io.StringIO()
    Console(file=buf, width=300, color_system=None).print(display._render())
    assert "reward hacking" in buf.getvalue()
    text = render_report(tmp_path / "run")
    row = next(line for line in text.splitlines() if "reward hacking" in line)
    assert "SUSPECTED from iteration 30 (31 of 60" in row


def test_a_healthy_run_reports_none_detected(tmp_path):
    records = _records(HEALTHY_ACC)
    with RunDir(tmp_path / "run") as run_dir:
        run_dir.write_config(load_config(None, ["run.name=healthy"]))
        for rec in records:
            run_dir.append_metrics(rec)
        run_dir.write_summary(RunSummary.from_records("periodic", records,
                                                      accuracy_before=HEALTHY_ACC[0]))
    row = next(line for line in render_report(tmp_path / "run").splitlines()
               if "reward hacking" in line)
    assert "none detected" in row
