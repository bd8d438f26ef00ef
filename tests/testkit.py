"""What tests share: ``wait_until`` (a bounded wait on a condition, instead of a ``sleep`` used as
synchronisation), ``no_children_left`` (a run left no process behind) and ``free_port`` (the
project's own pick, below the ephemeral range: see ``storage/ports.py`` for why ``bind(0)`` is not
used for a port a child process binds later) and ``worker_plan`` (a run's worker records without a
model, for tests of what the plan hands each worker).

Importable from every test as ``from testkit import wait_until, free_port``: ``tests/conftest.py``
sits in this directory, and pytest puts a conftest's directory on ``sys.path``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from storage.ports import free_port

__all__ = ["NoNewerFiles", "ScriptedWatch", "free_port", "written_cells", "no_children_left", "wait_until",
           "worker_plan"]

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Call ``condition`` until it returns something truthy and return that; AssertionError naming
    ``what`` (or the condition) after ``timeout`` seconds. The interval doubles up to 0.1 s, so a
    fast condition is seen fast and a slow one does not spin."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            name = what or getattr(condition, "__name__", repr(condition))
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {name}")
        time.sleep(interval)
        interval = min(interval * 2, 0.1)


def no_children_left(timeout: float = 10.0) -> None:
    """Wait until this process has no child processes left (a run stopped everything it started);
    the AssertionError lists the ones still there. Python's multiprocessing resource tracker is
    not counted: the first ``spawn`` in this process (a reward runner or a user environment's
    child, workers.runtime.child) starts it, and it lives as long as this process does."""
    import psutil

    left: list[psutil.Process] = []

    def ours(child: psutil.Process) -> bool:
        try:
            return "multiprocessing.resource_tracker" not in " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            return False

    def none_left() -> bool:
        left[:] = [c for c in psutil.Process().children(recursive=True) if ours(c)]
        return not left

    try:
        wait_until(none_left, timeout=timeout, what="every child process to exit")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}; left: {left}") from None


def worker_plan(cfg, run_dir):  # noqa: ANN001, ANN201 - RunConfig, Path -> streamflow.plan.RunPlan
    """The worker records ``cfg`` gives, with no model built or loaded (imports kept local: most
    tests never need the engine's modules)."""
    from streamflow.devices import resolve_devices
    from streamflow.plan import RunPlan, _worker_records

    plan = RunPlan(cfg=cfg, run_dir=run_dir, model_path=run_dir / "model",
                   weights_dir=run_dir / "weights", tokenizer=None, train_problems=None,
                   task=None, eval_problems=[],
                   host_threads=cfg.run.host_thread_budget(cfg.trainer.deterministic))
    plan.devices = resolve_devices(cfg, 0)
    _worker_records(plan, None, None, None)
    return plan


def objective(loss: str = "grpo", clip_low: float = 0.2, clip_high: float = 0.2,
              **changes):  # noqa: ANN003, ANN201 - fields -> workers.rl.objectives.Objective
    """An ``Objective`` on the tests' baseline (each test names what it varies): grpo's
    symmetric clip 0.2, no KL term, no off-policy correction, cap 2, a normaliser of 1 token."""
    from workers.rl.objectives import Objective

    fields = {"kl_coef": 0.0, "correction": "off", "is_cap": 2.0, "max_tokens": 1, **changes}
    return Objective(loss, clip_low, clip_high, **fields)


class CutAfter(threading.Event):
    """A partial rollout ``cut`` event that reads as set from its ``k``-th look on (an engine
    looks once per decode or engine step), so a test cuts a generation at a known step."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.looks = k, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.k


class NoNewerFiles:
    """A ``WeightSubscriber`` with no newer version ever (partial rollout's tests)."""

    directory = "/nonexistent"

    def newest(self) -> None:
        return None


class ScriptedWatch:
    """A ``VersionWatch`` whose next ``arm`` hands out ``events.pop(0)`` (then a clear one): a
    test decides which generate call is cut, and when."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = list(events)

    def arm(self, version: int) -> threading.Event:
        return self.events.pop(0) if self.events else threading.Event()

    def close(self) -> None:
        pass


def written_cells(batches: Any) -> dict[int, dict]:
    """row id -> {column: value} over a stage's write batches (a cell written twice is an
    error)."""
    out: dict[int, dict] = {}
    for b in batches:
        for row in b.to_pylist():
            cells = out.setdefault(row.pop("row_id"), {})
            assert not set(cells) & set(row), "a cell written twice"
            cells.update(row)
    return out
