"""The embedded procedural arithmetic task: ``ArithmeticTask`` streams problems like ``"12+34="`` ->
``"46"`` with a seed-independent held-out split (the rule of ``workers.tasks.heldout``: ``a+b``
and ``b+a`` on the same side). The task contract: ``workers.tasks.problem``, docs/training.md
"Tasks".
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.tasks.heldout import arithmetic_key, is_held_out
from workers.tasks.problem import Problem, TrainingStream

if TYPE_CHECKING:
    pass

SUPPORTED_OPERATIONS = ("+", "-", "*")

def _is_held_out(op: str, a: int, b: int, fraction: float) -> bool:
    return is_held_out(arithmetic_key(op, a, b), fraction)


_SOLVE = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass
class ArithmeticTask(TrainingStream):
    """Problems ``"{a}{op}{b}="`` with answer ``str(a op b)`` (docs/training.md "Tasks")."""

    # the run's data.digits, data.operations and data.seed
    digits: int
    operations: tuple[str, ...]
    seed: int
    held_out_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= int(self.digits) <= 9:
            raise ValueError(f"ArithmeticTask.digits must be in 1..9, got {self.digits}")
        self.operations = tuple(self.operations)
        if not self.operations:
            raise ValueError("ArithmeticTask.operations must not be empty")
        bad = [op for op in self.operations if op not in SUPPORTED_OPERATIONS]
        if bad:
            raise ValueError(
                f"ArithmeticTask.operations has unsupported {bad}; allowed: {SUPPORTED_OPERATIONS}")
        self._check_fraction()

    @property
    def max_operand(self) -> int:
        return 10**self.digits - 1

    def make_problem(self, op: str, a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}{op}{b}=", answer=str(_SOLVE[op](a, b)))

    def is_held_out(self, problem_or_triple: Problem | tuple[str, int, int]) -> bool:
        """Whether a problem (or an (op, a, b) triple) belongs to the evaluation split."""
        if isinstance(problem_or_triple, Problem):
            op, a, b = self._parse(problem_or_triple.prompt)
        else:
            op, a, b = problem_or_triple
        return _is_held_out(op, a, b, self.held_out_fraction)

    def _parse(self, prompt: str) -> tuple[str, int, int]:
        body = prompt.rstrip("=")
        for op in self.operations:
            left, sep, right = body.partition(op)
            if sep and left.isdigit() and right.isdigit():
                return op, int(left), int(right)
        raise ValueError(f"not a prompt of this task: {prompt!r}")

    def _stream(self, seed: int, held_out: bool) -> Iterator[Problem]:
        rng = random.Random(f"arith|{self.digits}|{','.join(self.operations)}|{seed}|{held_out}")
        while True:
            op = self.operations[rng.randrange(len(self.operations))]
            a = rng.randint(0, self.max_operand)
            b = rng.randint(0, self.max_operand)
            if _is_held_out(op, a, b, self.held_out_fraction) == held_out:
                yield self.make_problem(op, a, b)

    def eval_problems(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems, the same list on every call (seed-independent)."""
        total = len(self.operations) * (self.max_operand + 1) ** 2
        if total <= 200_000:
            # Small space: enumerate the held-out split exactly, then draw without replacement.
            held = [
                (op, a, b)
                for op in self.operations
                for a in range(self.max_operand + 1)
                for b in range(self.max_operand + 1)
                if _is_held_out(op, a, b, self.held_out_fraction)
            ]
            if n > len(held):
                raise ValueError(
                    f"eval_problems: n={n} but this task has only {len(held)} held-out problems")
            rng = random.Random(f"arith-eval|{self.digits}|{','.join(self.operations)}")
            return [self.make_problem(*t) for t in rng.sample(held, n)]
        return self._distinct_held_out(n)
