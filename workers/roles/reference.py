"""The reference role: log-probs of each response under the frozen reference model.

Writes ``ref_logprobs`` at the trainer's temperature, packing a claim's rows of one prompt when
packing is on. Off when the KL coefficient is 0; fused into the trainer with
``reference.placement = trainer``, run by the rollout worker after it generates with
``reference.placement = rollout`` (docs/training.md "The reference role").
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import torch

from storage.schema import Lease
from workers.rl.packing import PackGroup, packed_response_logprobs
from workers.rl.packing_layout import forward_slices
from workers.roles.loop import with_row_ids
from workers.schema import REFERENCE_READS
from workers.settings import PackingSettings


def rows_to_groups(batch: pa.RecordBatch) -> tuple[list[PackGroup], list[tuple[int, int]]]:
    """A batch's rows grouped by ``group_id`` (they share their prompt), and per row its
    (group index, response index) so results map back."""
    group_ids = batch.column("group_id").to_pylist()
    prompts = batch.column("prompt_ids").to_pylist()
    responses = batch.column("response_ids").to_pylist()
    index: dict[int, int] = {}
    members: dict[int, list[list[int]]] = defaultdict(list)
    groups: list[PackGroup] = []
    where: list[tuple[int, int]] = []
    for gid, prompt, response in zip(group_ids, prompts, responses, strict=True):
        if gid not in index:
            index[gid] = len(groups)
            groups.append(PackGroup(group_id=gid, prompt_ids=prompt, responses=members[gid]))
        where.append((index[gid], len(members[gid])))
        members[gid].append(response)
    return groups, where


class ReferenceScorer:
    """The frozen reference model and how it scores rows: log-probs of each response at the
    sampling temperature, a batch's rows of one prompt packed when packing pays. Used by the
    reference worker and, with ``reference.placement = rollout``, by the rollout worker right
    after it generates (docs/training.md "The reference role")."""

    def __init__(self, model: torch.nn.Module, *, temperature: float,
                 pack: PackingSettings) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = temperature
        self.pack = pack

    @torch.inference_mode()  # its log-probs leave as Arrow lists: never part of a graph
    def score(self, batch: pa.RecordBatch) -> pa.ListArray:
        """``ref_logprobs`` of ``batch``'s rows (it needs group_id, prompt_ids, response_ids)."""
        groups, where = rows_to_groups(batch)
        sizes = [sum(len(g.prompt_ids) + len(r) for r in g.responses) for g in groups]
        logprobs: list[list[torch.Tensor]] = []
        for part in forward_slices(sizes, self.pack.tokens_per_forward):  # whole groups each
            logprobs += packed_response_logprobs(
                self.model, groups[part.start : part.stop], temperature=self.temperature,
                token_budget=self.pack.token_budget, pack=self.pack.packing,
                min_saving=self.pack.packing_min_saving)
        # One copy to the host for the whole batch (on a GPU each row's copy would wait for the
        # device), then the list column straight from the flat values and their offsets.
        pieces = [logprobs[g][r] for g, r in where]
        offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
        np.cumsum([p.shape[0] for p in pieces], out=offsets[1:])
        flat = (torch.cat(pieces).float().cpu().numpy() if pieces
                else np.empty(0, dtype=np.float32))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()))


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
