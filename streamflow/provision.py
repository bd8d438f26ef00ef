"""Prompt provisioning: which prompt rows the controller puts for an iteration, and when more.

Without dynamic sampling iteration k gets its block of P = ``data.prompts_per_iteration`` prompts,
once. With it (``workers.rl.dynamic``) the trainer acks zero-variance groups untrained and steps
on exactly P groups with reward variance, so ``Provisioner`` over-provisions: it puts P x factor
prompts (factor from the measured zero-variance rate), tops an iteration up while it is short,
and stops the run once the prompts are all solved (``PromptsSolved``). Extra prompts are just more
rows in the store. Used by the streaming controller and by the colocated loop alike; design and
the rules of each number: docs/training.md "Dynamic sampling".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from streamflow.plan import RunPlan
from workers.runtime.events import SamplingReport, StepReport

# weight of the newest step's measured zero-variance rate in the running estimate: a few steps
# of memory, so a policy that solves more of its prompts over a run is followed within ~4 steps
RATE_WEIGHT = 0.25


class PromptsSolved(Exception):  # noqa: N818 - a stop, not an error of the code
    """trainer.solved_patience x P prompts in a row came back without a group with reward
    variance: the run stops (status "solved") instead of putting prompts forever. One line."""


@dataclass
class _Open:
    """An iteration whose step is not reported yet: what was put for it, what came back."""

    put: int  # groups (prompts) put for it, every batch
    batch: int  # groups of its latest batch
    kept_before: int = 0  # informative + surplus when its latest batch was put
    # the trainer's counts (SamplingReport; the largest reported: a restarted trainer counts anew)
    informative: int = 0
    filtered: int = 0
    surplus: int = 0
    dead: int = 0  # its DEAD groups (the store's dead letters): they never reach the trainer

    @property
    def resolved(self) -> int:
        return self.informative + self.filtered + self.surplus + self.dead


class Provisioner:
    """The prompt rows of each put. ``first_put(k)`` once per iteration, ``top_ups()`` whenever
    reports were read (raises ``PromptsSolved``), ``observe(records)`` with the trainer's
    reports (idempotent: the colocated loop and the controller may both pass the same ones)."""

    def __init__(self, plan: RunPlan, history: list | None = None) -> None:
        cfg = plan.cfg
        self.plan = plan
        self.enabled = cfg.trainer.grpo.dynamic
        self.per_step = cfg.data.prompts_per_iteration
        self.cap, self.patience = cfg.trainer.oversample_cap, cfg.trainer.solved_patience
        self.cursor = plan.start_iteration * self.per_step  # the next prompt of the stream
        self.rate = 0.0  # running estimate of the zero-variance rate (0: no evidence yet)
        # A resumed run goes on from the records it keeps (``IterationRecord``s of iterations
        # before its start): the rate as it was, and the cursor past every prompt put (exact
        # when iterations are put one after another: sync, periodic; in async a few prompts may
        # come again, harmless: the store is fresh, so ids cannot collide)
        if self.enabled and history and [r.iteration for r in history] == list(
                range(plan.start_iteration)):
            for record in history:
                self.rate += RATE_WEIGHT * (record.zero_variance_rate - self.rate)
            self.cursor = sum(r.prompts_put or self.per_step for r in history)
        self._open: dict[int, _Open] = {}
        self._first: dict[int, tuple[float, int]] = {}  # iteration -> (its factor, prompts put)
        self._empty, self._empty_groups = 0, 0  # puts in a row without variance, their prompts

    @property
    def factor(self) -> float:
        """Prompts put per prompt a step needs: 1 / (1 - rate), at most ``trainer.oversample_cap``
        (near rate 1 it diverges; each prompt costs group_size generations and store rows)."""
        return _factor(self.rate, self.cap)

    def first_put(self, iteration: int, staleness: int) -> Any:
        """The rows of iteration's first put (its own block when dynamic sampling is off)."""
        if not self.enabled:
            return self.plan.prompt_rows(iteration, staleness)
        factor = self.factor
        count = self._size(self.per_step, self.rate)
        self._open[iteration] = _Open(put=count, batch=count)
        self._first[iteration] = (factor, count)
        return self._take(iteration, staleness, count)

    def observe(self, records: list) -> None:
        """The trainer's counts (``SamplingReport``) and steps (``StepReport``)."""
        for rec in records:
            if isinstance(rec, SamplingReport):
                it = self._open.get(rec.iteration)
                if it is not None:
                    it.informative = max(it.informative, rec.informative)
                    it.filtered = max(it.filtered, rec.filtered)
                    it.surplus = max(it.surplus, rec.surplus)
            elif isinstance(rec, StepReport) and self._open.pop(rec.iteration, None) is not None:
                self.rate += RATE_WEIGHT * (rec.zero_variance_rate - self.rate)
                self._empty = self._empty_groups = 0  # a step trained groups with variance

    def observe_dead(self, dead: dict[int, set[int]]) -> None:
        """The DEAD group ids per iteration (``workers.runtime.faults.dead_groups``)."""
        for iteration, ids in dead.items():
            it = self._open.get(iteration)
            if it is not None:
                it.dead = len(ids)

    def top_ups(self, staleness: int) -> list[Any]:
        """Rows to put now: for each open iteration whose groups have all come back with fewer
        than P (less its dead groups) with variance, short / (1 - rate) more prompts, the rate
        that iteration's own measured one. Raises ``PromptsSolved`` at the patience."""
        out = []
        for iteration, it in sorted(self._open.items()):
            short = self.per_step - it.dead - it.informative
            if it.resolved < it.put or short <= 0:
                continue  # its batch is still out, or the trainer steps on what it has
            # (a batch that only died ended the shortfall above: batch >= short)
            gained = it.informative + it.surplus - it.kept_before
            self._empty = 0 if gained else self._empty + 1
            self._empty_groups = 0 if gained else self._empty_groups + it.batch
            if self._empty_groups >= self.patience * self.per_step:
                raise PromptsSolved(
                    f"dynamic sampling: the last {self._empty_groups} prompts put (in "
                    f"{self._empty} put{'s' * (self._empty > 1)}, through iteration {iteration}) "
                    "had no group with reward variance: "
                    "every sample of a prompt scored the same (all solved or all failed), so "
                    "nothing is left to train on (trainer.solved_patience)")
            seen = it.informative + it.filtered + it.surplus
            count = self._size(short, it.filtered / seen if seen else self.rate)
            it.put, it.batch, it.kept_before = it.put + count, count, it.informative + it.surplus
            first = self._first.get(iteration)
            if first is not None:
                self._first[iteration] = (first[0], first[1] + count)
            out.append(self._take(iteration, staleness, count))
        return out

    def step_fields(self, iteration: int) -> dict[str, Any]:
        """The ``IterationRecord`` fields of the controller's side: the factor of the iteration's
        first put and the prompts put for it in all (P and 1.0 with dynamic sampling off)."""
        factor, put = self._first.pop(iteration, (1.0, self.per_step))
        return {"oversample_factor": factor, "prompts_put": put}

    def _size(self, needed: int, rate: float) -> int:
        """Prompts to put for ``needed`` groups with variance at zero-variance ``rate``: needed /
        (1 - rate), at most P x ``trainer.oversample_cap`` (rate 1: that many)."""
        most = math.ceil(self.per_step * self.cap - 1e-9)
        return most if rate >= 1.0 else min(math.ceil(needed / (1.0 - rate) - 1e-9), most)

    def _take(self, iteration: int, staleness: int, count: int) -> Any:
        rows = self.plan.prompt_rows(iteration, staleness, first=self.cursor, count=count)
        self.cursor += count
        return rows


def _factor(rate: float, cap: float) -> float:
    return cap if rate >= 1.0 else min(1.0 / (1.0 - rate), cap)
