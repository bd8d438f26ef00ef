"""GRPO math: token log-probs, group advantages, the clipped loss as token SUMS, optimizer helpers.

Pure tensor math, no I/O. Conventions, and why the loss is a sum: docs/engines.md, "GRPO math
conventions". The loss mask (``response_mask``) holds a row's MODEL tokens only: the tokens an
environment appended to a response (a row's ``response_loss_mask`` zeros) are scored as context
but count nowhere in the loss, its token count, the KL, the ratios or the IS weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # an annotation only: the modeling stack takes seconds to import
    from transformers import PreTrainedModel


class IncompleteGroupError(ValueError):
    """A group does not have exactly ``group_size`` rows."""


# --------------------------------------------------------------------------- log-probs
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
                      temperature: float = 1.0) -> torch.Tensor:
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


# --------------------------------------------------------------------------- advantages
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, group_size: int,
                     std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-row advantage [N] = (r - mean of its group) [/ (std of its group + eps)]."""
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"group_advantages: rewards and group_ids must be 1-D of equal length, "
                         f"got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if group_size < 1:
        raise ValueError(f"group_advantages: group_size must be >= 1, got {group_size}")
    uniq, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    bad = counts != group_size
    if bool(bad.any()):
        gid, cnt = int(uniq[bad][0]), int(counts[bad][0])
        raise IncompleteGroupError(f"group {gid} has {cnt} rows, expected group_size={group_size}; "
                                   "advantages are computed only from complete groups")
    r = rewards.double()
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
    mean = sums / group_size
    centered = r - mean[inverse]
    if not std_normalize:
        return centered.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    sq = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, centered * centered)
    std = (sq / (group_size - 1)).sqrt() if group_size > 1 else torch.zeros_like(sq)
    adv = centered / (std[inverse] + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# --------------------------------------------------------------------------- loss
@dataclass
class LossSums:
    """Detached sums over the response tokens of one micro-batch; they add across batches."""

    loss_sum: float = 0.0  # total loss (policy + kl_coef * kl) summed over tokens
    policy_loss_sum: float = 0.0  # clipped surrogate loss (IS-weighted), summed over tokens
    kl_sum: float = 0.0  # k3 KL to the reference, summed over tokens (0 without a reference)
    num_tokens: int = 0  # response tokens trained on (sum of the loss mask: model tokens only)
    clipped_tokens: int = 0  # tokens where the clipped term was the active (smaller) one
    ratio_sum: float = 0.0  # sum of exp(logp - old_logp)
    ratio_max: float = 0.0  # max ratio seen (0.0 while no token is counted)
    ratio_min: float = math.inf  # min ratio seen (inf while no token is counted)
    is_weight_sum: float = 0.0  # sum of truncated IS weights (num_tokens when off)
    is_capped_tokens: int = 0  # tokens whose IS weight hit is_cap

    def __add__(self, other: LossSums) -> LossSums:
        added = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return LossSums(**{**added, "ratio_max": max(self.ratio_max, other.ratio_max),
                           "ratio_min": min(self.ratio_min, other.ratio_min)})

    def means(self) -> dict[str, float]:
        """Token means of the sums (what metrics report); the ratio stats are 1.0 without tokens."""
        n = max(self.num_tokens, 1)
        return {
            "loss": self.loss_sum / n,
            "policy_loss": self.policy_loss_sum / n,
            "kl": self.kl_sum / n,
            "clip_fraction": self.clipped_tokens / n,
            "ratio_mean": self.ratio_sum / n if self.num_tokens else 1.0,
            "ratio_min": self.ratio_min if self.num_tokens else 1.0,
            "ratio_max": self.ratio_max if self.num_tokens else 1.0,
            "is_weight_mean": self.is_weight_sum / n,
            "is_capped_fraction": self.is_capped_tokens / n,
        }


def grpo_loss_sums(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    is_correction: bool = False,
    is_cap: float = 2.0,
) -> tuple[torch.Tensor, LossSums]:
    """Summed GRPO loss over masked tokens (scalar, differentiable) and its detached sums.

    Per token: ``-w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + kl_coef * k3``,
    ``ratio = exp(logp - old_logp)``, ``k3 = exp(ref - logp) - (ref - logp) - 1``, ``w =
    min(exp(old_logp - behaviour_logp), is_cap)`` (detached) when ``is_correction``, else 1.
    ``mask``: the loss mask (``TokenBatch.response_mask``); a token at 0 (padding, prompt or an
    environment token) adds nothing to any sum and gets no gradient. Shapes: [B, T], advantages
    [B]."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"grpo_loss_sums: logp {tuple(logp.shape)}, old_logp "
                         f"{tuple(old_logp.shape)} and mask {tuple(mask.shape)} must have the "
                         "same shape")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"grpo_loss_sums: advantages must be [B]={tuple(logp.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if kl_coef and ref_logp is None:
        raise ValueError("grpo_loss_sums: kl_coef > 0 needs ref_logp")
    if is_correction and behaviour_logp is None:
        raise ValueError("grpo_loss_sums: is_correction needs behaviour_logp")
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # [B, 1]
    ratio = torch.exp((logp - old_logp.detach()) * m)  # masked positions -> ratio 1
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if is_correction:
        assert behaviour_logp is not None
        raw_w = torch.exp((old_logp - behaviour_logp).detach() * m)
        weight = torch.clamp(raw_w, max=is_cap)
        is_capped = ((raw_w > is_cap).to(m.dtype) * m).sum()
    else:
        weight = torch.ones_like(ratio)
        is_capped = m.new_zeros(())
    policy_tok = -weight * surrogate
    if ref_logp is not None:
        diff = (ref_logp.detach() - logp) * m
        kl_tok = torch.exp(diff) - diff - 1.0
    else:
        kl_tok = torch.zeros_like(logp)
    total_tok = policy_tok + kl_coef * kl_tok
    loss_sum = (total_tok * m).sum()
    with torch.no_grad():
        ratio_masked = ratio.detach() * m
        sums = LossSums(
            loss_sum=float(loss_sum.detach()),
            policy_loss_sum=float((policy_tok.detach() * m).sum()),
            kl_sum=float((kl_tok.detach() * m).sum()),
            num_tokens=int(m.sum().round()),
            clipped_tokens=int(((clipped.detach() < unclipped.detach()).to(m.dtype) * m).sum()),
            ratio_sum=float(ratio_masked.sum()),
            ratio_max=float(ratio_masked.max()) if m.numel() else 0.0,
            ratio_min=float(ratio.detach().masked_fill(m == 0, math.inf).min())
            if m.numel() else math.inf,
            is_weight_sum=float((weight.detach() * m).sum()),
            is_capped_tokens=int(is_capped),
        )
    return loss_sum, sums


# --------------------------------------------------------------------------- optimizer
def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every accumulated gradient by ``factor`` (e.g. 1 / batch token count)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), *,
                   warmup_steps: int = 0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (foreach off: same update whatever the param order);
    ``warmup_steps`` > 0 ramps the lr linearly (applied by ``optimizer_step``; docs/engines.md)."""
    if lr <= 0:
        raise ValueError(f"make_optimizer: lr must be > 0, got {lr}")
    if warmup_steps < 0:
        raise ValueError(f"make_optimizer: warmup_steps must be >= 0, got {warmup_steps}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, foreach=False)
    for group in opt.param_groups:
        group["base_lr"] = lr
        group["warmup_steps"] = int(warmup_steps)
        group["num_steps"] = 0
    return opt


def apply_warmup(optimizer: torch.optim.Optimizer) -> None:
    """Set each param group's lr for the step about to be taken and count it. The schedule lives
    in the param group (set by ``make_optimizer``), so it is saved and restored with the
    optimizer's state dict; call once per optimizer step, right before it."""
    for group in optimizer.param_groups:
        warmup = group.get("warmup_steps", 0)
        if warmup:
            group["lr"] = group["base_lr"] * min(1.0, (group["num_steps"] + 1) / warmup)
        group["num_steps"] = group.get("num_steps", 0) + 1


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> float:
    """Clip (if ``max_grad_norm``), step, zero the gradients; returns the pre-clip grad norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm is not None and max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif params:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.zeros(())
    apply_warmup(optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
