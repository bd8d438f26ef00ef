"""Shared-prompt packing, the layout half: which tokens go where (``pack_groups`` ->
``PackedBatch``, ``unpacked_rows``) and when packing pays (``token_saving``, ``should_pack``).
No model here; see docs/engines.md, "Shared-prompt packing". A response is laid out whole,
environment tokens included: the loss mask is applied to the log-probs, never to the layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.settings import PackingSettings


class PackingError(ValueError):
    """The groups or packing parameters are invalid (the message names what and where)."""


class PackingUnsupportedError(RuntimeError):
    """A packed batch was given to a model that cannot run the shared-prompt layout."""


class PackingFallbackWarning(UserWarning):
    """Packing was requested for a model that cannot take it; unpacked rows are used instead."""


@dataclass
class PackGroup:
    """One prompt and the responses sampled from it (token ids, no padding)."""

    group_id: int
    prompt_ids: list[int]
    responses: list[list[int]]


@dataclass(frozen=True)
class PackChunk:
    """One prompt copy and the responses that follow it inside one row."""

    group_index: int  # index of the group in the input list
    row: int
    prompt_start: int
    prompt_len: int
    response_indices: tuple[int, ...]  # indices into the group's responses
    response_starts: tuple[int, ...]
    response_lens: tuple[int, ...]


@dataclass
class PackedBatch:
    """Model inputs for a list of groups plus the map from logits back to response tokens:
    ``target_*`` are flat over (group, response, token) in input order (``response_lengths`` splits
    them back); the logits at ``(target_row[n], target_pos[n])`` score ``target_token[n]``."""

    input_ids: torch.Tensor  # [R, T] long
    position_ids: torch.Tensor  # [R, T] long
    token_mask: torch.Tensor  # [R, T] bool, real (non-pad) tokens
    score_mask: torch.Tensor  # [R, T] bool, positions whose logits score some response token
    target_row: torch.Tensor  # [N] long
    target_pos: torch.Tensor  # [N] long
    target_token: torch.Tensor  # [N] long
    target_keep_index: torch.Tensor  # [N] long, index into the row-major True entries of score_mask
    response_lengths: list[list[int]]  # per group, per response
    group_ids: list[int]
    chunks: list[PackChunk]
    packed: bool  # False: one prompt+response per row, plain causal attention
    _dense_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def scored_width(self) -> int:
        """Columns up to and including the last one that holds a scored position (all if none):
        with causal attention the columns after it feed no scored logit."""
        cols = self.score_mask.any(dim=0).nonzero()
        return int(cols[-1]) + 1 if len(cols) else self.seq_len

    @property
    def num_tokens(self) -> int:
        """Real tokens that go through the model (what the linear layers pay for)."""
        return int(self.token_mask.sum())

    @property
    def attention_mask(self) -> torch.Tensor:
        """The dense ``[R, 1, T, T]`` bool mask (True = may attend); built on demand."""
        if self._dense_mask is None:
            rows, width = self.num_rows, self.seq_len
            mask = torch.zeros(rows, 1, width, width, dtype=torch.bool)
            idx = torch.arange(width)
            mask[:, 0, idx, idx] = True  # pads see themselves only
            for c in self.chunks:
                ps, pl = c.prompt_start, c.prompt_len
                mask[c.row, 0, ps : ps + pl, ps : ps + pl] = torch.ones(pl, pl).tril().bool()
                for s, n in zip(c.response_starts, c.response_lens, strict=True):
                    mask[c.row, 0, s : s + n, ps : ps + pl] = True
                    mask[c.row, 0, s : s + n, s : s + n] = torch.ones(n, n).tril().bool()
            self._dense_mask = mask
        return self._dense_mask


def token_saving(groups: Sequence[PackGroup]) -> float:
    """``1 - packed / unpacked`` real tokens: unpacked, every non-empty response carries its own
    prompt copy; packed, a group pays for it once (extra copies of a split group are ignored)."""
    unpacked = packed = 0
    for g in groups:
        responses = [len(r) for r in g.responses if len(r) > 0]
        if not responses:
            continue
        unpacked += len(responses) * len(g.prompt_ids) + sum(responses)
        packed += len(g.prompt_ids) + sum(responses)
    return 1.0 - packed / unpacked if unpacked else 0.0


def should_pack(groups: Sequence[PackGroup],
                min_saving: float = PackingSettings.packing_min_saving) -> bool:
    """Whether packing ``groups`` pays: their token saving reaches ``min_saving`` (0: always;
    trainer.packing_min_saving, docs/engines.md "Shared-prompt packing")."""
    return min_saving <= 0.0 or token_saving(groups) >= min_saving


def _validate(groups: Sequence[PackGroup], token_budget: int, max_per_row: int | None) -> None:
    if not groups:
        raise PackingError("no groups to pack")
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 2:
        raise PackingError(f"token_budget must be an int >= 2, got {token_budget!r}")
    if max_per_row is not None and (not isinstance(max_per_row, int) or max_per_row < 1):
        raise PackingError(
            f"max_responses_per_row must be None or an int >= 1, got {max_per_row!r}")
    seen: set[int] = set()
    for g in groups:
        if g.group_id in seen:
            raise PackingError(f"group_id {g.group_id} appears twice in one batch")
        seen.add(g.group_id)
        if len(g.prompt_ids) == 0:
            raise PackingError(f"group {g.group_id}: empty prompt (nothing to score token 0 from)")
        for i, r in enumerate(g.responses):
            if len(g.prompt_ids) + len(r) > token_budget:
                raise PackingError(
                    f"group {g.group_id} response {i}: prompt ({len(g.prompt_ids)}) + response "
                    f"({len(r)}) tokens exceed token_budget={token_budget}")
        for ids in [g.prompt_ids, *g.responses]:
            if len(ids) > 0 and min(ids) < 0:
                raise PackingError(f"group {g.group_id}: negative token id")


def _plan_chunks(groups: Sequence[PackGroup], token_budget: int,
                 max_per_row: int | None) -> list[tuple[int, list[int]]]:
    """Split each group into (group index, response indices) chunks that fit one row."""
    plan: list[tuple[int, list[int]]] = []
    for gi, g in enumerate(groups):
        cur: list[int] = []
        used = len(g.prompt_ids)
        for ri, r in enumerate(g.responses):
            if len(r) == 0:
                continue  # nothing to score; it gets an empty tensor
            full = max_per_row is not None and len(cur) >= max_per_row
            if cur and (full or used + len(r) > token_budget):
                plan.append((gi, cur))
                cur, used = [], len(g.prompt_ids)
            cur.append(ri)
            used += len(r)
        if cur:
            plan.append((gi, cur))
    return plan


def pack_groups(groups: Sequence[PackGroup], *, token_budget: int,
                max_responses_per_row: int | None = None, pad_id: int = 0) -> PackedBatch:
    """Pack groups as ``prompt + r1 + r2 + ...`` chunks into rows of at most ``token_budget``."""
    _validate(groups, token_budget, max_responses_per_row)
    rows_used: list[int] = []
    placed: list[tuple[int, list[int], int, int]] = []  # (group, responses, row, start)
    for gi, resp in _plan_chunks(groups, token_budget, max_responses_per_row):
        g = groups[gi]
        size = len(g.prompt_ids) + sum(len(g.responses[i]) for i in resp)
        # First fit: the earliest row with room keeps the layout deterministic.
        row = next((r for r, u in enumerate(rows_used) if u + size <= token_budget), None)
        if row is None:
            row = len(rows_used)
            rows_used.append(0)
        placed.append((gi, resp, row, rows_used[row]))
        rows_used[row] += size
    return _assemble(groups, placed, max(rows_used, default=1), pad_id, packed=True)


def unpacked_rows(groups: Sequence[PackGroup], *, pad_id: int = 0) -> PackedBatch:
    """One right-padded ``prompt + response`` row per response: the reference layout."""
    budget = max(len(g.prompt_ids) + max((len(r) for r in g.responses), default=0) for g in groups)
    _validate(groups, max(budget, 2), None)
    placed: list[tuple[int, list[int], int, int]] = []
    for gi, g in enumerate(groups):
        for ri, r in enumerate(g.responses):
            if len(r) > 0:
                placed.append((gi, [ri], len(placed), 0))
    return _assemble(groups, placed, budget, pad_id, packed=False)


def _assemble(groups: Sequence[PackGroup], placed: list[tuple[int, list[int], int, int]],
              width: int, pad_id: int, *, packed: bool) -> PackedBatch:
    num_rows = max(max((row for _, _, row, _ in placed), default=-1) + 1, 1)
    # Every placed prompt and response is a segment (row, first column, first position, tokens);
    # the segments are laid out by numpy in one pass (one Python step per segment, none per
    # token: a 128-row batch is ~9k tokens).
    seg_row: list[int] = []
    seg_col: list[int] = []
    seg_pos: list[int] = []
    seg_tokens: list[Sequence[int]] = []
    where: dict[tuple[int, int], tuple[int, int, int]] = {}  # (g, r) -> (row, start, prompt_end)
    chunks: list[PackChunk] = []
    for gi, resp, row, start in placed:
        g = groups[gi]
        plen = len(g.prompt_ids)
        seg_row.append(row)
        seg_col.append(start)
        seg_pos.append(0)
        seg_tokens.append(g.prompt_ids)
        cursor, starts, lens = start + plen, [], []
        for ri in resp:
            r = g.responses[ri]
            seg_row.append(row)
            seg_col.append(cursor)
            seg_pos.append(plen)
            seg_tokens.append(r)
            where[(gi, ri)] = (row, cursor, start + plen)
            starts.append(cursor)
            lens.append(len(r))
            cursor += len(r)
        chunks.append(PackChunk(gi, row, start, plen, tuple(resp), tuple(starts), tuple(lens)))
    lengths = np.fromiter((len(t) for t in seg_tokens), np.int64, len(seg_tokens))
    offset = steps_within(lengths)
    rows = np.repeat(np.asarray(seg_row, np.int64), lengths)
    cols = np.repeat(np.asarray(seg_col, np.int64), lengths) + offset
    ids = np.full((num_rows, width), int(pad_id), np.int64)
    ids[rows, cols] = np.fromiter(itertools.chain.from_iterable(seg_tokens), np.int64, len(rows))
    positions = np.zeros((num_rows, width), np.int64)
    positions[rows, cols] = np.repeat(np.asarray(seg_pos, np.int64), lengths) + offset
    mask = np.zeros((num_rows, width), np.bool_)
    mask[rows, cols] = True
    # Scored targets, response by response in group order: token 0 is scored from the prompt's
    # last position, token j from the response's token j - 1.
    scored = [(where[(gi, ri)], r) for gi, g in enumerate(groups)
              for ri, r in enumerate(g.responses) if len(r) > 0]
    r_len = np.fromiter((len(r) for _, r in scored), np.int64, len(scored))
    r_row, r_start, r_prompt_end = (np.fromiter((w[k] for w, _ in scored), np.int64, len(scored))
                                    for k in range(3))
    step = steps_within(r_len)
    t_row = np.repeat(r_row, r_len)
    t_pos = np.where(step == 0, np.repeat(r_prompt_end - 1, r_len),
                     np.repeat(r_start, r_len) + step - 1)
    t_tok = np.fromiter(itertools.chain.from_iterable(r for _, r in scored), np.int64, len(t_row))
    score = np.zeros((num_rows, width), np.bool_)
    score[t_row, t_pos] = True
    keep_rank = np.cumsum(score.ravel()) - 1
    target_row, target_pos = torch.from_numpy(t_row), torch.from_numpy(t_pos)
    return PackedBatch(
        torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(mask),
        torch.from_numpy(score), target_row, target_pos,
        target_token=torch.from_numpy(t_tok),
        target_keep_index=torch.from_numpy(keep_rank[t_row * width + t_pos]),
        response_lengths=[[len(r) for r in g.responses] for g in groups],
        group_ids=[g.group_id for g in groups], chunks=chunks, packed=packed)


def forward_slices(sizes: Sequence[int], tokens_per_forward: int) -> list[range]:
    """Contiguous slices of items (groups of ``sizes`` tokens) for separate forwards: one slice
    when all fit in ``tokens_per_forward`` (or it is 0); else the fewest slices that fit, near
    equal: a slice closes once it holds an equal share of what is left (``left / ceil(left /
    budget)``) or when the next item would overflow the budget. An item is never split: one
    above the budget is a slice alone."""
    total = sum(sizes)
    if tokens_per_forward <= 0 or total <= tokens_per_forward:
        return [range(len(sizes))] if sizes else []
    slices: list[range] = []
    start = in_slice = 0
    left = total
    share = left / -(-left // tokens_per_forward)
    for i, n in enumerate(sizes):
        if i > start and (in_slice >= share or in_slice + n > tokens_per_forward):
            slices.append(range(start, i))
            left -= in_slice
            share = left / -(-left // tokens_per_forward)
            start, in_slice = i, 0
        in_slice += n
    slices.append(range(start, len(sizes)))
    return slices


def steps_within(lengths: np.ndarray) -> np.ndarray:
    """Each element's index within its segment, segments laid end to end: ``[2, 3]`` gives
    ``[0, 1, 0, 1, 2]`` (how flat token lists are scattered into a padded or packed grid)."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
