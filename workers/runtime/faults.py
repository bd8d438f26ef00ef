"""Failure reasons that name their rows, and what the store's dead letters say about iterations.

A failed delivery's reason names its rows' iteration and group ("iteration 3 group 13: ...");
``dead_iteration`` reads them back for the trainer: which groups will never arrive, and why an
iteration can never be trained (docs/training.md "Failure reasons and dead groups").
"""

from __future__ import annotations

import re
from typing import Any

_REASON = re.compile(r"^iteration (\d+) group (\d+): ")


def failure_reason(batch: Any, error: str) -> str:
    """``error`` prefixed with the iteration and group(s) of ``batch``'s rows, when it has them."""
    names = batch.schema.names
    if "iteration" not in names or "group_id" not in names or batch.num_rows == 0:
        return error
    iterations = set(batch.column("iteration").to_pylist())
    if len(iterations) != 1:
        return error
    groups = set(batch.column("group_id").to_pylist())
    if len(groups) != 1:  # rows of a mixed lease may die at different deliveries: name none
        return error
    return f"iteration {iterations.pop()} group {groups.pop()}: {error}"


def dead_groups(stats: Any, tasks: list[str]) -> tuple[dict[int, set[int]], dict[str, int]]:
    """({iteration: dead group ids}, {reason: rows} for dead rows no iteration is known of)."""
    by_iteration: dict[int, set[int]] = {}
    unknown: dict[str, int] = {}
    for task in tasks:
        for reason, n in stats.task_total(task).dead_reasons.items():
            m = _REASON.match(reason)
            if m is None:
                unknown[f"{task}: {reason}"] = unknown.get(f"{task}: {reason}", 0) + n
                continue
            by_iteration.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return by_iteration, unknown


def dead_iteration(stats: Any, tasks: list[str], iteration: int,
                   groups: int) -> tuple[set[int], str | None]:
    """The dead group ids of ``iteration`` (of ``groups`` groups) and, when it can never be
    trained, why (with up to five of the reasons); None while it still can."""
    by_iteration, unknown = dead_groups(stats, tasks)
    dead = by_iteration.get(iteration, set())
    if len(dead) >= groups:
        reasons = sorted({r for t in tasks for r in stats.task_total(t).dead_reasons
                          if r.startswith(f"iteration {iteration} ")})
        return dead, (f"every group of iteration {iteration} is DEAD (quarantined after "
                      "store.max_deliveries failed deliveries); reasons: "
                      + "; ".join(reasons[:5]))
    if unknown:
        return dead, f"rows quarantined DEAD for reasons that name no iteration: {unknown}"
    return dead, None
