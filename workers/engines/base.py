"""The rollout engine contract: sampling parameters, one generation, and the ``RolloutEngine`` protocol.

Owns the records every rollout engine speaks. Invariants an implementation must keep:
- ``generate`` returns, for each prompt in order, exactly ``n`` ``Generation``s.
- Behaviour log-probs: ``logprobs[i]`` is ``log_softmax(logits / temperature)[token_ids[i]]``
  computed in float32 over the FULL vocabulary, i.e. BEFORE top-p truncation. The trainer
  recomputes log-probs with the same temperature and no truncation, so with identical weights its
  ratio to the behaviour log-probs is exactly 1 (to float rounding). With ``temperature == 0``
  (greedy, argmax), log-probs are those of the untempered distribution (temperature 1).
- A generation ends right after a stop token (``stop_token_ids`` plus the engine's own eos ids),
  which IS included in ``token_ids`` with its log-prob (``finish_reason="stop"``), or after
  ``max_new_tokens`` tokens (``finish_reason="length"``).
- ``policy_version`` is the version passed to the last ``load_weights`` (the initial weights are
  whatever version the engine was built with, usually 0).
- Same ``seed``, prompts, parameters and weights -> same outputs.
- ``prompt_seeds`` (one per prompt): prompt i's samples depend only on ``prompt_seeds[i]``, its
  prompt, the parameters and the weights, never on the other prompts of the call (up to float
  rounding of batched logits): a group samples the same responses alone or batched with others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the records and the protocol need no torch at import
    import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    prompt_seeds: tuple[int, ...] = ()  # per-prompt seeds (override ``seed``; see module doc)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_seeds", tuple(int(s) for s in self.prompt_seeds))


def prompt_seeds_of(params: SamplingParams, num_prompts: int, n: int) -> list[int] | None:
    """The seed of each prompt's samples (sample j uses seed + j); None when unseeded.

    ``params.prompt_seeds`` when given (one per prompt), else ``params.seed + i * n`` for prompt i
    (so no two samples of one call share a seed).
    """
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


@dataclass
class Generation:
    """One sampled response."""

    token_ids: list[int] = field(default_factory=list)  # [L] response tokens (stop token included)
    logprobs: list[float] = field(default_factory=list)  # [L] behaviour log-probs, see module doc
    finish_reason: str = FINISH_LENGTH  # "stop" | "length"


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
    """Optional capability: load a published policy version straight from its safetensors file.

    The trainer publishes every version as one file (``workers.weights``). An engine that can read
    that file itself (vLLM: inside its own worker process) skips the round trip of reading the
    tensors into the rollout process only to hand them over again; ``RolloutStage`` prefers this
    method when the engine has it. Same effect as ``load_weights`` with the file's tensors.
    """

    def load_weights_file(self, path: str | os.PathLike[str], version: int) -> None:
        """Load the HF-named tensors of ``path`` and set ``policy_version = version``."""
        ...
