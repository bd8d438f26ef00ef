"""The rollout engine contract: ``SamplingParams``, ``Generation``, the ``RolloutEngine`` protocol,
and the optional ``Interruptible`` capability partial rollout cuts generations through.

The invariants an engine keeps (behaviour log-probs over the full vocabulary before top-p, stop
tokens included, per-prompt seeds): docs/engines.md, "The rollout engine contract".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from workers.settings import SamplingSettings

if TYPE_CHECKING:  # annotations only: the records and the protocol need no torch at import
    import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CUT = "cut"  # partial rollout: cut at a token boundary by a newer policy version


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy (argmax)."""

    # the run's rollout.* (declared in SamplingSettings)
    temperature: float = SamplingSettings.temperature
    top_p: float = SamplingSettings.top_p
    max_new_tokens: int = SamplingSettings.max_new_tokens
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    prompt_seeds: tuple[int, ...] = ()  # per-prompt seeds (override ``seed``; docs/engines.md)
    # Partial rollout: per prompt (``n == 1``), tokens a cut generation of it already produced.
    # The prompt passed is the original prompt + those tokens, its seed the cut row's own seed;
    # the engine skips that many draws of the row's random stream, so a continuation under
    # unchanged weights draws what the uncut generation would have drawn.
    done_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_seeds", tuple(int(s) for s in self.prompt_seeds))
        object.__setattr__(self, "done_tokens", tuple(int(d) for d in self.done_tokens))
        if any(d < 0 for d in self.done_tokens):
            raise ValueError(f"SamplingParams.done_tokens must be >= 0, got {self.done_tokens}")


def prompt_seeds_of(params: SamplingParams, num_prompts: int, n: int) -> list[int] | None:
    """Each prompt's seed (sample j uses seed + j): ``params.prompt_seeds``, else ``params.seed +
    i * n`` for prompt i (no two samples of a call share a seed); None when unseeded."""
    if params.prompt_seeds:
        if len(params.prompt_seeds) != num_prompts:
            raise ValueError(
                f"generate: SamplingParams.prompt_seeds has {len(params.prompt_seeds)} seeds for "
                f"{num_prompts} prompts"
            )
        return list(params.prompt_seeds)
    if params.seed is None:
        return None
    return [int(params.seed) + i * n for i in range(num_prompts)]


def check_generate(prompts: Sequence[Sequence[int]], n: int) -> None:
    """The argument checks every engine's ``generate`` makes."""
    if n < 1:
        raise ValueError(f"generate: n must be >= 1, got {n}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (needs at least one token)")


@dataclass
class Generation:
    """One sampled response."""

    token_ids: list[int] = field(default_factory=list)  # [L] response tokens (stop token included)
    logprobs: list[float] = field(default_factory=list)  # [L] behaviour log-probs (docs/engines.md)
    finish_reason: str = FINISH_LENGTH  # "stop" | "length" | "cut" (``Interruptible`` only)


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout worker needs from an inference engine."""

    policy_version: int

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        """``n`` samples per prompt, in prompt order: ``result[i][j]`` is sample j of prompt i."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights (HF parameter names) and set ``policy_version = version``."""
        ...


@runtime_checkable
class LoadsWeightsFile(Protocol):
    """Optional capability: load a published version straight from its safetensors file (vLLM:
    inside its worker process); ``RolloutStage`` prefers it to ``load_weights`` when present."""

    def load_weights_file(self, path: str | os.PathLike[str], version: int) -> None:
        """Load the HF-named tensors of ``path`` and set ``policy_version = version``."""
        ...


@runtime_checkable
class Interruptible(Protocol):
    """Optional capability: a generate call that a newer policy version can cut (partial rollout).

    Same results as ``generate`` while ``cut`` stays clear. Once ``cut`` is set, the call returns
    at the next token boundary at which every unfinished row has produced at least one token in
    this call: finished rows as usual, unfinished ones with the tokens so far (and their
    behaviour log-probs) and ``finish_reason == FINISH_CUT``. ``on_done(index, generation)`` is
    called (from the generating thread) as row ``index = i * n + j`` finishes, before the call
    returns, so a caller may write finished rows while the others still generate.
    """

    def generate_until(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
        cut: threading.Event,
        on_done: Callable[[int, Generation], None] | None = None,
    ) -> list[list[Generation]]:
        ...
