"""The frozen reference: log-probs of responses under the reference model, the one owner of
"score these rows with the frozen reference" for every placement.

The packing decision is ``workers.rl.packing.choose_layout``. ``FrozenReference`` scores a
layout at a temperature: the trainer's fused reference (``workers.rl.trimodel``) on the
layout its policy runs. ``ReferenceScorer`` adds the settings: temperature, packing and forward
slices of whole groups by ``tokens_per_forward``, Arrow rows in and ``ref_logprobs`` out (the
reference worker, and the rollout's copy with ``reference.placement = rollout``).
Invariant: the reference never takes a gradient (frozen, scored without autograd). It scores
every response token, environment tokens of a multi-turn response included (``ref_logprobs`` has
one value per token): the ``response_loss_mask`` matters only in the loss, which masks the KL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch

from workers.rl.packing import PackedBatch, PackGroup, batch_logprobs, choose_layout
from workers.rl.packing_layout import forward_slices
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


class FrozenReference:
    """The frozen reference model (no gradients, eval mode, on ``device`` in ``dtype`` when
    given) and its log-probs of a layout."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        model.requires_grad_(False)
        model.eval()
        self.model = model.to(device=device, dtype=dtype)

    @torch.no_grad()  # not inference_mode: the fused reference's log-probs enter the loss
    def logprobs(self, batch: PackedBatch, temperature: float) -> list[list[torch.Tensor]]:
        """Per group and response, float32 token log-probs ``[L_i]`` of ``batch``."""
        return batch_logprobs(self.model, batch, temperature=temperature)


class ReferenceScorer(FrozenReference):
    """The frozen reference and how it scores rows: log-probs of each response at the sampling
    temperature, a batch's rows of one prompt packed when packing pays, in forwards of whole
    groups of at most ``pack.tokens_per_forward`` tokens (docs/training.md "The reference role")."""

    def __init__(self, model: torch.nn.Module, *, temperature: float,
                 pack: PackingSettings) -> None:
        super().__init__(model)
        self.temperature = temperature
        self.pack = pack

    def score_groups(self, groups: Sequence[PackGroup]) -> list[list[torch.Tensor]]:
        """Per group and response, the token log-probs ``[L_i]``."""
        sizes = [sum(len(g.prompt_ids) + len(r) for r in g.responses) for g in groups]
        out: list[list[torch.Tensor]] = []
        for part in forward_slices(sizes, self.pack.tokens_per_forward):  # whole groups each
            layout = choose_layout(
                groups[part.start : part.stop], [self.model], pack=self.pack.packing,
                min_saving=self.pack.packing_min_saving, token_budget=self.pack.token_budget)
            out += self.logprobs(layout, self.temperature)
        return out

    @torch.inference_mode()  # its log-probs leave as Arrow lists: never part of a graph
    def score(self, batch: pa.RecordBatch) -> pa.ListArray:
        """``ref_logprobs`` of ``batch``'s rows (it needs group_id, prompt_ids, response_ids)."""
        groups, where = rows_to_groups(batch)
        logprobs = self.score_groups(groups)
        # One copy to the host for the whole batch (on a GPU each row's copy would wait for the
        # device), then the list column straight from the flat values and their offsets.
        pieces = [logprobs[g][r] for g, r in where]
        offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
        np.cumsum([p.shape[0] for p in pieces], out=offsets[1:])
        flat = (torch.cat(pieces).float().cpu().numpy() if pieces
                else np.empty(0, dtype=np.float32))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()))
