"""The one admission rule behind the three modes (used by ``streamflow.controller`` and by the
simulated cluster ``bench.sim.cluster``).

Iteration k's prompt rows carry ``min_policy_version = max(k - s, 0)`` and are put once the
newest published policy version is >= k - s, where s is the staleness bound: 0 for ``sync`` and
``periodic`` (on-policy: k is generated with exactly version k), ``max_staleness`` for ``async``
(rollout runs up to s versions ahead of training). ``prompt_rows`` is what is put: one row per
sample (each prompt repeated ``group_size`` times, one group id per prompt).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from workers.schema import SAMPLES_SCHEMA


def min_policy_version(iteration: int, staleness: int) -> int:
    """The oldest policy version allowed to generate iteration ``iteration``."""
    return max(iteration - staleness, 0)


def admissible(iteration: int, staleness: int, version: int) -> bool:
    """May iteration ``iteration`` be put now that version ``version`` is published?"""
    return iteration - staleness <= version


def prompt_rows(plan: Any, iteration: int, staleness: int) -> pa.RecordBatch:
    """Iteration ``iteration``'s prompt rows (``plan``: a ``streamflow.stages.RunPlan``)."""
    k, g = iteration, plan.cfg.data.group_size
    problems = plan.problems(k)
    n = len(problems)
    columns = {
        "group_id": pa.array([k * n + i for i in range(n) for _ in range(g)], pa.int64()),
        "iteration": pa.array([k] * (n * g), pa.int64()),
        "min_policy_version": pa.array([min_policy_version(k, staleness)] * (n * g), pa.int64()),
        "prompt_ids": pa.array([plan.encode(p.prompt) for p in problems for _ in range(g)],
                               pa.list_(pa.int32())),
        "answer": pa.array([p.answer for p in problems for _ in range(g)], pa.string()),
    }
    schema = pa.schema([SAMPLES_SCHEMA.field(c) for c in columns])
    return pa.RecordBatch.from_pydict(columns, schema=schema)
