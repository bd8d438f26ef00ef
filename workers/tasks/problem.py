"""The task contract: a ``Problem`` (prompt and reference answer) and ``TrainingStream``, the seeded
stream of training problems every procedural task provides (docs/training.md "Tasks").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One prompt and the reference answer a reward function checks completions against."""

    prompt: str
    answer: str


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
