"""The reward role: score each response with a rule-based verifier.

Writes ``reward``, ``reward_ok``, ``reward_error``. ``on_error="zero"`` trains on a failed sample
scored 0.0; ``"retry"`` hands it back as a failed delivery (a multi-row lease cleanly, then one
row per claim to isolate it). Details: docs/training.md "The reward role".
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from storage.schema import Lease
from workers.roles.loop import HandBack, with_row_ids
from workers.schema import REWARD_READS
from workers.tasks.verifiers import RewardRunner, resolve_reward


class RewardStage:
    task = "reward"
    columns = REWARD_READS
    whole_groups = False

    def __init__(self, tokenizer: Any, reward_fn: str, *, timeout_s: float, max_rows: int,
                 on_error: str = "retry") -> None:
        if on_error not in ("retry", "zero"):
            raise ValueError(f"reward on_error must be 'retry' or 'zero', got {on_error!r}")
        self.tokenizer = tokenizer
        self.runner = RewardRunner(resolve_reward(reward_fn), timeout_s)
        self.max_rows = self._max_rows = max_rows
        self.on_error = on_error
        self._isolating = 0  # single-row claims left after a failure in a multi-row lease
        self.last_tokens = 0

    def process(self, lease: Lease) -> pa.RecordBatch:
        responses = lease.batch.column("response_ids").to_pylist()
        answers = lease.batch.column("answer").to_pylist()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        results = self.runner.score(texts, answers)
        if self._isolating:
            self._isolating -= 1
            if not self._isolating:
                self.max_rows = self._max_rows
        failed = [r for r in results if not r.ok]
        if failed and self.on_error == "retry":
            if lease.num_rows > 1:
                self._isolating, self.max_rows = lease.num_rows, 1
                raise HandBack(None)
            raise HandBack(f"reward: {failed[0].error}")
        self.last_tokens = sum(len(r) for r in responses)
        return with_row_ids(lease, {
            "reward": pa.array([r.score for r in results], pa.float32()),
            "reward_ok": pa.array([r.ok for r in results], pa.bool_()),
            "reward_error": pa.array([r.error for r in results], pa.string()),
        })

    def close(self) -> None:
        self.runner.close()
