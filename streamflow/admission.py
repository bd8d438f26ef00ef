"""The one admission rule behind the three modes (used by ``streamflow.controller`` and by the
simulated cluster ``bench.sim.cluster``).

Iteration k's prompt rows carry ``min_policy_version = max(k - s, 0)`` and are put once the
newest published policy version is >= k - s, where s is the staleness bound: 0 for ``sync`` and
``periodic`` (on-policy: k is generated with exactly version k), ``max_staleness`` for ``async``
(rollout runs up to s versions ahead of training). The rows themselves are built by
``workers.schema.prompt_rows`` (through ``RunPlan.prompt_rows``).
"""

from __future__ import annotations


def min_policy_version(iteration: int, staleness: int) -> int:
    """The oldest policy version allowed to generate iteration ``iteration``."""
    return max(iteration - staleness, 0)


def admissible(iteration: int, staleness: int, version: int) -> bool:
    """May iteration ``iteration`` be put now that version ``version`` is published?"""
    return iteration - staleness <= version
