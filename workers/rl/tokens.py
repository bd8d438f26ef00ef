"""Token batches and the unpacked log-prob forward: right-padded prompt+response rows, the loss
mask laid on them, per-response lists scattered onto the same grid, and ``response_logprobs``.

The warm start trains with these, and tests use them as the plain reference of the packed scoring
the trainer runs (``workers.rl.trimodel``). The loss mask (``response_mask``) holds a row's MODEL
tokens only: the tokens an environment appended to a response (a row's ``response_loss_mask``
zeros) are scored as context but count nowhere in the loss (``workers.rl.objectives``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.settings import SamplingSettings

if TYPE_CHECKING:  # an annotation only: the modeling stack takes seconds to import
    from transformers import PreTrainedModel


@dataclass
class TokenBatch:
    """Right-padded prompt+response rows, ready for ``response_logprobs``."""

    input_ids: torch.Tensor  # [B, T] long, prompt then response then pad
    attention_mask: torch.Tensor  # [B, T] long, 1 on prompt and response tokens
    response_mask: torch.Tensor  # [B, T] float, 1 on the response tokens the loss trains on
    # [B, T] float, 1 on every response token, environment tokens included (where per-response
    # lists such as behaviour log-probs go: ``to_token_tensor``); = response_mask without masks
    response_positions: torch.Tensor


def build_token_batch(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_token_id: int = 0,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> TokenBatch:
    """Stack (prompt_ids, response_ids) pairs into a right-padded ``TokenBatch``; ``loss_masks``:
    per row, its ``response_loss_mask`` (None: all ones), applied by ``apply_loss_masks``."""
    if not pairs:
        raise ValueError("build_token_batch: no rows")
    width = max(len(p) + len(r) for p, r in pairs)
    batch = len(pairs)
    input_ids = torch.full((batch, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    positions = torch.zeros((batch, width), dtype=torch.float32)
    for i, (prompt, response) in enumerate(pairs):
        if len(prompt) == 0:
            raise ValueError(f"build_token_batch: row {i} has an empty prompt")
        n_p, n_r = len(prompt), len(response)
        input_ids[i, : n_p + n_r] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[i, : n_p + n_r] = 1
        positions[i, n_p : n_p + n_r] = 1.0
    return TokenBatch(input_ids, attention_mask, apply_loss_masks(positions, loss_masks), positions)


def apply_loss_masks(positions: torch.Tensor,
                     loss_masks: Sequence[Sequence[int] | None] | None) -> torch.Tensor:
    """The loss mask [B, T]: ``positions`` (1 on each row's response tokens, in order) times each
    row's ``response_loss_mask`` laid on those tokens; a None row (or ``loss_masks`` None) keeps
    all ones. A mask must hold one 0/1 per response token (ValueError otherwise)."""
    if loss_masks is None or all(m is None for m in loss_masks):
        return positions
    if len(loss_masks) != positions.shape[0]:
        raise ValueError(f"apply_loss_masks: {len(loss_masks)} masks for "
                         f"{positions.shape[0]} rows")
    out = positions.clone()
    for i, row in enumerate(loss_masks):
        if row is None:
            continue
        idx = positions[i].nonzero().squeeze(-1)
        values = torch.as_tensor(row, dtype=positions.dtype)
        if len(idx) != len(values):
            raise ValueError(f"apply_loss_masks: row {i} has {len(values)} mask values for "
                             f"{len(idx)} response tokens")
        if bool(((values != 0) & (values != 1)).any()):
            raise ValueError(f"apply_loss_masks: row {i} has mask values other than 0 and 1")
        out[i, idx] = values.to(out.device)
    return out


def response_logprobs(model: PreTrainedModel, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, response_mask: torch.Tensor, *,
                      temperature: float = SamplingSettings.temperature) -> torch.Tensor:
    """Token log-probs [B, T] of right-padded rows (0 outside ``response_mask``), with graph."""
    if temperature <= 0:
        raise ValueError(f"response_logprobs: temperature must be > 0, got {temperature}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1, :].float() / temperature  # [B, T-1, V] predicts tokens 1..T-1
    targets = input_ids[:, 1:].unsqueeze(-1)
    token_logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = torch.cat([token_logp.new_zeros(token_logp.shape[0], 1), token_logp], dim=1)
    return out * response_mask.to(out.dtype)


def to_token_tensor(values: Sequence[Sequence[float]], positions: torch.Tensor) -> torch.Tensor:
    """Scatter per-response lists (e.g. behaviour log-probs) into [B, T] at ``positions`` (a
    ``TokenBatch.response_positions``: one value per response token, environment tokens too)."""
    out = torch.zeros_like(positions, dtype=torch.float32)
    for i, row in enumerate(values):
        idx = positions[i].nonzero().squeeze(-1)
        if len(idx) != len(row):
            raise ValueError(
                f"to_token_tensor: row {i} has {len(row)} values for {len(idx)} tokens")
        out[i, idx] = torch.as_tensor(row, dtype=torch.float32)
    return out
