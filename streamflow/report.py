"""The run's own report: ``streamflow report RUN_DIR [RUN_DIR_B]`` and the end-of-run summary.

Reads a run directory back (finished, failed or still running), computes stage utilisation from
the timeline spans and renders one run or two side by side (docs/controller.md "The report").
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from streamflow.config import RewardSection
from streamflow.hacking import first_hacking
from streamflow.progress import fmt
from streamflow.rundir import IterationRecord, RunDir, RunSummary, StageSpan, stage_order


class ReportError(ValueError):
    """The path is not a readable run directory."""


@dataclass
class StageUsage:
    """How busy one stage was over the timeline window."""

    workers: int  # distinct workers that ran the stage
    busy_seconds: float  # sum over workers of the union of their busy intervals
    idle_seconds: float  # workers x window - busy
    utilisation: float  # busy / (workers x window), in [0, 1]


@dataclass
class RunData:
    path: Path
    name: str
    summary: RunSummary
    records: list[IterationRecord]
    spans: list[StageSpan]
    plots: list[Path]
    hacking: str | None = None  # the report's reward-hacking line (None: no evaluation to judge)


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, covered = 0.0, -math.inf  # sorted by start: add what lies past the covered end
    for start, end in sorted(intervals):
        total += max(end - max(start, covered), 0.0)
        covered = max(covered, end)
    return total


def stage_usage(spans: Sequence[StageSpan]) -> tuple[dict[str, StageUsage], float, float]:
    """Per-stage usage, the timeline window (seconds) and the seconds during which at least two
    different stages were busy at once (the overlap streaming buys)."""
    if not spans:
        return {}, 0.0, 0.0
    window = max(s.end for s in spans) - min(s.start for s in spans)
    usage: dict[str, StageUsage] = {}
    for stage in sorted({s.stage for s in spans}, key=lambda st: (stage_order(st), st)):
        by_worker: dict[str, list[tuple[float, float]]] = {}
        for s in spans:
            if s.stage == stage:
                by_worker.setdefault(s.worker, []).append((s.start, s.end))
        busy = sum(_union_length(iv) for iv in by_worker.values())
        capacity = len(by_worker) * window
        usage[stage] = StageUsage(len(by_worker), busy, max(capacity - busy, 0.0),
                                  busy / capacity if capacity > 0 else 0.0)
    # Sweep: +1/-1 per stage at span edges; overlap is where >= 2 stages have open spans.
    events = sorted([(s.start, 1, s.stage) for s in spans] + [(s.end, -1, s.stage) for s in spans])
    open_count: dict[str, int] = {}
    overlap, last_t = 0.0, events[0][0]
    for t, delta, stage in events:
        if sum(1 for n in open_count.values() if n > 0) >= 2:
            overlap += t - last_t
        open_count[stage] = open_count.get(stage, 0) + delta
        last_t = t
    return usage, window, overlap


def load_run(path: str | Path, *, make_plots: bool = True) -> RunData:
    """Read a run directory; regenerate missing plots when ``make_plots``."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"not a run directory: {path} does not exist")
    if not any((path / f).exists() for f in ("summary.json", "metrics.jsonl")):
        raise ReportError(f"not a run directory: {path} has neither summary.json nor metrics.jsonl")
    run_dir = RunDir(path)
    records, spans = run_dir.read_metrics(), run_dir.read_spans()
    config: dict[str, Any] = {}
    if run_dir.config_path.exists():
        config = yaml.safe_load(run_dir.config_path.read_text()) or {}
    run_section = config.get("run", {}) if isinstance(config, dict) else {}
    summary = run_dir.read_summary() or RunSummary.from_records(
        run_section.get("mode", "?"), records, status="incomplete")
    name = summary.name or run_section.get("name") or path.name
    plots = [run_dir.plots / "rewards.png", run_dir.plots / "timeline.png"]
    if make_plots and not all(p.exists() for p in plots[: 1 + bool(spans)]):
        run_dir.write_plots()
    reward = config.get("reward", {}) if isinstance(config, dict) else {}
    return RunData(path, name, summary, records, spans, [p for p in plots if p.exists()],
                   hacking_line(records, summary.accuracy_before, reward))


def hacking_line(records: Sequence[IterationRecord], accuracy_before: float | None,
                 reward: dict[str, Any]) -> str | None:
    """What the run's records say of reward hacking (``streamflow.hacking``): the first iteration
    flagged and what the rule compared there, "none detected", or None (nothing evaluated)."""
    if not any(r.accuracy is not None for r in records):
        return None
    flagged = [r.iteration for r in records if r.reward_hacking]
    if not flagged:
        return "none detected"
    declared = RewardSection()  # a config.yaml without the keys: their declared defaults
    window = int(reward.get("hacking_window", declared.hacking_window))
    drop = float(reward.get("hacking_drop", declared.hacking_drop))
    found = first_hacking(records, accuracy_before, window=window, drop=drop)
    detail = f": {found[1].describe()}" if found is not None else ""
    return (f"SUSPECTED from iteration {flagged[0] + 1} ({len(flagged)} of {len(records)} "
            f"iterations flagged){detail}")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _arrow(a: float | None, b: float | None) -> str:
    return f"{fmt(a)} → {fmt(b)}"


# (section, label, value getter for the ratio column or None, text)
Row = tuple[str, str, float | None, str]


def _rows(run: RunData) -> list[Row]:
    s = run.summary
    sync_share = s.weight_sync_seconds_total / s.wall_seconds if s.wall_seconds else 0.0
    per_sync = s.weight_sync_seconds_total / s.weight_sync_count if s.weight_sync_count else 0.0
    rows: list[Row] = [
        ("run", "mode / status", None,
         f"{s.mode} / {s.status}" + (f" ({s.stopped_by})" if s.stopped_by else "")),
        ("run", "iterations", None, str(s.iterations)),
        ("throughput", "samples", s.samples, str(s.samples)),
        ("throughput", "generated tokens", s.generated_tokens, str(s.generated_tokens)),
        ("throughput", "RL loop seconds (rates below)", s.wall_seconds, f"{s.wall_seconds:.2f}"),
        ("throughput", "samples/s", s.samples_per_second, f"{s.samples_per_second:.2f}"),
        ("throughput", "tokens/s", s.tokens_per_second, f"{s.tokens_per_second:.1f}"),
    ]
    if s.total_seconds:  # summaries written before start-up was recorded have neither
        rows += [
            ("time", "start-up s (model build, warm start, workers)", s.startup_seconds,
             f"{s.startup_seconds:.2f}"),
            ("time", "total s (start to summary)", s.total_seconds, f"{s.total_seconds:.2f}"),
        ]
    w = s.reward_window  # rewards over windows (one iteration is noisy), else the only value
    rows += [
        ("learning", f"reward, mean of first {w} → last {w} iterations", None,
         _arrow(s.reward_mean_first_window, s.reward_mean_last_window))
        if w and s.reward_mean_first_window is not None
        else ("learning", "reward (single iteration)", None, fmt(s.reward_mean_last)),
        ("learning", "held-out accuracy before RL → last", None,
         _arrow(s.accuracy_before, s.accuracy_last)),
        ("learning", "reward failures", s.reward_failures, str(s.reward_failures)),
    ]
    if run.hacking is not None:
        rows.append(("learning", "reward hacking (accuracy falls, reward rises)", None,
                     run.hacking))
    rows += [
        ("staleness", "mean / max observed", s.max_staleness_observed,
         f"{s.staleness_mean:.2f} / {s.max_staleness_observed}"),
        ("weight sync", "count", s.weight_sync_count, str(s.weight_sync_count)),
        ("weight sync", "total seconds (share of wall)", s.weight_sync_seconds_total,
         f"{s.weight_sync_seconds_total:.3f} ({sync_share:.1%})"),
        ("weight sync", "seconds per sync", per_sync or None, f"{per_sync:.3f}"),
        ("weight sync", "bytes total", s.weight_sync_bytes_total,
         _bytes(s.weight_sync_bytes_total)),
    ]
    usage, window, overlap = stage_usage(run.spans)
    if usage:  # utilisation is measured over the recorded timeline, not process start-up
        rows.append(("stages", "timeline window s", window, f"{window:.2f}"))
    for stage, u in usage.items():
        rows += [("stages", f"{stage} utilisation ({u.workers} worker{'s' * (u.workers > 1)})",
                  u.utilisation, f"{u.utilisation:.1%}"),
                 ("stages", f"{stage} busy / idle s", u.busy_seconds,
                  f"{u.busy_seconds:.2f} / {u.idle_seconds:.2f}")]
    if usage:
        share = overlap / window if window else 0.0
        rows.append(("stages", "≥2 stages busy at once", overlap, f"{overlap:.2f} s ({share:.1%})"))
    elif s.stage_busy_seconds:  # no timeline recorded: fall back to the summary's busy totals
        for stage, busy in s.stage_busy_seconds.items():
            rows.append(("stages", f"{stage} busy s", busy, f"{busy:.2f}"))
    return rows


def _render(build: Callable[[Console], None]) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system=None, force_terminal=False)
    build(console)
    return buf.getvalue()


def render_report(run_dir: str | Path) -> str:
    """The human-readable report of one run (tables as plain text, plus the plot paths)."""
    run = load_run(run_dir)

    def build(console: Console) -> None:
        console.print(f"StreamFlow run '{run.name}': {run.path}", soft_wrap=True)
        table = Table()
        table.add_column("section", style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        section = None
        for sec, label, _, text in _rows(run):
            if section is not None and sec != section:
                table.add_section()
            table.add_row(sec if sec != section else "", label, text)
            section = sec
        console.print(table)
        if run.summary.error:
            what = "stopped" if run.summary.status == "interrupted" else "error"
            console.print(f"{what}: {run.summary.error}", soft_wrap=True)
        for p in run.plots:
            console.print(f"plot: {p}", soft_wrap=True)

    return _render(build)


def render_comparison(run_a: str | Path, run_b: str | Path) -> str:
    """Two runs side by side, with B/A for every numeric metric (e.g. speedup in samples/s)."""
    a, b = load_run(run_a), load_run(run_b)
    rows_a = {(sec, label): (v, t) for sec, label, v, t in _rows(a)}
    rows_b = {(sec, label): (v, t) for sec, label, v, t in _rows(b)}
    keys = list(rows_a) + [k for k in rows_b if k not in rows_a]

    def build(console: Console) -> None:
        console.print(f"A = {a.name}: {a.path}", soft_wrap=True)
        console.print(f"B = {b.name}: {b.path}", soft_wrap=True)
        table = Table()
        for col, just in (("section", "left"), ("metric", "left"), ("A", "right"),
                          ("B", "right"), ("B/A", "right")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        section = None
        for sec, label in keys:
            va, ta = rows_a.get((sec, label), (None, "-"))
            vb, tb = rows_b.get((sec, label), (None, "-"))
            ratio = f"{vb / va:.2f}×" if va and vb is not None and va > 0 else ""
            if section is not None and sec != section:
                table.add_section()
            table.add_row(sec if sec != section else "", label, ta, tb, ratio)
            section = sec
        console.print(table)
        for run, tag in ((a, "A"), (b, "B")):
            for p in run.plots:
                console.print(f"plot {tag}: {p}", soft_wrap=True)

    return _render(build)
