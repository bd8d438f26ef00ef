"""Greedy accuracy: the one evaluator of the warm start (its stop probe and its held-out figure)
and of the controller's held-out evaluation (docs/controller.md "The plan").

A problem counts as solved when its single greedy response (temperature 0) passes ``score``:
``exact_match_scorer`` for the warm start, ``reward_scorer`` (the run's ``reward.fn`` against
``reward.success_threshold``, run as the reward workers run it) for the controller. Imports torch
through the rollout engine: not part of the light ``workers.tasks`` the ``--dry-run`` loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from workers.engines.base import RolloutEngine, SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models.tokenizer import decode_response, encode_prompt
from workers.tasks.problem import Problem
from workers.tasks.verifiers import RewardRunner, exact_match

# (completions, answers) -> one "solved" per problem, in order; a batch, so that a reward run in
# a child process is started once per evaluation.
Scorer = Callable[[Sequence[str], Sequence[str]], list[bool]]


def exact_match_scorer(completions: Sequence[str], answers: Sequence[str]) -> list[bool]:
    """Solved: the response equals the answer after stripping whitespace."""
    return [exact_match(c, a) == 1.0 for c, a in zip(completions, answers, strict=True)]


def reward_scorer(reward_fn: str, *, success_threshold: float, timeout_s: float) -> Scorer:
    """Solved: ``reward_fn`` scores the response ``>= success_threshold``, run as the reward
    workers run it (built-ins in process, others in a child with the per-sample timeout); a
    failed score counts as unsolved."""

    def score(completions: Sequence[str], answers: Sequence[str]) -> list[bool]:
        with RewardRunner(reward_fn, timeout_s=timeout_s) as runner:
            results = runner.score(list(completions), list(answers))
        return [r.ok and r.score >= success_threshold for r in results]

    return score


def greedy_accuracy(
    engine_or_model: RolloutEngine | torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    score: Scorer = exact_match_scorer,
) -> float:
    """Fraction of ``problems`` whose greedy response ``score`` counts as solved."""
    if not problems:
        raise ValueError("greedy_accuracy: no problems")
    if isinstance(engine_or_model, torch.nn.Module):
        engine: RolloutEngine = TorchRolloutEngine(engine_or_model, tokenizer, max_batch_size=256)
    else:
        engine = engine_or_model
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    gens = engine.generate(prompts, 1, SamplingParams(temperature=0.0,
                                                      max_new_tokens=max_new_tokens))
    completions = [decode_response(tokenizer, g[0].token_ids) for g in gens]
    solved = score(completions, [p.answer for p in problems])
    if len(solved) != len(problems):
        raise ValueError(f"greedy_accuracy: the scorer returned {len(solved)} results for "
                         f"{len(problems)} problems")
    return sum(solved) / len(problems)
