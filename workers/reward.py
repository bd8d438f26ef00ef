"""The reward role: score each response with a rule-based verifier.

Claims ``response_ids`` (+ ``answer``), decodes the tokens to text, scores every sample with the
configured verifier under a per-sample timeout, and writes ``reward``, ``reward_ok`` and
``reward_error``. A verifier that raises or times out scores that sample 0.0 with the reason
recorded; it never kills the worker (see ``workers.rewards.RewardRunner``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from storage.schema import Lease
from workers.loop import with_row_ids
from workers.rewards import RewardRunner, resolve_reward


class RewardStage:
    task = "reward"
    columns = ("response_ids", "answer", "iteration")
    whole_groups = False

    def __init__(self, tokenizer: Any, reward_fn: str, *, timeout_s: float, max_rows: int) -> None:
        self.tokenizer = tokenizer
        self.runner = RewardRunner(resolve_reward(reward_fn), timeout_s)
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> pa.RecordBatch:
        responses = lease.batch.column("response_ids").to_pylist()
        answers = lease.batch.column("answer").to_pylist()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        results = self.runner.score(texts, answers)
        self.last_tokens = sum(len(r) for r in responses)
        return with_row_ids(
            lease,
            {
                "reward": pa.array([r.score for r in results], pa.float32()),
                "reward_ok": pa.array([r.ok for r in results], pa.bool_()),
                "reward_error": pa.array([r.error for r in results], pa.string()),
            },
        )

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
