"""``streamflow bench learn``: its figures from a run directory, and a shortened recipe that learns."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.learn import ROOT, read_case, report


def _fake_run(path: Path, accuracies: list[float | None], walls: list[float]) -> Path:
    path.mkdir(parents=True)
    summary = {"status": "ok", "error": None, "accuracy_before": 0.30,
               "accuracy_last": accuracies[-1], "reward_mean_first_window": 0.2,
               "reward_mean_last_window": 0.35, "wall_seconds": sum(walls)}
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"iteration": i, "accuracy": a, "wall_seconds": w})
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
                                    "seconds_to_plus_0_10"}


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
    cmd = [sys.executable, "-m", "streamflow", "bench", "learn", "--json", "--seeds", "0",
           "--threads", "2", "--output", str(tmp_path),
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
