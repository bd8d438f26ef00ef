"""The one admission rule behind the three modes (controller and ``bench.sim.cluster``).

Iteration k's rows carry ``min_policy_version = max(k - s, 0)`` and are put once version k - s is
published; s is 0 for sync/periodic, ``max_staleness`` for async (docs/controller.md "Modes").
"""

from __future__ import annotations


def min_policy_version(iteration: int, staleness: int) -> int:
    """The oldest policy version allowed to generate iteration ``iteration``."""
    return max(iteration - staleness, 0)


def admissible(iteration: int, staleness: int, version: int) -> bool:
    """May iteration ``iteration`` be put now that version ``version`` is published?"""
    return iteration - staleness <= version
