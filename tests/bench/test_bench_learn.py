"""``streamflow bench learn``: its figures from a run directory, and a shortened recipe that learns
(the demo's held-out accuracy gain, minutes per case, is the bench's: docs/learning.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.learn import ROOT, read_case, report


def _fake_run(path: Path, accuracies: list[float | None], walls: list[float],
              calls: list[float] | None = None) -> Path:
    path.mkdir(parents=True)
    summary = {"status": "ok", "error": None, "accuracy_before": 0.30,
               "accuracy_last": accuracies[-1], "reward_mean_first_window": 0.2,
               "reward_mean_last_window": 0.35, "wall_seconds": sum(walls)}
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"iteration": i, "accuracy": a, "wall_seconds": w}
                        | ({} if calls is None else {"tool_calls_mean": calls[i]}))
             for i, (a, w) in enumerate(zip(accuracies, walls, strict=True))]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_time_to_plus_0_10_counts_rl_seconds_to_the_first_evaluation_past_it(tmp_path):
    run = _fake_run(tmp_path / "a", [None, 0.35, None, 0.41, 0.38, 0.52], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    case = read_case(run, seed=3, threads=2, wall=99.0)
    assert case.seconds_to_plus_0_10 == pytest.approx(10.0)  # 0.41 >= 0.30 + 0.10 at iteration 3
    assert math.isclose(case.gain, 0.22)
    assert (case.seed, case.threads, case.rl_seconds) == (3, 2, 21.0)
    never = read_case(_fake_run(tmp_path / "b", [0.33, 0.39], [1.0, 1.0]), 0, 1, 5.0)
    assert never.seconds_to_plus_0_10 is None


def test_report_names_the_worst_case_and_whether_the_target_is_met(tmp_path):
    good = read_case(_fake_run(tmp_path / "g", [0.45], [1.0]), 0, 1, 1.0)
    weak = read_case(_fake_run(tmp_path / "w", [0.36], [1.0]), 1, 2, 1.0)
    out = report([good, weak])
    assert out["worst_accuracy_gain"] == pytest.approx(0.06)
    assert out["worst_case"] == {"seed": 1, "threads": 2}
    assert out["met"] is False
    assert report([good])["met"] is True
    assert set(out["cases"][0]) == {"seed", "threads", "accuracy_before", "accuracy_after",
                                    "reward_first_window", "reward_last_window", "rl_seconds",
                                    "seconds_to_plus_0_10", "tool_calls_per_trajectory",
                                    "reward_model_accuracy", "reward_model_epochs",
                                    "reward_model_cap_hit", "reward_hacking"}
    assert good.reward_hacking is False  # no iteration flagged it
    assert out["tool_calls_per_trajectory"] == 0.0  # single-turn runs record no tool calls
    assert out["reward_model_accuracy"] is None  # a verifier's recipe trains no reward model
    weak.reward_model_accuracy, good.reward_model_accuracy = 0.8, 0.9
    assert report([good, weak])["reward_model_accuracy"] == 0.8  # the worst seed's


def test_a_case_says_whether_any_iteration_flagged_reward_hacking(tmp_path):
    run = _fake_run(tmp_path / "h", [0.3, None, 0.1], [1.0] * 3)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[2]["reward_hacking"] = 1
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert read_case(run, 0, 1, 1.0).reward_hacking is True


def test_tool_calls_are_the_last_window_mean_and_can_fail_the_target(tmp_path):
    # 6 iterations: the window is min(10, 6 // 2) = 3, so the early iterations without calls
    # do not count
    run = _fake_run(tmp_path / "t", [None] * 5 + [0.5], [1.0] * 6,
                    calls=[0.0, 0.0, 0.0, 0.4, 0.8, 0.9])
    case = read_case(run, 0, 1, 1.0)
    assert case.tool_calls_per_trajectory == pytest.approx(0.7)
    few = read_case(_fake_run(tmp_path / "f", [0.5, 0.5], [1.0, 1.0], calls=[0.9, 0.2]), 1, 1, 1.0)
    assert few.tool_calls_per_trajectory == pytest.approx(0.2)
    out = report([case, few], target_gain=0.15, min_tool_calls=0.5)
    assert out["tool_calls_per_trajectory"] == pytest.approx(0.2)
    assert out["target"]["tool_calls_per_trajectory_at_least"] == 0.5
    assert out["met"] is False  # both gain 0.2 and raise their reward; one calls too little
    assert report([case], target_gain=0.15, min_tool_calls=0.5)["met"] is True
    assert report([case], target_gain=0.25)["met"] is False


def test_a_failed_run_is_an_error_not_a_figure(tmp_path):
    run = _fake_run(tmp_path / "f", [0.5], [1.0])
    summary = json.loads((run / "summary.json").read_text())
    summary.update(status="failed", error="WorkerFailed: boom")
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(RuntimeError, match="boom"):
        read_case(run, 0, 1, 1.0)


# the run's own bound is the subprocess timeout below; the test's outlasts it
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shortened_demo_recipe_raises_the_training_reward(tmp_path):
    # The suite's learning check: the demo's recipe (its model, warm start to the target, GRPO
    # settings, 128 prompts x 8 per iteration) on 1-digit addition, whose warm start reaches the
    # target in tens of steps, for 10 iterations in one process (sync equals the demo's periodic
    # on-policy mode). Its last 5 iterations' mean reward beats its first 5's by 0.027-0.039 on
    # seeds 0-2, about four times the windows' sampling noise (docs/learning.md). Held-out
    # accuracy needs the 2-digit recipe and 30 iterations (minutes): `streamflow bench learn`
    # measures it (docs/learning.md, "the shortened recipe").
    cmd = [sys.executable, "-m", "streamflow", "bench", "learn", "--json", "--seeds", "0",
           "--threads", "1", "--output", str(tmp_path),
           *(x for kv in ("data.digits=1", "run.mode=sync", "run.iterations=10",
                          "run.eval_every=10", "run.eval_prompts=14") for x in ("--set", kv))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (case,) = result["cases"]
    # The warm start reached its target before its step cap (with the earlier warm-start rate it
    # ran all its steps to a probe accuracy of 0.1 on AVX-512 hosts).
    (manifest,) = [json.loads(p.read_text())
                   for p in tmp_path.glob(".cache/builtin-*/streamflow_manifest.json")]
    recipe = manifest["recipe"]
    assert manifest["probe_accuracy"] >= recipe["target_accuracy"] > 0, manifest
    assert manifest["warmstart_steps_run"] < recipe["warmstart_steps"], manifest
    assert case["reward_last_window"] > case["reward_first_window"], case
    assert case["rl_seconds"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_the_agentic_recipe_reports_tool_calls_from_a_tiny_run(tmp_path):
    # The demo of tool use (configs/agentic.yaml) cut to a warm start of every example a
    # calculator tape, 2 iterations in one process (sync: the environment stage takes its turn
    # between the rollout's) and 20 held-out prompts evaluated before and after: too short to
    # learn (its learning is measured in docs/learning.md, minutes per case), long enough that
    # the model calls the calculator and the bench reads the calls and the multi-turn
    # evaluation back.
    cmd = [sys.executable, "-m", "streamflow", "bench", "learn", "--json", "--seeds", "0",
           "--threads", "1", "--output", str(tmp_path), "--config",
           str(ROOT / "configs" / "agentic.yaml"), "--target-gain", "0.15",
           "--min-tool-calls", "0.5",
           *(x for kv in ("model.warmstart_steps=60", "model.warmstart_tool_fraction=1",
                          "run.mode=sync", "run.iterations=2", "run.eval_every=2",
                          "run.eval_prompts=20",
                          "data.prompts_per_iteration=16") for x in ("--set", kv))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (case,) = result["cases"]
    records = [json.loads(x) for x in (tmp_path / "seed0-threads1" / "metrics.jsonl")
               .read_text().splitlines()]
    calls = [r["tool_calls_mean"] for r in records]
    assert case["tool_calls_per_trajectory"] == pytest.approx(calls[-1])  # window: 1 of 2
    assert case["tool_calls_per_trajectory"] > 0, records  # it did call the calculator
    assert result["tool_calls_per_trajectory"] == case["tool_calls_per_trajectory"]
    assert result["worst_accuracy_gain"] == pytest.approx(
        case["accuracy_after"] - case["accuracy_before"])
    assert result["target"]["tool_calls_per_trajectory_at_least"] == 0.5
    assert result["met"] == (case["accuracy_after"] - case["accuracy_before"] >= 0.15
                             and case["reward_last_window"] > case["reward_first_window"]
                             and case["tool_calls_per_trajectory"] >= 0.5)
