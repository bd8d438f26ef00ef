"""The reference role: log-probs of each response under the frozen reference model.

Writes ``ref_logprobs`` at the trainer's temperature, scored by ``workers.rl.reference``'s
``ReferenceScorer`` (packing, forward slices, temperature: the owner the trainer's fused reference
shares). Off when the KL coefficient is 0; fused into the trainer with
``reference.placement = trainer``, run by the rollout worker after it generates with
``reference.placement = rollout`` (docs/training.md "The reference role").
"""

from __future__ import annotations

import pyarrow as pa

from storage.schema import Lease
from workers.rl.reference import ReferenceScorer, rows_to_groups
from workers.runtime.leases import with_row_ids
from workers.schema import REFERENCE_READS

# the scorer is workers.rl.reference's (shared with the trainer's fused reference); importable here
__all__ = ["ReferenceScorer", "ReferenceStage", "rows_to_groups"]


class ReferenceStage:
    task = "reference"
    columns = REFERENCE_READS
    whole_groups = False

    def __init__(self, scorer: ReferenceScorer, *, max_rows: int) -> None:
        self.scorer = scorer
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> pa.RecordBatch:
        column = self.scorer.score(lease.batch)
        self.last_tokens = len(column.values)
        return with_row_ids(lease, {"ref_logprobs": column})
