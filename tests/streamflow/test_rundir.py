"""Run directory writers/readers, summary aggregation, plots and the progress display."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import time

import pytest

from streamflow.config import load_config
from streamflow.progress import ProgressDisplay, StepProgress, clock, eta_seconds
from streamflow.rundir import (
    BUILTIN_REWARD_RANGES,
    IterationRecord,
    RunDir,
    RunSummary,
    StageSpan,
    plot_rewards,
    plot_timeline,
    reward_band,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REQUIRED_SUMMARY_KEYS = {
    "mode",
    "iterations",
    "samples",
    "generated_tokens",
    "wall_seconds",
    "samples_per_second",
    "tokens_per_second",
    "reward_mean_first",
    "reward_mean_last",
    "accuracy_first",
    "accuracy_last",
    "max_staleness_observed",
    "weight_sync_seconds_total",
    "weight_sync_bytes_total",
}


def _records(n: int = 3) -> list[IterationRecord]:
    return [
        IterationRecord(
            iteration=i,
            policy_version=i + 1,
            reward_mean=0.1 * (i + 1),
            reward_std=0.05,
            accuracy=None if i == 1 else 0.2 * (i + 1),
            samples=32,
            generated_tokens=100 * (i + 1),
            loss=0.5,
            staleness_mean=0.5 * i,
            staleness_max=i,
            weight_sync_seconds=0.25,
            weight_sync_bytes=1000,
            wall_seconds=2.0,
            stage_busy_seconds={"rollout": 1.0, "trainer": 0.5},
        )
        for i in range(n)
    ]


def _spans() -> list[StageSpan]:
    spans = []
    for it in range(2):
        t = 100.0 + 10 * it
        spans += [
            StageSpan("rollout", "rollout-0", t, t + 4, it),
            StageSpan("reward", "reward-0", t + 1, t + 2, it),
            StageSpan("reference", "reference-0", t + 1.5, t + 3, it),
            StageSpan("trainer", "trainer-0", t + 2, t + 5, it),
            StageSpan("weight_sync", "trainer-0", t + 5, t + 5.5, it),
        ]
    return spans


def test_rundir_writes_config_metrics_summary(tmp_path):
    cfg = load_config(None, ["run.name=x", f"run.output_dir={tmp_path / 'run'}"])
    run_dir = RunDir(cfg.run.output_dir)
    assert run_dir.plots.is_dir() and run_dir.checkpoints.is_dir()
    assert load_config(run_dir.write_config(cfg)) == cfg

    records = _records()
    for rec in records:
        run_dir.append_metrics(rec)
    # Flushed per record: readable while the writer is still open.
    lines = run_dir.metrics_path.read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    assert run_dir.read_metrics() == records

    summary = RunSummary.from_records("periodic", records, wall_seconds=8.0, name="x")
    run_dir.write_summary(summary)
    run_dir.close()
    data = json.loads(run_dir.summary_path.read_text())
    assert REQUIRED_SUMMARY_KEYS <= set(data)
    assert run_dir.read_summary() == summary
    assert not [p for p in run_dir.path.iterdir() if ".tmp" in p.name]  # atomic: no leftovers


def test_summary_from_records():
    s = RunSummary.from_records("async", _records(), wall_seconds=4.0)
    assert s.iterations == 3 and s.samples == 96 and s.generated_tokens == 600
    assert s.samples_per_second == pytest.approx(24.0)
    assert s.tokens_per_second == pytest.approx(150.0)
    assert s.reward_mean_first == pytest.approx(0.1) and s.reward_mean_last == pytest.approx(0.3)
    # Accuracy skips iterations that were not evaluated.
    assert s.accuracy_first == pytest.approx(0.2) and s.accuracy_last == pytest.approx(0.6)
    assert s.max_staleness_observed == 2
    assert s.weight_sync_count == 3 and s.weight_sync_bytes_total == 3000
    assert s.weight_sync_seconds_total == pytest.approx(0.75)
    assert s.stage_busy_seconds == {"rollout": 3.0, "trainer": 1.5}
    assert s.final_policy_version == 3
    # Default wall time: the sum over iterations.
    assert RunSummary.from_records("sync", _records()).wall_seconds == pytest.approx(6.0)
    empty = RunSummary.from_records("sync", [])
    assert empty.samples == 0 and empty.reward_mean_first is None


def test_non_finite_values_become_null(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.append_metrics(IterationRecord(0, 1, reward_mean=0.0, loss=math.nan, kl=math.inf))
    run_dir.close()
    line = json.loads(run_dir.metrics_path.read_text())
    assert line["loss"] is None and line["kl"] is None


def test_readers_tolerate_unknown_keys_and_torn_last_line(tmp_path):
    run_dir = RunDir(tmp_path)
    good = {"iteration": 0, "policy_version": 1, "reward_mean": 0.5, "future_field": 7}
    run_dir.metrics_path.write_text(json.dumps(good) + "\n" + '{"iteration": 1, "poli')
    records = run_dir.read_metrics()
    assert len(records) == 1 and records[0].reward_mean == 0.5
    assert run_dir.read_summary() is None


def test_spans_round_trip(tmp_path):
    with RunDir(tmp_path) as run_dir:
        run_dir.append_spans(_spans()[:3])
        run_dir.append_spans(_spans()[3:])
        assert run_dir.read_spans() == _spans()


def _assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plots_are_written(tmp_path):
    _assert_png(plot_rewards(_records(), tmp_path / "r.png"))
    _assert_png(plot_timeline(_spans(), 1, tmp_path / "t.png"))
    _assert_png(plot_rewards(_records(1), tmp_path / "one.png"))  # a single point still plots
    with RunDir(tmp_path / "run") as run_dir:
        for rec in _records():
            run_dir.append_metrics(rec)
        run_dir.append_spans(_spans())
        paths = run_dir.write_plots()
    assert [p.name for p in paths] == ["rewards.png", "timeline.png"]
    for p in paths:
        _assert_png(p)


def test_plot_timeline_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="iterations present: \\[0, 1\\]"):
        plot_timeline(_spans(), 7, tmp_path / "t.png")
    with pytest.raises(ValueError, match="at least one span"):
        plot_timeline([], None, tmp_path / "t.png")


def test_progress_off_tty_logs_one_line_per_iteration(caplog):
    stream = io.StringIO()  # not a terminal: no live panel, even when enabled
    display = ProgressDisplay(total_iterations=3, mode="periodic", enabled=True, stream=stream)
    assert display.live_enabled is False
    with caplog.at_level(logging.INFO, logger="streamflow.progress"), display:
        display.set_queue_depths({"reward": 4})  # silent between iterations off a TTY
        display.start_loop(time.time() - 10.0)  # the loop began 10 s ago
        for rec in _records():
            rec.queue_depths = {"reward": 2, "trainer": 1}
            display.update(rec)
    lines = [r.getMessage() for r in caplog.records if r.name == "streamflow.progress"]
    assert len(lines) == 3
    # 10 s for 1 of 3 iterations: 20 s left at that pace
    assert lines[0].startswith("iter 1/3 v1 elapsed=0:00:10 eta=0:00:20 reward=0.100")
    assert "samples/s=16.0" in lines[2]  # 96 samples over 3 x 2 s of iteration time
    assert "acc=-" in lines[1] and "queues[reward=2 trainer=1]" in lines[2]
    assert stream.getvalue() == ""


def test_progress_live_panel_draws_on_a_terminal(monkeypatch):
    stream = io.StringIO()
    display = ProgressDisplay(total_iterations=3, mode="async", enabled=True, stream=stream)
    monkeypatch.setattr(display, "live_enabled", True)  # as if stderr were a TTY
    root = logging.getLogger()
    plain = logging.StreamHandler(sys.stderr)
    root.addHandler(plain)
    try:
        with display:
            assert plain not in root.handlers  # log lines go through the panel's console
            logging.getLogger("streamflow.test").warning("a worker said hello")
            for rec in _records():
                display.update(rec)
            display.set_queue_depths({"rollout": 5})
        assert plain in root.handlers  # restored afterwards
    finally:
        root.removeHandler(plain)
    out = stream.getvalue()
    assert "iteration 3/3" in out and "rollout=5" in out and "held-out accuracy" in out
    assert "a worker said hello" in out


def _panel_text(display) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=140, color_system=None).print(display._render())
    return buf.getvalue()


def test_panel_shows_phase_eta_windows_and_accuracy_before_rl():
    display = ProgressDisplay(total_iterations=40, mode="periodic", enabled=False)
    display.set_phase("starting workers: 2/5 ready")
    display.accuracy_before = 0.42
    text = _panel_text(display)
    assert "starting workers: 2/5 ready" in text and "before RL 0.420" in text
    display.start_loop(1000.0)
    # noisy single iterations; the windows (mean of 2 at each end of 4) are the figures
    for i, (reward, acc) in enumerate([(0.30, None), (0.10, 0.50), (0.35, None), (0.25, 0.55)]):
        display.update(IterationRecord(i, i + 1, reward_mean=reward, accuracy=acc,
                                       wall_seconds=2.0))
    assert display.elapsed_and_eta(now=1010.0) == (10.0, pytest.approx(90.0))  # 10 s per 4 its
    text = _panel_text(display)
    assert "mean of 2: first 0.200, last 0.300" in text
    # the latest evaluation next to the one "before RL" (not the first RL evaluation, 0.50)
    assert "0.550  (before RL 0.420)" in text and "ETA" in text


def test_eta_and_clock():
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(2, 10, 5.0) == pytest.approx(20.0)
    assert clock(None) == "-" and clock(3725.4) == "1:02:05"


def test_step_progress_off_a_terminal_logs_every_tenth_with_eta(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="streamflow.progress"):
        with StepProgress("warm start", enabled=True, stream=stream) as progress:
            for step in range(1, 101):
                progress(step, 100)
    lines = [r.getMessage() for r in caplog.records if r.name == "streamflow.progress"]
    assert len(lines) == 11  # step 1, then every 10 %
    assert lines[0].startswith("warm start 1/100 steps, elapsed") and "ETA" in lines[0]
    assert lines[-1].startswith("warm start 100/100 steps")
    assert stream.getvalue() == ""


def test_step_progress_draws_a_bar_on_a_terminal(monkeypatch):
    stream = io.StringIO()
    progress = StepProgress("warm start", enabled=True, stream=stream)
    monkeypatch.setattr(progress, "live_enabled", True)  # as if stderr were a TTY
    with progress:
        for step in range(1, 5):
            progress(step, 4)
    out = stream.getvalue()
    assert "warm start" in out and "4/4" in out and "ETA" in out and "elapsed" in out


def test_warm_start_reports_its_steps_through_prepare_builtin(tmp_path):
    from workers.models.local import TinyModelSpec
    from workers.models.warmstart import BuiltinRecipe, prepare_builtin

    seen: list[tuple[int, int]] = []
    recipe = BuiltinRecipe(spec=TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2,
                                              num_kv_heads=1, intermediate_size=32),
                           digits=2, operations=("+",), task_seed=0, warmstart_steps=3,
                           batch_size=2, lr=1e-3, seed=0, eval_size=2, target_accuracy=0.0,
                           tool_fraction=0.0)
    prepare_builtin(tmp_path / "m", recipe, progress=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    seen.clear()
    prepare_builtin(tmp_path / "m", recipe, progress=lambda s, t: seen.append((s, t)))
    assert seen == []  # cached: nothing to show


def test_describe_run_is_short_and_points_at_the_config():
    from streamflow.config import load_config
    from streamflow.progress import describe_run

    cfg = load_config(None, ["run.name=demo"])
    text = describe_run(cfg)
    assert len(text.splitlines()) == 2 and "{" not in text
    assert "run 'demo' -> runs/demo" in text and "runs/demo/config.yaml" in text


def test_reward_band_is_clipped_to_the_reward_range(tmp_path):
    records = [IterationRecord(0, 1, reward_mean=0.1, reward_std=0.3),
               IterationRecord(1, 2, reward_mean=0.9, reward_std=0.3)]
    low, high = reward_band(records, (0.0, 1.0))
    assert low == [0.0, pytest.approx(0.6)] and high == [pytest.approx(0.4), 1.0]
    assert reward_band(records, None)[0][0] == pytest.approx(-0.2)  # unknown range: as is
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_config(load_config(None, ["reward.fn=exact_match"]))
    assert run_dir.reward_range() == (0.0, 1.0)
    run_dir.write_config(load_config(None, ["reward.fn=mypkg.rewards:score"]))
    assert run_dir.reward_range() is None


def test_every_builtin_reward_has_a_declared_range():
    from workers.tasks.verifiers import available_rewards

    assert set(available_rewards()) <= set(BUILTIN_REWARD_RANGES)


def test_summary_reward_windows_average_first_and_last_iterations():
    from streamflow.rundir import IterationRecord, RunSummary

    records = [IterationRecord(iteration=i, policy_version=i + 1, reward_mean=float(i))
               for i in range(30)]
    s = RunSummary.from_records("periodic", records, wall_seconds=1.0)
    assert s.reward_window == 10
    assert s.reward_mean_first_window == 4.5 and s.reward_mean_last_window == 24.5
    short = RunSummary.from_records("periodic", records[:3], wall_seconds=1.0)
    assert short.reward_window == 1 and short.reward_mean_last_window == 2.0


@pytest.mark.parametrize("plots", [True, False])
def test_run_plots_decides_whether_the_end_of_a_run_draws_its_plots(tmp_path, plots):
    from streamflow.runstate import RunState

    assert load_config(None, [f"run.plots={str(plots).lower()}"]).run.plots is plots
    run_dir = RunDir(tmp_path / "run")
    state = RunState.begin(time.time(), run_dir, 0, None, (3, 0.1))
    for rec in _records(2):  # iterations 0 and 1, as the spans
        run_dir.append_metrics(rec)
        state.records.append(rec)
    run_dir.append_spans(_spans())
    summary = state.finish("sync", "t", "ok", None, None, plots=plots)
    assert summary.iterations == 2 and run_dir.summary_path.is_file()  # the summary either way
    drawn = sorted(p.name for p in run_dir.plots.glob("*.png"))
    assert drawn == (["rewards.png", "timeline.png"] if plots else [])
