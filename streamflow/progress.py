"""Live progress of a run: a rich panel on a terminal, one log line per iteration elsewhere.

Owns: ``ProgressDisplay``, which the controller feeds with each finished ``IterationRecord``
(``update``) and, between iterations, with fresh queue depths (``set_queue_depths``).

Lifecycle: create → ``with display:`` (starts the live panel when enabled and stderr is a TTY)
→ ``update``/``set_queue_depths`` any number of times → exit (the panel stops and leaves its
last frame on screen). When the display is disabled (``run.progress=false``, or stderr is not a
terminal: CI, pipes, log files) nothing is drawn and each ``update`` logs exactly one INFO line on
the ``streamflow.progress`` logger; ``set_queue_depths`` is then silent (no log spam).

It only displays: it never blocks the run, and an exception while drawing is logged, not raised.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.progress_bar import ProgressBar
from rich.table import Table

from streamflow.rundir import IterationRecord

log = logging.getLogger("streamflow.progress")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_depths(depths: Mapping[str, int]) -> str:
    return " ".join(f"{task}={n}" for task, n in depths.items()) or "-"


def format_line(record: IterationRecord, total_iterations: int, samples_per_second: float) -> str:
    """The one-line form of an iteration (used for logs off a terminal)."""
    return (
        f"iter {record.iteration + 1}/{total_iterations} v{record.policy_version} "
        f"reward={record.reward_mean:.3f}±{record.reward_std:.3f} "
        f"acc={_fmt(record.accuracy)} samples/s={samples_per_second:.1f} "
        f"staleness={record.staleness_mean:.2f}/{record.staleness_max} "
        f"loss={_fmt(record.loss, '.4f')} kl={_fmt(record.kl, '.4f')} "
        f"sync={record.weight_sync_seconds:.2f}s queues[{format_depths(record.queue_depths)}]"
    )


class ProgressDisplay:
    """Shows iteration, reward, accuracy, samples/s, queue depths per task and staleness."""

    def __init__(
        self,
        total_iterations: int,
        mode: str,
        *,
        enabled: bool = True,
        stream: IO[str] | None = None,
    ) -> None:
        self.total_iterations = total_iterations
        self.mode = mode
        self.console = Console(file=stream, stderr=stream is None)
        # A live panel needs a terminal: redrawing into a pipe or file would spray escape codes.
        self.live_enabled = enabled and self.console.is_terminal
        self.records: list[IterationRecord] = []
        self.queue_depths: dict[str, int] = {}
        self._samples = 0
        self._live: Live | None = None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []

    def __enter__(self) -> ProgressDisplay:
        if self.live_enabled:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.start()
            self._route_logging_through_console()
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

    def _route_logging_through_console(self) -> None:
        """Log lines written straight to the terminal would tear the live panel: while it is
        shown, root handlers that write to stdout/stderr print through the panel's console."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            stream = getattr(handler, "stream", None)
            if type(handler) is logging.StreamHandler and stream in (sys.stderr, sys.stdout):
                replacement = RichHandler(console=self.console, show_path=False)
                replacement.setLevel(handler.level)
                root.removeHandler(handler)
                root.addHandler(replacement)
                self._swapped.append((replacement, handler))

    @property
    def samples_per_second(self) -> float:
        """Trained samples per second of RL iteration time so far (worker start-up excluded)."""
        wall = sum(r.wall_seconds for r in self.records)
        return self._samples / wall if wall > 0 else 0.0

    def update(self, record: IterationRecord) -> None:
        self.records.append(record)
        self._samples += record.samples
        if record.queue_depths:
            self.queue_depths = dict(record.queue_depths)
        if self._live is None:
            log.info(format_line(record, self.total_iterations, self.samples_per_second))
        else:
            self._refresh()

    def set_queue_depths(self, depths: Mapping[str, int]) -> None:
        self.queue_depths = dict(depths)
        if self._live is not None:
            self._refresh()

    def _refresh(self) -> None:
        try:
            assert self._live is not None
            self._live.update(self._render())
        except Exception:  # a display glitch must never stop training
            log.exception("progress display failed to redraw")

    def _render(self) -> Any:
        done = len(self.records)
        bar = ProgressBar(total=self.total_iterations, completed=done, width=40)
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        table.add_row("mode", f"{self.mode}   iteration {done}/{self.total_iterations}")
        if self.records:
            first, last = self.records[0], self.records[-1]
            accs = [r.accuracy for r in self.records if r.accuracy is not None]
            table.add_row("policy version", str(last.policy_version))
            table.add_row(
                "reward",
                f"{last.reward_mean:.3f} ± {last.reward_std:.3f}  (first {first.reward_mean:.3f})",
            )
            acc = f"{accs[-1]:.3f}  (first {accs[0]:.3f})" if accs else "-"
            table.add_row("held-out accuracy", acc)
            table.add_row(
                "throughput",
                f"{self.samples_per_second:.1f} samples/s  "
                f"{last.generated_tokens / last.wall_seconds if last.wall_seconds else 0:.0f} tok/s (last iteration)",
            )
            table.add_row("staleness", f"mean {last.staleness_mean:.2f}  max {last.staleness_max}")
            table.add_row("loss / kl", f"{_fmt(last.loss, '.4f')} / {_fmt(last.kl, '.4f')}")
            table.add_row("weight sync", f"{last.weight_sync_seconds:.3f} s (last)")
        table.add_row("queue depths", format_depths(self.queue_depths))
        return Group(bar, table)
