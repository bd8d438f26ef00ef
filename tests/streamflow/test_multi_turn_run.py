"""End to end: `streamflow run` of multi-turn trajectories (rollout.max_turns=2, the calculator)
through real processes in each mode: periodic gives sync's parameters, async finishes, and every
row whose first turn called a tool, and only those, goes through the environment's task (env.1).

The built-in character model seldom writes a plain-form call (its end marker ``=)``) by itself: a
hot sampling temperature, longer turns and more rows make a few calls per iteration (seeded: the
same ones every time), so the environment's answers are part of what periodic must reproduce.
Each call's answer itself is tests/workers/agent/test_turns.py's, with a scripted engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file
from testkit import no_children_left, wait_until

from streamflow.controller import run

ROOT = Path(__file__).resolve().parents[2]
TURNS = ("rollout.max_turns=2", "env.fn=calculator", "run.iterations=2", "run.eval_every=0",
         "rollout.groups_per_claim=1", "run.stall_timeout_s=60",
         # (a few tool calls per iteration; see the module docstring)
         "rollout.temperature=4", "rollout.max_new_tokens=12", "data.prompts_per_iteration=16",
         "data.group_size=4", "trainer.rows_per_claim=16")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _check_turn_run(cfg, iterations: int) -> dict:
    """The run finished, recorded the turn metrics, and each iteration's rows all went through
    rollout piece 0; env.1 (the environment's spans) and rollout.2 took exactly the rows that
    went on (the rest the store skips: ``TaskSpec.skip_null``), as many as ``turns_mean`` says
    (the calculator never ends a trajectory, and the budget leaves room)."""
    out = Path(cfg.run.output_dir)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == iterations, summary
    records = _lines(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert all(1.0 <= r["turns_mean"] <= 2.0 and r["tool_calls_mean"] >= 0.0 for r in records)
    rows = cfg.data.prompts_per_iteration * cfg.data.group_size
    spans = _lines(out / "timeline.jsonl")
    for k in range(iterations):
        env = sum(s["rows"] for s in spans if s["stage"] == "environment" and s["iteration"] == k)
        rollout = sum(s["rows"] for s in spans if s["stage"] == "rollout" and s["iteration"] == k)
        went_on = round((records[k]["turns_mean"] - 1.0) * rows)
        assert env == went_on and rollout == rows + went_on, (k, env, rollout, went_on)
    return summary


def _params(cfg) -> dict:
    step = cfg.run.iterations
    return load_file(str(Path(cfg.run.output_dir) / "checkpoints" / f"step-{step:06d}"
                         / "model.safetensors"))


@pytest.mark.slow
def test_multi_turn_periodic_equals_sync(tiny_config) -> None:
    sync = tiny_config("run.mode=sync", "run.name=sync", *TURNS)
    periodic = tiny_config("run.mode=periodic", "run.name=periodic", *TURNS,
                           f"run.output_dir={sync.run.output_dir}-periodic")
    run(sync)
    run(periodic)
    no_children_left()
    _check_turn_run(sync, 2)
    _check_turn_run(periodic, 2)
    turns = [[(r["turns_mean"], r["tool_calls_mean"]) for r in _lines(Path(c.run.output_dir)
                                                                      / "metrics.jsonl")]
             for c in (sync, periodic)]
    assert turns[0] == turns[1] and sum(calls for _, calls in turns[0]) > 0, turns
    assert (Path(periodic.run.output_dir) / "workers" / "environment-0.json").is_file()
    a, b = _params(sync), _params(periodic)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    from streamflow.plan import resolve_model  # guard: parameters that never moved prove nothing

    initial = load_file(str(resolve_model(sync, Path(sync.run.output_dir).parent / ".cache")
                            / "model.safetensors"))
    assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 1e-4, "no update"


@pytest.mark.slow
def test_multi_turn_async_finishes(tiny_config) -> None:
    cfg = tiny_config("run.mode=async", "run.max_staleness=1", *TURNS)
    summary = run(cfg)
    no_children_left()
    out = Path(cfg.run.output_dir)
    on_disk = json.loads((out / "summary.json").read_text())
    assert summary.status == on_disk["status"] == "ok" and on_disk["iterations"] == 2
    records = _lines(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["turns_mean"] >= 1.0 for r in records)
    assert sum(r["tool_calls_mean"] for r in records) > 0  # the environment answered calls
    assert on_disk["stage_busy_seconds"].get("environment", 0.0) > 0.0
    assert on_disk["dead_rows"] == 0


@pytest.mark.slow
def test_a_killed_environment_worker_is_restarted_and_the_run_finishes(model_cache, tmp_path):
    """The environment worker is SIGKILLed once it has answered an iteration's calls: the
    supervisor restarts it (the rule every stage worker has), the rows it held come back when
    their lease expires, and the run trains every iteration with nothing lost."""
    out = model_cache / f"{tmp_path.name}-env-restart"
    log = tmp_path / "run.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"),
             *TURNS, "run.mode=periodic", "run.iterations=4", "store.lease_seconds=2",
             f"run.output_dir={out}", "run.progress=false"],
            stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        try:
            def recorded() -> int:
                assert proc.poll() is None, log.read_text()[-3000:]
                metrics = out / "metrics.jsonl"
                return len(metrics.read_text().splitlines()) if metrics.exists() else 0

            def environment_worker() -> psutil.Process | None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if "/environment-0.json" in " ".join(child.cmdline()):
                            return child
                    except psutil.NoSuchProcess:
                        continue
                return None

            victim = wait_until(environment_worker, timeout=120, what="the environment worker")
            # polled without a pause: the kill must land while iterations with calls remain
            wait_until(lambda: recorded() >= 1, timeout=120, interval=0.0,
                       what="an iteration recorded")
            victim.kill()
            assert recorded() < 4, "the run ended before the kill: nothing was tested"
            assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 4, summary
    assert summary["worker_restarts"] == {"environment-0": 1}
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    assert [r["samples"] for r in _lines(out / "metrics.jsonl")] == [64] * 4
    assert "restart 1 of environment-0" in (out / "logs" / "environment-0.log").read_text()
