"""``streamflow model train-reward OUT --config CONFIG``: a reward model for a run, made from the
run config's own policy, prompts and verifier (the training in ``workers.models.reward_train``).

The policy is the one the run would start from (``model.path``, or the built-in model
warm-started and cached exactly as ``streamflow run`` does, under ``run.output_dir``'s parent's
``.cache``); training prompts come from the task's training split (arithmetic: a stream of their
own, seeded by ``run.seed``; a prompt file: its training rows), held-out prompts are the run's
evaluation prompts; the labels are ``reward.fn`` against ``reward.success_threshold``.
Details: docs/rewards.md.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from streamflow.config import RunConfig
from streamflow.plan import _problems as split_problems  # the plan's one held-out rule
from streamflow.plan import resolve_model
from workers.models.reward_train import RewardRecipe, RewardReport, train_reward_model

# the arithmetic stream the reward model's prompts come from: run.seed + this, so that they are
# not the first prompts of the run's own stream (data.seed)
PROMPT_STREAM_OFFSET = 7919


def train_for_run(cfg: RunConfig, out_dir: str | Path, *, prompts: int, samples: int,
                  epochs: int, force: bool = False) -> RewardReport:
    """Train (or reuse) the reward model of ``cfg``'s policy in ``out_dir``."""
    train, task, evals = split_problems(cfg)
    if task is not None:
        stream = task.iterate(seed=cfg.run.seed + PROMPT_STREAM_OFFSET)
        train = list(itertools.islice(stream, prompts))
    else:
        train = (train or [])[:prompts]
    if not train or not evals:
        raise ValueError("train-reward needs training prompts and held-out prompts "
                         "(run.eval_prompts > 0)")
    policy = resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache")
    recipe = RewardRecipe(prompts=len(train), samples=samples, epochs=epochs, seed=cfg.run.seed,
                          temperature=cfg.rollout.temperature,
                          max_new_tokens=cfg.rollout.max_new_tokens)
    r = cfg.reward
    return train_reward_model(out_dir, policy, train, evals, recipe=recipe,
                              settings=r.scorer, verifier=r.fn,
                              threshold=r.success_threshold, timeout_s=r.timeout_s, force=force)
