"""Reward hacking, watched during a run: held-out accuracy falling while the reward rises.

A policy trained on a proxy (a reward model, a lenient verifier) can raise its reward by pleasing
the proxy instead of solving the task; the held-out accuracy (``reward.fn`` on prompts never
trained on) is then what falls. The rule (``detect``; keys ``reward.hacking_window`` = K and
``reward.hacking_drop`` = D), over the run's evaluations in order, the starting policy's first:

- a *window* is K consecutive evaluations (K >= 2); its accuracy is their mean, its reward the
  mean reward of the iterations after its first evaluation up to its last one, and its
  *starting* reward the mean over the iterations up to its second evaluation;
- the rule holds at the newest window W when the window B with the best accuracy before it
  (the first of equals) has accuracy(B) - accuracy(W) >= D, and reward(W) > the starting
  reward of B: since the accuracy was at its best, the reward went up while the accuracy went
  down.

Means over K evaluations, not single ones: one evaluation of 200 prompts swings by 0.05-0.1
between evaluations of a healthy run (docs/learning.md). B's *starting* reward, not its mean:
a policy that finds its reward model's blind spot at once raises the reward within the first
window already, which a comparison with that window's mean would miss once the reward levels
off (measured: docs/rewards.md "Reward hacking"). The controller sets each iteration's
``reward_hacking`` (metrics.jsonl; the Prometheus gauge ``streamflow_run_reward_hacking_ratio``)
to whether the rule holds at that iteration; the live panel and ``streamflow report`` say so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from streamflow.rundir import IterationRecord

BEFORE_RL = -1  # the iteration of the starting policy's evaluation


@dataclass(frozen=True)
class Hacking:
    """The windows the rule compared when it fired."""

    best_accuracy: float  # the best earlier window's mean held-out accuracy
    accuracy: float  # the newest window's
    best_reward: float  # mean reward at the start of the best window (to its second evaluation)
    reward: float  # mean reward over the newest window's iterations
    best_span: tuple[int, int]  # (first, last) evaluated iteration of each window
    span: tuple[int, int]

    def describe(self) -> str:
        return (f"held-out accuracy {self.best_accuracy:.3f} -> {self.accuracy:.3f} (mean of the "
                f"evaluations at iterations {_span(self.best_span)} -> {_span(self.span)}) while "
                f"the reward rose {self.best_reward:.3f} -> {self.reward:.3f}")


def _span(span: tuple[int, int]) -> str:
    first, last = (("before RL" if i == BEFORE_RL else str(i + 1)) for i in span)
    return f"{first}..{last}"


def detect(evaluations: Sequence[tuple[int, float]], rewards: dict[int, float], *, window: int,
           drop: float) -> Hacking | None:
    """``evaluations``: (iteration, held-out accuracy) in order (``BEFORE_RL`` for the starting
    policy); ``rewards``: iteration -> its mean reward. The rule above at the newest window, or
    None (fewer than K + 1 evaluations, or it does not hold)."""
    if window < 2 or len(evaluations) < window + 1:
        return None
    def mean_reward(after: int, upto: int) -> float | None:
        spanned = [r for i, r in rewards.items() if after < i <= upto]
        return statistics.fmean(spanned) if spanned else None

    windows = []  # (accuracy, reward, starting reward, span)
    for end in range(window - 1, len(evaluations)):
        group = evaluations[end - window + 1:end + 1]
        first, last = group[0][0], group[-1][0]
        windows.append((statistics.fmean(a for _, a in group), mean_reward(first, last),
                        mean_reward(first, group[1][0]), (first, last)))
    *earlier, (accuracy, reward, _, span) = windows
    best_accuracy, _, best_reward, best_span = max(earlier, key=lambda w: w[0])
    if reward is None or best_reward is None:
        return None
    if best_accuracy - accuracy >= drop - 1e-12 and reward > best_reward:
        return Hacking(best_accuracy, accuracy, best_reward, reward, best_span, span)
    return None


def detect_records(records: Sequence[IterationRecord], accuracy_before: float | None, *,
                   window: int, drop: float) -> Hacking | None:
    """``detect`` over a run's records (and the starting policy's accuracy, if evaluated)."""
    evaluations = [(BEFORE_RL, accuracy_before)] if accuracy_before is not None else []
    evaluations += [(r.iteration, r.accuracy) for r in records if r.accuracy is not None]
    return detect(evaluations, {r.iteration: r.reward_mean for r in records}, window=window,
                  drop=drop)


def first_hacking(records: Sequence[IterationRecord], accuracy_before: float | None, *,
                  window: int, drop: float) -> tuple[int, Hacking] | None:
    """The first iteration at which the rule held, with what it compared then (the report's
    line), or None."""
    for k, rec in enumerate(records):
        if rec.accuracy is None:  # the rule changes only at an evaluation
            continue
        found = detect_records(records[:k + 1], accuracy_before, window=window, drop=drop)
        if found is not None:
            return rec.iteration, found
    return None
