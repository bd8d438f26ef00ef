"""The run report: stage utilisation from spans, one-run and two-run rendering, CLI."""

from __future__ import annotations

import pytest

from streamflow.cli import main
from streamflow.config import load_config
from streamflow.report import ReportError, load_run, render_comparison, render_report, stage_usage
from streamflow.rundir import IterationRecord, RunDir, RunSummary, StageSpan


def _make_run(path, *, mode="periodic", speed=1.0, summary=True, name=None):
    """A synthetic run: 3 iterations, rewards 0.2 -> 0.8, spans that overlap by a known amount."""
    cfg = load_config(None, [f"run.name={name or path.name}", f"run.mode={mode}"])
    records = [
        IterationRecord(
            iteration=i,
            policy_version=i + 1,
            reward_mean=[0.2, 0.5, 0.8][i],
            reward_std=0.1,
            accuracy=[0.3, None, 0.7][i],
            samples=64,
            generated_tokens=640,
            weight_sync_seconds=0.5,
            weight_sync_bytes=4 * 1024 * 1024,
            staleness_max=1 if mode == "async" else 0,
            staleness_mean=0.5 if mode == "async" else 0.0,
            wall_seconds=10.0 / speed,
        )
        for i in range(3)
    ]
    # Iteration 0 only: rollout [0, 6), reward [2, 4), trainer [3, 8) -> window 8 s.
    spans = [
        StageSpan("rollout", "rollout-0", 1000.0, 1006.0, 0),
        StageSpan("reward", "reward-0", 1002.0, 1004.0, 0),
        StageSpan("trainer", "trainer-0", 1003.0, 1008.0, 0),
    ]
    with RunDir(path) as run_dir:
        run_dir.write_config(cfg)
        for rec in records:
            run_dir.append_metrics(rec)
        run_dir.append_spans(spans)
        if summary:
            run_dir.write_summary(RunSummary.from_records(
                mode, records, name=cfg.run.name, accuracy_before=0.25, startup_seconds=12.5,
                total_seconds=44.0))
    return path


def test_stage_usage_exact():
    spans = [
        StageSpan("rollout", "rollout-0", 0.0, 6.0, 0),
        StageSpan("rollout", "rollout-1", 0.0, 2.0, 0),
        StageSpan("rollout", "rollout-1", 1.0, 3.0, 0),  # overlaps its own lane: counted once
        StageSpan("trainer", "trainer-0", 4.0, 8.0, 0),
    ]
    usage, window, overlap = stage_usage(spans)
    assert window == 8.0
    assert usage["rollout"].workers == 2
    assert usage["rollout"].busy_seconds == pytest.approx(9.0)  # 6 + union(0-2, 1-3) = 6 + 3
    assert usage["rollout"].idle_seconds == pytest.approx(7.0)  # 2 workers x 8 s - 9
    assert usage["rollout"].utilisation == pytest.approx(9 / 16)
    assert usage["trainer"].utilisation == pytest.approx(0.5)
    assert overlap == pytest.approx(2.0)  # rollout and trainer both busy in [4, 6)
    assert list(usage) == ["rollout", "trainer"]  # dataflow order, not alphabetical
    assert stage_usage([]) == ({}, 0.0, 0.0)


def test_render_report(tmp_path):
    run = _make_run(tmp_path / "a")
    text = render_report(run)
    assert "StreamFlow run 'a'" in text
    assert "0.200 → 0.800" in text  # reward, windows of 1 iteration at each end of 3
    # accuracy before RL (not the first RL evaluation, 0.300) -> the last evaluation
    assert "held-out accuracy before RL → last" in text and "0.250 → 0.700" in text
    assert "start-up s" in text and "12.50" in text and "44.00" in text  # start-up apart
    assert "6.40" in text  # samples/s = 192 / 30 s
    assert "timeline window s" in text and "8.00" in text
    assert "75.0%" in text  # rollout busy 6 of 8 s
    assert "25.0%" in text  # reward busy 2 of 8 s
    assert "62.5%" in text  # trainer busy 5 of 8 s
    assert "4.00 s (50.0%)" in text  # >= 2 stages busy during [2, 6)
    assert "12.0 MiB" in text  # weight-sync bytes
    assert str(run / "plots" / "rewards.png") in text
    assert str(run / "plots" / "timeline.png") in text


def test_report_regenerates_missing_plots(tmp_path):
    run = _make_run(tmp_path / "a")
    plots = [run / "plots" / "rewards.png", run / "plots" / "timeline.png"]
    assert not any(p.exists() for p in plots)
    render_report(run)
    assert all(p.exists() and p.stat().st_size > 0 for p in plots)


def test_report_without_summary_recomputes_it(tmp_path):
    run = _make_run(tmp_path / "a", mode="async", summary=False)
    data = load_run(run, make_plots=False)
    assert data.summary.status == "incomplete" and data.summary.mode == "async"
    assert data.summary.samples == 192
    assert "async / incomplete" in render_report(run)


def test_report_rejects_non_run_dirs(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        render_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="neither summary.json nor metrics.jsonl"):
        render_report(tmp_path / "empty")
    assert not (tmp_path / "nope").exists()  # reading never creates directories


def test_render_comparison(tmp_path):
    a = _make_run(tmp_path / "sync_run", mode="sync")
    b = _make_run(tmp_path / "async_run", mode="async", speed=2.0)
    text = render_comparison(a, b)
    assert "A = sync_run" in text and "B = async_run" in text
    assert "sync / ok" in text and "async / ok" in text
    samples_row = next(line for line in text.splitlines() if "samples/s" in line)
    assert "6.40" in samples_row and "12.80" in samples_row and "2.00×" in samples_row
    assert "plot A:" in text and "plot B:" in text


def test_cli_report(tmp_path, capsys):
    a = _make_run(tmp_path / "a")
    b = _make_run(tmp_path / "b", speed=4.0)
    assert main(["report", str(a)]) == 0
    assert "0.200 → 0.800" in capsys.readouterr().out
    assert main(["report", str(a), str(b)]) == 0
    assert "4.00×" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not a run directory") and err.count("\n") == 1


def test_report_of_a_failed_run_shows_the_error(tmp_path):
    run = _make_run(tmp_path / "a", summary=False)
    records = RunDir(run).read_metrics()
    failed = RunSummary.from_records(
        "periodic", records, status="failed", error="reward-0 exited with status 1"
    )
    RunDir(run).write_summary(failed)
    text = render_report(run)
    assert "periodic / failed" in text
    assert "error: reward-0 exited with status 1" in text


def test_report_compares_reward_windows_not_single_noisy_iterations(tmp_path):
    """Rising windows with a lucky first and an unlucky last iteration: the report must not say
    the run got worse."""
    rewards = [0.40] + [0.20] * 9 + [0.30] * 9 + [0.10]
    records = [IterationRecord(iteration=i, policy_version=i + 1, reward_mean=r, samples=8,
                               wall_seconds=1.0) for i, r in enumerate(rewards)]
    with RunDir(tmp_path / "run") as run_dir:
        run_dir.write_config(load_config(None, ["run.name=noisy"]))
        for rec in records:
            run_dir.append_metrics(rec)
        run_dir.write_summary(RunSummary.from_records("periodic", records))
    text = render_report(tmp_path / "run")
    row = next(line for line in text.splitlines() if "reward, mean of" in line)
    assert "first 10 → last 10 iterations" in row and "0.220 → 0.280" in row
    assert "0.400 → 0.100" not in text


def test_report_of_an_interrupted_run_names_the_signal(tmp_path):
    run = _make_run(tmp_path / "a", summary=False)
    records = RunDir(run).read_metrics()
    RunDir(run).write_summary(RunSummary.from_records(
        "periodic", records, status="interrupted", error="interrupted by SIGINT",
        stopped_by="SIGINT"))
    text = render_report(run)
    assert "periodic / interrupted (SIGINT)" in text
    assert "stopped: interrupted by SIGINT" in text and "error:" not in text
