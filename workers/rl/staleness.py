"""Per-token staleness of the trained rows: how old the weights that sampled each token were.

A response cut by partial rollout (docs/partial.md) holds tokens of several policy versions,
run-length in ``response_version_runs``; a response without it (not partial, or never written
so) is one run of its ``policy_version``. Pure: no store, no model. The metrics of one step:

* ``partial_resumes``: trained trajectories whose tokens come from more than one policy version
  (cut, then continued with newer weights); a cut whose resume found no newer version merges
  into one run and is not counted;
* ``tokens_per_version_span``: mean tokens per run (a run: consecutive tokens of one version);
* ``staleness_token_mean``: token-weighted staleness, sum over runs of (step - version) x run
  length / tokens. ``staleness_mean``/``staleness_max`` stay per row, by the OLDEST token's
  version (what admission bounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def run_lengths(runs: Sequence[Any] | None, length: int, version: int) -> list[tuple[int, int]]:
    """(tokens, version) of each run of a response of ``length`` tokens; ``runs``: its
    ``response_version_runs`` cell (dicts with start, version), None: one run of ``version``."""
    if not runs:
        return [(length, int(version))]
    starts = [int(r["start"]) for r in runs] + [length]
    return [(starts[i + 1] - starts[i], int(r["version"])) for i, r in enumerate(runs)]


@dataclass
class TokenStaleness:
    """Sums over one step's trained rows (``add`` per piece, read after the step)."""

    rows_resumed: int = 0
    runs: int = 0
    tokens: int = 0
    staleness_tokens: int = 0  # sum of (step - version) x tokens

    def add(self, step: int, lengths: Sequence[int], versions: Sequence[int],
            runs: Sequence[Sequence[Any] | None] | None = None) -> None:
        for i, (length, version) in enumerate(zip(lengths, versions, strict=True)):
            spans = run_lengths(runs[i] if runs is not None else None, int(length), version)
            self.rows_resumed += len(spans) > 1
            self.runs += len(spans)
            self.tokens += sum(n for n, _ in spans)
            self.staleness_tokens += sum(n * (step - v) for n, v in spans)

    @property
    def tokens_per_version_span(self) -> float:
        return self.tokens / self.runs if self.runs else 0.0

    @property
    def staleness_token_mean(self) -> float:
        return self.staleness_tokens / self.tokens if self.tokens else 0.0
