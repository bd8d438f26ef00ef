"""Live progress of a run: a rich panel on a terminal, one log line per iteration elsewhere.

Owns ``describe_run``, ``StepProgress`` (a bar for a counted phase) and ``ProgressDisplay`` (the
controller's panel). It only displays: an exception while drawing is logged, never raised.
Lifecycle and what is shown: docs/controller.md "Live progress".
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress_bar import ProgressBar
from rich.table import Table

from streamflow.config import RunConfig
from streamflow.rundir import IterationRecord, reward_window

log = logging.getLogger("streamflow.progress")


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def clock(seconds: float | None) -> str:
    """0:01:05 style; '-' when unknown."""
    if seconds is None:
        return "-"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def eta_seconds(done: int, total: int, elapsed: float) -> float | None:
    """Time left at the mean pace so far (None before the first unit is done)."""
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed / done * max(total - done, 0)


def describe_run(cfg: RunConfig) -> str:
    """What the run is about to do, in two lines (the terminal's first output)."""
    d, r = cfg.data, cfg.run
    if cfg.model.path:
        model = f"model {cfg.model.path}"
    else:
        b = cfg.model.builtin
        model = (f"built-in model ({b.num_layers} layers × {b.hidden_size}, warm start "
                 f"{cfg.model.warmstart_steps} steps, cached under "
                 f"{Path(r.output_dir).parent}/.cache)")
    task = {"arithmetic": "arithmetic", "file": f"prompts from {d.file}",
            "hub": f"prompts from {cfg.env.hub}"}[d.task]
    mode = r.mode + (f" (max_staleness {r.max_staleness})" if r.mode == "async" else "")
    return (f"streamflow: run '{r.name}' -> {r.output_dir} (resolved config: "
            f"{r.output_dir}/config.yaml)\n"
            f"  {mode}, {r.iterations} iterations × {d.prompts_per_iteration} prompts × "
            f"{d.group_size} samples, {task}, reward {cfg.reward.fn}, {model}")


class StepProgress:
    """A bar with elapsed time and ETA for one counted phase (``p(step, total)``), on stderr when
    it is a terminal; elsewhere one INFO line per 10 %. Shown only once it is called."""

    def __init__(self, label: str, *, enabled: bool, stream: IO[str] | None = None) -> None:
        self.label = label
        self.console = Console(file=stream, stderr=stream is None)
        self.live_enabled = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._started: float | None = None
        self._logged_tenth = 0

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __call__(self, step: int, total: int) -> None:
        try:
            self._started = self._started or time.monotonic()
            if self.live_enabled:
                if self._progress is None:
                    self._progress = Progress(
                        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(), console=self.console, transient=False)
                    self._progress.start()
                    self._task = self._progress.add_task(self.label, total=total)
                self._progress.update(self._task, completed=step, total=total)
                return
            tenth = step * 10 // max(total, 1)
            if tenth > self._logged_tenth or step == 1:
                self._logged_tenth = max(tenth, self._logged_tenth)
                elapsed = time.monotonic() - self._started
                log.info("%s %d/%d steps, elapsed %s, ETA %s", self.label, step, total,
                         clock(elapsed), clock(eta_seconds(step, total, elapsed)))
        except Exception:  # a display glitch must never stop the work
            log.exception("progress display failed")


def format_depths(depths: Mapping[str, int]) -> str:
    return " ".join(f"{task}={n}" for task, n in depths.items()) or "-"


def format_line(record: IterationRecord, total_iterations: int, samples_per_second: float,
                elapsed: float | None = None, eta: float | None = None) -> str:
    """The one-line form of an iteration (used for logs off a terminal)."""
    return (
        f"iter {record.iteration + 1}/{total_iterations} v{record.policy_version} "
        f"elapsed={clock(elapsed)} eta={clock(eta)} "
        f"reward={record.reward_mean:.3f}±{record.reward_std:.3f} "
        f"acc={fmt(record.accuracy)} samples/s={samples_per_second:.1f} "
        f"staleness={record.staleness_mean:.2f}/{record.staleness_max} "
        f"loss={fmt(record.loss, '.4f')} kl={fmt(record.kl, '.4f')} "
        f"sync={record.weight_sync_seconds:.2f}s queues[{format_depths(record.queue_depths)}]"
        + (" REWARD-HACKING?" if record.reward_hacking else "")
    )


HACKING_WARNING = ("held-out accuracy is falling while the reward rises: the policy may be "
                   "pleasing its reward rather than solving the task (reward hacking; "
                   "docs/rewards.md)")


class ProgressDisplay:
    """Shows iteration, reward, accuracy, samples/s, queue depths per task and staleness."""

    def __init__(self, total_iterations: int, mode: str, *, enabled: bool,
                 stream: IO[str] | None = None) -> None:
        self.total_iterations = total_iterations
        self.mode = mode
        self.console = Console(file=stream, stderr=stream is None)
        # A live panel needs a terminal: redrawing into a pipe or file would spray escape codes.
        self.live_enabled = enabled and self.console.is_terminal
        self.records: list[IterationRecord] = []
        self.queue_depths: dict[str, int] = {}
        self.phase = "preparing"  # what happens before the first iteration
        self.loop_started: float | None = None  # unix time the RL loop began
        self.done_before = 0  # iterations of a resumed run done before this process
        self.accuracy_before: float | None = None  # the starting policy's held-out accuracy
        self._live: Live | None = None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []

    def __enter__(self) -> ProgressDisplay:
        if self.live_enabled:
            # get_renderable: each refresh redraws, so the elapsed time and ETA tick on their own
            self._live = Live(console=self.console, refresh_per_second=2,
                              get_renderable=self._render)
            self._live.start()
            # while the panel is shown, root handlers writing to stdout/stderr print through it
            root = logging.getLogger()
            for handler in list(root.handlers):
                stream = getattr(handler, "stream", None)
                if type(handler) is logging.StreamHandler and stream in (sys.stderr, sys.stdout):
                    replacement = RichHandler(console=self.console, show_path=False)
                    replacement.setLevel(handler.level)
                    root.removeHandler(handler)
                    root.addHandler(replacement)
                    self._swapped.append((replacement, handler))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        root = logging.getLogger()
        for rich_handler, original in self._swapped:
            root.removeHandler(rich_handler)
            root.addHandler(original)
        self._swapped = []

    @property
    def samples_per_second(self) -> float:
        """Trained samples per second of RL iteration time so far (worker start-up excluded)."""
        wall = sum(r.wall_seconds for r in self.records)
        return sum(r.samples for r in self.records) / wall if wall > 0 else 0.0

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self._refresh()

    def start_loop(self, started: float) -> None:
        self.loop_started = started
        self.phase = "RL loop"
        self._refresh()

    def elapsed_and_eta(self, now: float | None = None) -> tuple[float | None, float | None]:
        """Seconds of RL loop so far, and the estimate of those left."""
        if self.loop_started is None:
            return None, None
        elapsed = (time.time() if now is None else now) - self.loop_started
        left = self.total_iterations - self.done_before
        return elapsed, eta_seconds(len(self.records), left, elapsed)

    def update(self, record: IterationRecord) -> None:
        if not self.records and self.loop_started is not None:
            self.done_before = record.iteration  # a resumed run starts past 0
        if record.reward_hacking and not (self.records and self.records[-1].reward_hacking):
            log.warning("iteration %d: %s", record.iteration + 1, HACKING_WARNING)
        self.records.append(record)
        if record.queue_depths:
            self.queue_depths = dict(record.queue_depths)
        if self._live is None:
            elapsed, eta = self.elapsed_and_eta()
            log.info(format_line(record, self.total_iterations, self.samples_per_second,
                                 elapsed, eta))
        else:
            self._refresh()

    def set_queue_depths(self, depths: Mapping[str, int]) -> None:
        self.queue_depths = dict(depths)
        self._refresh()

    def _refresh(self) -> None:
        try:
            if self._live is not None:
                self._live.refresh()
        except Exception:  # a display glitch must never stop training
            log.exception("progress display failed to redraw")

    def _render(self) -> Any:
        done = self.done_before + len(self.records)
        bar = ProgressBar(total=self.total_iterations, completed=done, width=40)
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        table.add_row("mode", f"{self.mode}   iteration {done}/{self.total_iterations}")
        elapsed, eta = self.elapsed_and_eta()
        if elapsed is None:
            table.add_row("phase", self.phase)
        else:
            table.add_row("time", f"elapsed {clock(elapsed)}   ETA {clock(eta)}")
        before = "-" if self.accuracy_before is None else f"{self.accuracy_before:.3f}"
        if self.records:
            last = self.records[-1]
            accs = [r.accuracy for r in self.records if r.accuracy is not None]
            table.add_row("policy version", str(last.policy_version))
            w = max(reward_window(len(self.records)), 1)  # one iteration with fewer than two
            first_w = statistics.fmean(r.reward_mean for r in self.records[:w])
            last_w = statistics.fmean(r.reward_mean for r in self.records[-w:])
            table.add_row("reward", f"{last.reward_mean:.3f} ± {last.reward_std:.3f} (this "
                          f"iteration); mean of {w}: first {first_w:.3f}, last {last_w:.3f}")
            latest = f"{accs[-1]:.3f}" if accs else "-"
            table.add_row("held-out accuracy", f"{latest}  (before RL {before})")
            if last.reward_hacking:
                table.add_row("[bold red]warning[/]", f"[red]{HACKING_WARNING}[/]")
            tok_s = last.generated_tokens / last.wall_seconds if last.wall_seconds else 0
            table.add_row("throughput", f"{self.samples_per_second:.1f} samples/s  "
                          f"{tok_s:.0f} tok/s (last iteration)")
            table.add_row("staleness", f"mean {last.staleness_mean:.2f}  max {last.staleness_max}")
            table.add_row("loss / kl", f"{fmt(last.loss, '.4f')} / {fmt(last.kl, '.4f')}")
            table.add_row("weight sync", f"{last.weight_sync_seconds:.3f} s (last)")
        else:
            table.add_row("held-out accuracy", f"before RL {before}")
        table.add_row("queue depths", format_depths(self.queue_depths))
        return Group(bar, table)
