"""Greedy accuracy: the one evaluator of the warm start (its stop probe and its held-out figure)
and of the controller's held-out evaluation (docs/controller.md "The plan").

A problem counts as solved when its greedy response (temperature 0) passes ``score``. With an
``agent`` of more than one turn the response is a whole trajectory made by the rollout's and the
environment role's own piece code (``Rules``, ``observe``), the environment in this process:
held-out accuracy then measures the model with its tools, and the scorer also gets each problem's
``Trajectory`` (as the reward role reads it). Otherwise it is one generation, as it always was.
Scorers:
``exact_match_scorer`` for the warm start, ``reward_scorer`` (the run's ``reward.fn`` against
``reward.success_threshold``, run as the reward workers run it) for the controller. Imports torch
through the rollout engine: not part of the light ``workers.tasks`` the ``--dry-run`` loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from workers.agent.observe import make_environment, observe
from workers.agent.pieces import TO_ENV, History, Rules, assemble, context_ids, observation
from workers.agent.toolcall import chat_wrapping, marker_ids, observation_text
from workers.engines.base import RolloutEngine, SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models.tokenizer import decode_response, encode_prompt
from workers.settings import AgentSettings
from workers.tasks.problem import Problem
from workers.tasks.verifiers import RewardRunner, Trajectory, exact_match

# (completions, answers[, trajectories]) -> one "solved" per problem, in order; a batch, so that
# a reward run in a child process is started once per evaluation. The trajectories are passed
# for multi-turn problems only.
Scorer = Callable[..., list[bool]]


def exact_match_scorer(completions: Sequence[str], answers: Sequence[str],
                       trajectories: Sequence[Trajectory] | None = None) -> list[bool]:
    """Solved: the response equals the answer after stripping whitespace."""
    return [exact_match(c, a) == 1.0 for c, a in zip(completions, answers, strict=True)]


def reward_scorer(reward_fn: str, *, success_threshold: float, timeout_s: float) -> Scorer:
    """Solved: ``reward_fn`` scores the response ``>= success_threshold``, run as the reward
    workers run it (built-ins in process, others in a child with the per-sample timeout); a
    failed score counts as unsolved."""

    def score(completions: Sequence[str], answers: Sequence[str],
              trajectories: Sequence[Trajectory] | None = None) -> list[bool]:
        with RewardRunner(reward_fn, timeout_s=timeout_s) as runner:
            results = runner.score(list(completions), list(answers),
                                   None if trajectories is None else list(trajectories))
        return [r.ok and r.score >= success_threshold for r in results]

    return score


def greedy_accuracy(
    engine_or_model: RolloutEngine | torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    score: Scorer = exact_match_scorer,
    agent: AgentSettings | None = None,
) -> float:
    """Fraction of ``problems`` whose greedy response ``score`` counts as solved (``agent``: a
    trajectory with its tools, see the module docstring)."""
    if not problems:
        raise ValueError("greedy_accuracy: no problems")
    if isinstance(engine_or_model, torch.nn.Module):
        engine: RolloutEngine = TorchRolloutEngine(engine_or_model, tokenizer, max_batch_size=256)
    else:
        engine = engine_or_model
    completions, trajectories = greedy_trajectories(
        engine, tokenizer, problems, max_new_tokens=max_new_tokens, agent=agent)
    answers = [p.answer for p in problems]
    solved = (score(completions, answers) if trajectories is None
              else score(completions, answers, trajectories))
    if len(solved) != len(problems):
        raise ValueError(f"greedy_accuracy: the scorer returned {len(solved)} results for "
                         f"{len(problems)} problems")
    return sum(solved) / len(problems)


def greedy_completions(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase,
                       problems: Sequence[Problem], *, max_new_tokens: int,
                       agent: AgentSettings | None = None) -> list[str]:
    """The greedy response text of each problem: one generation, or (``agent`` with
    ``max_turns`` > 1) the trajectory, observations included, as the reward sees it."""
    return greedy_trajectories(engine, tokenizer, problems, max_new_tokens=max_new_tokens,
                               agent=agent)[0]


def greedy_trajectories(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase,
                        problems: Sequence[Problem], *, max_new_tokens: int,
                        agent: AgentSettings | None = None
                        ) -> tuple[list[str], list[Trajectory] | None]:
    """``greedy_completions``' texts and, multi-turn, each problem's ``Trajectory`` (None for
    one generation)."""
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    if agent is None or agent.max_turns <= 1:
        gens = engine.generate(prompts, 1, greedy)
        return [decode_response(tokenizer, g[0].token_ids) for g in gens], None
    rules = Rules(agent.max_turns, max_new_tokens, agent.max_total_tokens,
                  marker_ids(tokenizer, agent.format))
    env = make_environment(agent)
    wrapping = None if agent.env.plain else chat_wrapping(tokenizer)  # as the environment role's
    hists = [History() for _ in problems]
    ends: list[str | None] = [None] * len(problems)
    errors: list[list[str | None]] = [[] for _ in problems]  # per executed call
    rewards: list[float | None] = [None] * len(problems)  # the environment's, when it ended one
    try:
        for _ in range(agent.max_turns):
            live = [i for i, end in enumerate(ends) if end is None]
            if not live:
                break
            gens = engine.generate([context_ids(prompts[i], hists[i]) for i in live], 1,
                                   rules.params(greedy, [hists[i] for i in live]))
            for i, gen in zip(live, gens, strict=True):
                piece = rules.close(gen[0], hists[i], version=0, seed=None)
                then = rules.then(piece, hists[i])
                hists[i] = hists[i].then(piece)
                ends[i] = None if then == TO_ENV else then
                if then == TO_ENV:  # a tool call: the environment answers it
                    obs, ids, ends[i] = observe(
                        env, tokenizer, problems[i].prompt, problems[i].answer, hists[i],
                        plain=agent.env.plain, max_observation_tokens=agent.max_observation_tokens,
                        max_total_tokens=agent.max_total_tokens, allowed=agent.env.tools,
                        wrapping=wrapping)
                    errors[i].append(obs.error)
                    rewards[i] = obs.reward if obs.done else None
                    if ends[i] is None:
                        hists[i] = hists[i].then(observation(ids, obs.error))
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()

    def trajectory(i: int) -> Trajectory:  # as workers.roles.reward.RewardStage reads a row
        h = hists[i]
        return Trajectory(
            tuple(decode_response(tokenizer, t.ids) for t in h.turns()),
            tuple(observation_text(tokenizer.decode(list(o.ids), skip_special_tokens=False),
                                   agent.env.plain, wrapping) for o in h.observations()),
            tuple(errors[i]), len(errors[i]), rewards[i], ends[i] or "")

    return ([decode_response(tokenizer, assemble(h, "").response_ids) for h in hists],
            [trajectory(i) for i in range(len(problems))])
