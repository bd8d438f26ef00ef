"""``streamflow model train-reward OUT --config CONFIG``: a reward model for a run, made from the
run config's own policy, prompts and verifier (the training in ``workers.models.reward_train``).

The policy is the one the run would start from (``model.path``, or the built-in model
warm-started and cached exactly as ``streamflow run`` does, under ``run.output_dir``'s parent's
``.cache``); training prompts come from the task's training split (arithmetic: a stream of their
own, seeded by ``run.seed``; a prompt file: its training rows), and so do the validation prompts
the training stops on (``split_validation``: never one of the training prompts); held-out prompts
are the run's evaluation prompts; the labels are ``reward.fn`` against
``reward.success_threshold``; the target and the cap are ``reward.train_target_accuracy`` and
``reward.train_max_epochs``. Details: docs/rewards.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from streamflow.config import RunConfig
from streamflow.plan import _problems as split_problems  # the plan's one held-out rule
from streamflow.plan import resolve_model
from workers.models.reward_train import RewardRecipe, RewardReport, train_reward_model
from workers.tasks.problem import Problem

# the arithmetic stream the reward model's prompts come from: run.seed + this, so that they are
# not the first prompts of the run's own stream (data.seed)
PROMPT_STREAM_OFFSET = 7919


def split_validation(pool: Sequence[Problem], prompts: int, validation: int
                     ) -> tuple[list[Problem], list[Problem]]:
    """(training, validation) prompts from ``pool``, the task's training split in order: the
    first ``prompts``, then up to ``validation`` of the rest whose prompt is not a training one.
    A pool too short for both gives validation its last fifth (at least one)."""
    if len(pool) < prompts + validation:
        prompts = min(prompts, len(pool) - max(1, len(pool) // 5))
    train = list(pool[:max(prompts, 0)])
    seen = {p.prompt for p in train}
    rest = []
    for p in pool[len(train):]:
        if p.prompt not in seen and len(rest) < validation:
            seen.add(p.prompt)
            rest.append(p)
    return train, rest


def train_for_run(cfg: RunConfig, out_dir: str | Path, *, prompts: int, samples: int,
                  max_epochs: int | None = None, force: bool = False) -> RewardReport:
    """Train (or reuse) the reward model of ``cfg``'s policy in ``out_dir`` (``max_epochs``:
    the cap, None = ``reward.train_max_epochs``)."""
    validation = RewardRecipe.validation_prompts
    train, task, evals = split_problems(cfg)
    if task is not None:
        # the stream draws with replacement: 4x the validation prompts leave room to skip repeats
        stream = task.iterate(seed=cfg.run.seed + PROMPT_STREAM_OFFSET)
        pool = list(itertools.islice(stream, prompts + 4 * validation))
    else:
        pool = (train or [])[:prompts + validation]
    train, val = split_validation(pool, prompts, validation)
    if not train or not val or not evals:
        raise ValueError("train-reward needs training prompts (at least two), and held-out "
                         "prompts (run.eval_prompts > 0)")
    policy = resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache")
    r = cfg.reward
    recipe = RewardRecipe(target_accuracy=r.train_target_accuracy,
                          max_epochs=max_epochs or r.train_max_epochs, prompts=len(train),
                          samples=samples, validation_prompts=len(val), seed=cfg.run.seed,
                          temperature=cfg.rollout.temperature,
                          max_new_tokens=cfg.rollout.max_new_tokens)
    return train_reward_model(out_dir, policy, train, evals, recipe=recipe,
                              validation_problems=val, settings=r.scorer, verifier=r.fn,
                              threshold=r.success_threshold, timeout_s=r.timeout_s, force=force)
