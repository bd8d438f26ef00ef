"""Verifiable tasks: the embedded procedural arithmetic task, and prompts from a user's file.

``ArithmeticTask`` streams problems like ``"12+34="`` -> ``"46"`` with a seed-independent held-out
split (the rule of ``workers.tasks.heldout``: ``a+b`` and ``b+a`` on the same side);
``load_problem_file`` reads JSONL or Parquet (pyarrow is imported only there).
The task contract: docs/training.md "Tasks".
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.tasks.heldout import arithmetic_key, is_held_out

if TYPE_CHECKING:
    import pyarrow as pa

SUPPORTED_OPERATIONS = ("+", "-", "*")


@dataclass(frozen=True)
class Problem:
    """One prompt and the reference answer a reward function checks completions against."""

    prompt: str
    answer: str


def _is_held_out(op: str, a: int, b: int, fraction: float) -> bool:
    return is_held_out(arithmetic_key(op, a, b), fraction)


_SOLVE = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class TrainingStream:
    """Shared by the procedural tasks: a seeded stream of training problems, cut into blocks (block
    k is what iteration k trains on). A task provides ``seed`` and ``_stream(seed, held_out)``."""

    seed: int
    held_out_fraction: float

    def _stream(self, seed: int, held_out: bool) -> Iterator[Problem]:
        raise NotImplementedError

    def iterate(self, seed: int | None = None) -> Iterator[Problem]:
        """Infinite deterministic stream of training problems (never a held-out one)."""
        return self._stream(self.seed if seed is None else seed, held_out=False)

    def train_problems(self, n: int, *, epoch_or_offset: int = 0) -> list[Problem]:
        """Block ``epoch_or_offset`` (0-based) of ``n`` problems of the task's training stream."""
        if n < 0 or epoch_or_offset < 0:
            raise ValueError(f"n and epoch_or_offset must be >= 0, got {n}, {epoch_or_offset}")
        start = n * epoch_or_offset
        return list(itertools.islice(self.iterate(), start, start + n))

    def _check_fraction(self) -> None:
        if not 0.0 < self.held_out_fraction < 0.5:
            raise ValueError(f"{type(self).__name__}.held_out_fraction must be in (0, 0.5), "
                             f"got {self.held_out_fraction}")

    def _distinct_held_out(self, n: int, draws: int | None = None) -> list[Problem]:
        """The first ``n`` distinct problems of the seed-independent held-out stream."""
        out: dict[str, Problem] = {}
        for p in itertools.islice(self._stream(seed=-1, held_out=True), draws):
            if p.prompt not in out:
                out[p.prompt] = p
                if len(out) == n:
                    return list(out.values())
        raise ValueError(f"eval_problems: only {len(out)} distinct held-out problems, wanted {n}")


@dataclass
class ArithmeticTask(TrainingStream):
    """Problems ``"{a}{op}{b}="`` with answer ``str(a op b)`` (docs/training.md "Tasks")."""

    digits: int = 2
    operations: tuple[str, ...] = ("+",)
    seed: int = 0
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


class ProblemFileError(ValueError):
    """A problem file is missing, unreadable, or lacks a required column."""


def _as_text(value: object) -> str | None:
    # Prompts and answers are text; JSON numbers (answer 46 vs "46") become their JSON text.
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def _read_table(path: Path) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        # pyarrow.json fails on a column mixing "46" and 46 (common for answers): parse lines
        rows = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ProblemFileError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
        if not rows:
            raise ProblemFileError(f"{path}: no rows")
        keys = sorted({k for r in rows for k in r})
        return pa.table({k: pa.array([_as_text(r.get(k)) for r in rows], pa.string())
                         for k in keys})
    raise ProblemFileError(f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet")


def load_problem_file(
    path: str | os.PathLike[str], prompt_column: str = "prompt", answer_column: str = "answer"
) -> list[Problem]:
    """Read problems from a JSONL or Parquet file with a prompt and an answer column."""
    import pyarrow as pa

    p = Path(path)
    if not p.is_file():
        raise ProblemFileError(f"problem file {str(p)!r} does not exist")
    try:
        table = _read_table(p)
    except ProblemFileError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise ProblemFileError(f"{p}: cannot read: {exc}") from exc
    for col in (prompt_column, answer_column):
        if col not in table.column_names:
            raise ProblemFileError(f"{p}: missing column {col!r}; columns are {table.column_names}")
    prompts = table.column(prompt_column).to_pylist()
    answers = table.column(answer_column).to_pylist()
    out = []
    for i, (q, a) in enumerate(zip(prompts, answers, strict=True)):
        if q is None or a is None:
            raise ProblemFileError(
                f"{p}: row {i} has a null {prompt_column!r} or {answer_column!r}")
        out.append(Problem(prompt=str(q), answer=str(a)))
    return out
