"""``streamflow bench learn``: its figures from a run directory, and a shortened recipe that learns."""

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
@pytest.mark.timeout(1000)
def test_a_shortened_demo_recipe_raises_held_out_accuracy(tmp_path):
    # The demo's recipe (warm start to the target, then GRPO) cut to 30 iterations, on the demo's
    # 200 held-out prompts. Why 30: held-out accuracy can dip in the first iterations (seed 0 went
    # 0.37 -> 0.34 at iteration 4) and is 0.105-0.23 above its start by iteration 30 for seed 0 on
    # both CPU kernel sets measured (docs/learning.md); 8 iterations tested noise, not learning.
    # One thread: beside the rest of the suite a second OpenMP thread spin-waits on a core it does
    # not get (docs/learning.md: 517 s with 2 threads in a loaded suite, 116 s with 1 on a quiet
    # machine); the two thread counts learn alike.
    cmd = [sys.executable, "-m", "streamflow", "bench", "learn", "--json", "--seeds", "0",
           "--threads", "1", "--output", str(tmp_path),
           "--set", "run.iterations=30", "--set", "run.eval_every=10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (case,) = result["cases"]
    # The warm start reached its target before its step cap (with the earlier warm-start rate it
    # ran all 1500 steps to a probe accuracy of 0.1 on AVX-512 hosts) and landed in its band.
    (manifest,) = [json.loads(p.read_text())
                   for p in tmp_path.glob(".cache/builtin-*/streamflow_manifest.json")]
    recipe = manifest["recipe"]
    assert manifest["probe_accuracy"] >= recipe["target_accuracy"] > 0, manifest
    assert manifest["warmstart_steps_run"] < recipe["warmstart_steps"], manifest
    assert 0.2 <= case["accuracy_before"] < 0.8, case
    assert case["accuracy_after"] >= case["accuracy_before"] + 0.05, case
    assert case["reward_last_window"] > case["reward_first_window"], case
    assert case["rl_seconds"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_the_agentic_recipe_reports_tool_calls_from_a_tiny_run(tmp_path):
    # The demo of tool use (configs/agentic.yaml) cut to a warm start of every example a
    # calculator tape, 2 iterations and 40 held-out prompts: too short to learn (its learning is
    # measured in docs/learning.md, minutes per case), long enough that the model calls the
    # calculator and the bench reads the calls and the multi-turn evaluation back.
    cmd = [sys.executable, "-m", "streamflow", "bench", "learn", "--json", "--seeds", "0",
           "--threads", "1", "--output", str(tmp_path), "--config",
           str(ROOT / "configs" / "agentic.yaml"), "--target-gain", "0.15",
           "--min-tool-calls", "0.5",
           *(x for kv in ("model.warmstart_steps=60", "model.warmstart_tool_fraction=1",
                          "run.iterations=2", "run.eval_every=1", "run.eval_prompts=40",
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
