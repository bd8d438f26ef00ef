"""The reward role: score each response with a rule-based verifier, a reward model, or both.

Writes ``reward``, ``reward_ok``, ``reward_error``. ``on_error="zero"`` trains on a failed sample
scored 0.0; ``"retry"`` hands it back as a failed delivery (a multi-row lease cleanly, then one
row per claim to isolate it). Multi-turn, it also reads each trajectory's turns, observations,
errors and ``env_reward``: a verifier of the form ``fn(completion, answer, trajectory)`` gets them
as a ``Trajectory``, and ``env_reward`` (``reward.env_reward``) replaces the verifier's score,
adds to it, or is ignored. Details: docs/training.md "The reward role".

With a reward model (``reward.model``, ``workers.models.reward_model``) it also reads the
prompt: the model scores each claimed micro-batch in batched forwards, its score is normalised
(``reward.normalize``: none, within each group, or by running statistics) and combined with the
verifier's (``reward.combine``: the model alone, a weighted sum, or the verifier as a gate).
Details: docs/rewards.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pyarrow as pa

from storage.schema import Lease
from workers.agent.piece_rows import piece_reads, read_trajectory
from workers.agent.toolcall import chat_wrapping, observation_text
from workers.runtime.leases import HandBack, with_row_ids
from workers.schema import ENV_REWARD_FIELD, REWARD_READS, piece_bound
from workers.settings import AgentSettings, RewardModelSettings
from workers.tasks.verifiers import RewardResult, RewardRunner, Trajectory, resolve_reward

ENV_REWARD_RULES = ("replace", "add", "ignore")


def trajectory_reads(bound: int) -> tuple[str, ...]:
    """The columns a multi-turn reward claim adds to ``REWARD_READS``: the pieces of a row of
    ``bound`` (all written on an ended row: its later cells as NULL)."""
    return ("finish_reason", ENV_REWARD_FIELD.name,
            *piece_reads(bound, ("ids", "version", "end", "error")))


class RewardStage:
    task = "reward"
    whole_groups = False

    def __init__(self, tokenizer: Any, reward_fn: str, *, timeout_s: float, max_rows: int,
                 on_error: str, env_reward: str, agent: AgentSettings | None = None,
                 max_cuts: int = 0, scorer: Any = None,
                 scoring: RewardModelSettings | None = None) -> None:
        if on_error not in ("retry", "zero"):
            raise ValueError(f"reward on_error must be 'retry' or 'zero', got {on_error!r}")
        if env_reward not in ENV_REWARD_RULES:
            raise ValueError(f"reward env_reward must be one of {ENV_REWARD_RULES}, got "
                             f"{env_reward!r}")
        self.tokenizer = tokenizer
        self.runner = RewardRunner(resolve_reward(reward_fn), timeout_s)
        self.max_rows = self._max_rows = max_rows
        self.on_error, self.env_reward = on_error, env_reward
        self.max_turns = agent.max_turns if agent is not None else 1
        self.plain = agent is not None and agent.env.plain
        self.wrapping = None if self.plain or self.max_turns == 1 else chat_wrapping(tokenizer)
        self.bound = piece_bound(self.max_turns, max_cuts)
        self.columns = REWARD_READS + (trajectory_reads(self.bound) if self.max_turns > 1
                                       else ())
        self._isolating = 0  # single-row claims left after a failure in a multi-row lease
        self.last_tokens = 0
        # a reward model (workers.models.reward_text.RewardModel) and how it is used
        self.scorer, self.scoring = scorer, scoring or RewardModelSettings()
        if scorer is not None:
            self.columns = (*self.columns, "prompt_ids")
            # group normalisation needs every row of a group in one claim
            self.whole_groups = self.scoring.normalize == "group"
        self.running = RunningStats()

    def process(self, lease: Lease) -> pa.RecordBatch:
        responses = lease.batch.column("response_ids").to_pylist()
        answers = lease.batch.column("answer").to_pylist()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        if self.scorer is not None:
            results = self._score_model(lease.batch, texts, answers)
        elif self.max_turns == 1:
            results = self.runner.score(texts, answers)
        else:
            results = self._score_trajectories(lease.batch.to_pylist(), texts, answers)
        if self._isolating:
            self._isolating -= 1
            if not self._isolating:
                self.max_rows = self._max_rows
        failed = [r for r in results if not r.ok]
        if failed and self.on_error == "retry":
            if lease.num_rows > 1 and not self.whole_groups:  # (whole groups: no isolating)
                self._isolating, self.max_rows = lease.num_rows, 1
                raise HandBack(None)
            raise HandBack(f"reward: {failed[0].error}")
        self.last_tokens = sum(len(r) for r in responses)
        return with_row_ids(lease, {
            "reward": pa.array([r.score for r in results], pa.float32()),
            "reward_ok": pa.array([r.ok for r in results], pa.bool_()),
            "reward_error": pa.array([r.error for r in results], pa.string()),
        })

    def _score_model(self, batch: pa.RecordBatch, texts: list[str],
                     answers: list[str]) -> list[RewardResult]:
        """The reward model's scores, normalised, combined with the verifier's."""
        s = self.scoring
        prompts = self.tokenizer.batch_decode(batch.column("prompt_ids").to_pylist(),
                                              skip_special_tokens=True)
        model = self.scorer.score(prompts, texts, answers)
        values = [r.score for r in model]
        ok = [r.ok for r in model]
        if s.normalize == "group":
            values = group_normalized(values, ok, batch.column("group_id").to_pylist())
        elif s.normalize == "running":
            self.running.update(v for v, good in zip(values, ok, strict=True) if good)
            values = [self.running.normalize(v) for v in values]
        if s.combine == "model":
            return [RewardResult(v, r.ok, r.error) for v, r in zip(values, model, strict=True)]
        verifier = self.runner.score(texts, answers)
        out = []
        for v, m, r in zip(values, model, verifier, strict=True):
            score = (s.model_weight * v + s.verifier_weight * r.score if s.combine == "sum"
                     else (v if r.score > 0 else 0.0))
            out.append(RewardResult(score if m.ok and r.ok else 0.0, m.ok and r.ok,
                                    m.error or r.error))
        return out

    def _score_trajectories(self, rows: list[dict[str, Any]], texts: list[str],
                            answers: list[str]) -> list[RewardResult]:
        """Each row's score under ``env_reward``: "replace" runs the verifier only on the rows
        without an environment reward."""
        trajs = [self.trajectory(row) for row in rows]
        env = [t.env_reward if self.env_reward != "ignore" else None for t in trajs]
        todo = [i for i, r in enumerate(env) if r is None or self.env_reward == "add"]
        scored = self.runner.score([texts[i] for i in todo], [answers[i] for i in todo],
                                   [trajs[i] for i in todo])
        results = [RewardResult(r, True) if r is not None else None for r in env]
        for i, res in zip(todo, scored, strict=True):
            results[i] = (res if env[i] is None else
                          RewardResult(res.score + float(env[i]), res.ok, res.error))
        return [r for r in results if r is not None]

    def trajectory(self, row: dict[str, Any]) -> Trajectory:
        """The ``Trajectory`` of a claimed row (``trajectory_reads``)."""
        def decode(ids: list[int], special: bool) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=not special)

        hist, tail = read_trajectory(row, self.bound)
        turns = [decode(t.ids, False) for t in hist.turns()]
        answered = hist.observations() + ([tail] if tail is not None else [])
        errors = [p.error for p in answered]  # each call the environment answered
        observations = [observation_text(decode(list(p.ids), True), self.plain, self.wrapping)
                        for p in hist.observations()]
        env_reward = row[ENV_REWARD_FIELD.name]
        return Trajectory(tuple(turns), tuple(observations), tuple(errors), len(errors),
                          None if env_reward is None else float(env_reward),
                          row["finish_reason"] or "")

    def close(self) -> None:
        self.runner.close()


def group_normalized(values: list[float], ok: list[bool], groups: list[int]) -> list[float]:
    """Each score minus its group's mean over the rows scored ok, over that group's std (a group
    without spread: 0). A failed row keeps 0."""
    members: dict[int, list[float]] = defaultdict(list)
    for v, good, g in zip(values, ok, groups, strict=True):
        if good:
            members[g].append(v)
    out = []
    for v, good, g in zip(values, ok, groups, strict=True):
        xs = members[g]
        mean = sum(xs) / len(xs) if xs else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) if xs else 0.0
        out.append((v - mean) / (std + 1e-6) if good and std > 0 else 0.0)
    return out


class RunningStats:
    """Mean and variance of every score seen (Welford); ``normalize`` z-scores by them."""

    def __init__(self) -> None:
        self.count, self.mean, self._m2 = 0, 0.0, 0.0

    def update(self, values: Any) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.count) if self.count > 1 else 0.0

    def normalize(self, x: float) -> float:
        return (x - self.mean) / (self.std + 1e-6) if self.std > 0 else x - self.mean
