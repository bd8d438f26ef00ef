"""The GRPO-family objectives of one optimizer step: ratios, clipping, the KL term, off-policy
importance weights and normalisation, as pure functions on tensors (no model, no store, no I/O).

The trainer feeds ``loss_sums`` one micro-batch at a time, backpropagates the returned SUM, adds
the detached ``LossSums`` up over the step, and scales the accumulated gradient by ``1 /
LossSums.norm`` before stepping: the normaliser of the whole step is only known at its end
(docs/engines.md "GRPO math conventions"). What each objective optimises, per response i and
model token t, A_i its advantage, r = pi / pi_old the ratio to the old (proximal) policy, w the
detached off-policy weight (below), clip(r) = clamp(r, 1 - clip_low, 1 + clip_high):

* ``grpo``: -w min(r A, clip(r) A) per token, over the step's token count;
* ``dr_grpo``: the same sum over a CONSTANT (rows x ``max_tokens``): no length bias (Liu et al.);
* ``dapo``: ``grpo`` with decoupled bounds (clip-higher), token-level (Yu et al.);
* ``gspo``: -w_i min(s_i A_i, clip(s_i) A_i) per response, s_i = exp(mean_t log r): the
  length-normalised sequence ratio, clipped per sequence, over the response count (Zheng et al.);
* ``cispo``: -sg(clip(r) w) A log pi per token, over the token count: a REINFORCE loss whose
  clipped importance weight never zeroes a token's gradient (MiniMax-M1).

Off-policy correction against the behaviour log-probs b (the rollout's), q = pi_old / b:
``tis`` w = min(q, cap) per token; ``masked`` w = 1[q <= cap]; ``sequence`` w_i = min(prod_t q,
cap); ``decoupled`` (AReaL) w = q 1[q <= cap]: the trust region is the proximal policy pi_old,
the weight the exact behaviour ratio, tokens past the cap dropped; ``off`` w = 1. The loss mask
holds a row's MODEL tokens only (``workers.rl.tokens``): a token at 0 adds to no sum and gets no
gradient. The KL term (k3 to the reference) is added per token (per-response mean for gspo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
CORRECTIONS = ("off", "tis", "masked", "sequence", "decoupled")


@dataclass(frozen=True)
class Objective:
    """One step's objective: the trainer's ``GrpoSettings`` resolved (``Trainer`` builds it; no
    field has a default of its own: each is a trainer.* key's value)."""

    loss: str  # one of LOSSES
    clip_low: float  # the ratio's lower bound is 1 - clip_low (1: none, as cispo's)
    clip_high: float  # its upper bound 1 + clip_high
    kl_coef: float  # beta of the k3 KL term (0: no reference)
    correction: str  # one of CORRECTIONS (importance_correction resolved for run.mode)
    is_cap: float  # the importance weight's cap
    max_tokens: int  # dr_grpo's constant per-response normaliser (the generation budget)

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"Objective: unknown loss {self.loss!r}; one of {LOSSES}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"Objective: unknown correction {self.correction!r}; one of "
                             f"{CORRECTIONS}")
        if not (0 < self.clip_low <= 1 and self.clip_high > 0):
            raise ValueError(f"Objective: clip bounds must be 0 < clip_low <= 1 and clip_high > "
                             f"0, got {self.clip_low}, {self.clip_high}")


@dataclass
class LossSums:
    """Detached sums over one micro-batch; they add across micro-batches and ranks. A "unit" is
    what one clip decision covers: a token, or a response for gspo."""

    loss_sum: float = 0.0  # the differentiable sum's value (policy + kl_coef * kl terms)
    policy_loss_sum: float = 0.0  # the policy terms alone
    kl_sum: float = 0.0  # k3 KL to the reference, summed over tokens (0 without a reference)
    num_tokens: int = 0  # response tokens trained on (sum of the loss mask: model tokens only)
    num_sequences: int = 0  # responses with at least one such token
    norm: float = 0.0  # the objective's normaliser (tokens, responses, or rows x max_tokens)
    clip_units: int = 0  # clip decisions taken (tokens; responses for gspo)
    clipped_low: int = 0  # units whose ratio was clipped at 1 - clip_low
    clipped_high: int = 0  # units whose ratio was clipped at 1 + clip_high
    ratio_sum: float = 0.0  # sum over tokens of exp(logp - old_logp)
    ratio_max: float = 0.0  # max token ratio seen (0.0 while no token is counted)
    ratio_min: float = math.inf  # min token ratio seen (inf while no token is counted)
    seq_ratio_sum: float = 0.0  # sum over responses of exp(mean_t (logp - old_logp))
    is_weight_sum: float = 0.0  # sum over tokens of the off-policy weight (num_tokens when off)
    is_capped_tokens: int = 0  # tokens whose weight the cap truncated or dropped

    def __add__(self, other: LossSums) -> LossSums:
        added = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return LossSums(**{**added, "ratio_max": max(self.ratio_max, other.ratio_max),
                           "ratio_min": min(self.ratio_min, other.ratio_min)})

    def means(self) -> dict[str, float]:
        """What metrics report: the loss over the objective's normaliser, the rest per token (or
        per unit / response); the ratio stats are 1.0 without tokens."""
        n, units, on = max(self.num_tokens, 1), max(self.clip_units, 1), self.num_tokens > 0
        return {
            "loss": self.loss_sum / self.norm if self.norm else 0.0,
            "policy_loss": self.policy_loss_sum / self.norm if self.norm else 0.0,
            "kl": self.kl_sum / n,
            "clip_fraction": (self.clipped_low + self.clipped_high) / units,
            "clip_low_fraction": self.clipped_low / units,
            "clip_high_fraction": self.clipped_high / units,
            "ratio_mean": self.ratio_sum / n if on else 1.0,
            "ratio_min": self.ratio_min if on else 1.0,
            "ratio_max": self.ratio_max if on else 1.0,
            "sequence_ratio_mean": (self.seq_ratio_sum / self.num_sequences
                                    if self.num_sequences else 1.0),
            "is_weight_mean": self.is_weight_sum / n if on else 1.0,
            "is_capped_fraction": self.is_capped_tokens / n,
        }


def importance_weights(correction: str, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached off-policy weight [B, T] of ``correction`` and the [B, T] 0/1 tokens the cap
    truncated or dropped (module docstring); 1 and 0 at masked tokens."""
    m = mask.to(old_logp.dtype)
    if correction == "off":
        return torch.ones_like(old_logp), torch.zeros_like(old_logp)
    log_q = (old_logp - behaviour_logp).detach() * m
    if correction == "sequence":
        row = log_q.sum(dim=1, keepdim=True)  # log of the product of the token ratios
        over = (row > math.log(cap)).to(m.dtype).expand_as(m) * m
        return torch.exp(row.clamp(max=math.log(cap))).expand_as(m).clone(), over
    q = torch.exp(log_q)
    over = (q > cap).to(m.dtype) * m
    if correction == "tis":
        return q.clamp(max=cap), over
    if correction == "masked":
        return 1.0 - over, over
    if correction == "decoupled":
        return q * (1.0 - over), over
    raise ValueError(f"importance_weights: unknown correction {correction!r}")


def k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, 0 off-mask."""
    diff = (ref_logp.detach() - logp) * mask
    return torch.exp(diff) - diff - 1.0


def loss_sums(obj: Objective, logp: torch.Tensor, old_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, *,
              ref_logp: torch.Tensor | None = None,
              behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, LossSums]:
    """The objective's SUM over a micro-batch (scalar, differentiable) and its detached sums.
    Shapes: [B, T] (``mask``: the loss mask), advantages [B]."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"loss_sums: logp {tuple(logp.shape)}, old_logp "
                         f"{tuple(old_logp.shape)} and mask {tuple(mask.shape)} must have the "
                         "same shape")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"loss_sums: advantages must be [B]={tuple(logp.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if obj.kl_coef and ref_logp is None:
        raise ValueError("loss_sums: kl_coef > 0 needs ref_logp")
    if obj.correction != "off" and behaviour_logp is None:
        raise ValueError(f"loss_sums: correction {obj.correction!r} needs behaviour_logp")
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # [B, 1]
    lo, hi = 1.0 - obj.clip_low, 1.0 + obj.clip_high
    log_ratio = (logp - old_logp.detach()) * m
    ratio = torch.exp(log_ratio)  # masked positions: ratio 1
    weight, capped = importance_weights(obj.correction, old_logp, behaviour_logp
                                        if behaviour_logp is not None else old_logp, m, obj.is_cap)
    kl_tok = k3(logp, ref_logp, m) if ref_logp is not None else torch.zeros_like(logp)
    lengths = m.sum(dim=1)  # [B] model tokens per row
    has_tokens = (lengths > 0).to(m.dtype)
    seq_ratio = torch.exp(log_ratio.sum(dim=1) / lengths.clamp(min=1.0))  # [B]

    if obj.loss == "gspo":
        seq_w = (weight * m).sum(dim=1) / lengths.clamp(min=1.0)  # the row's mean token weight
        unclipped = seq_ratio * adv[:, 0]
        clipped = seq_ratio.clamp(lo, hi) * adv[:, 0]
        policy = -seq_w * torch.minimum(unclipped, clipped) * has_tokens  # [B]
        kl_seq = (kl_tok * m).sum(dim=1) / lengths.clamp(min=1.0)
        loss_sum = (policy + obj.kl_coef * kl_seq).sum()
        active, unit_ratio, unit_mask = clipped < unclipped, seq_ratio, has_tokens
    else:
        if obj.loss == "cispo":
            r_hat = (ratio.clamp(lo, hi) * weight).detach()
            # value -r_hat * A (the surrogate's), gradient -r_hat * A * d log pi
            policy = -r_hat * adv * (1.0 + logp - logp.detach())
            active, unit_ratio = (ratio < lo) | (ratio > hi), ratio
        else:
            unclipped = ratio * adv
            clipped = ratio.clamp(lo, hi) * adv
            policy = -weight * torch.minimum(unclipped, clipped)
            active, unit_ratio = clipped < unclipped, ratio
        loss_sum = ((policy + obj.kl_coef * kl_tok) * m).sum()
        unit_mask = m
    with torch.no_grad():
        on = active.to(m.dtype) * unit_mask
        ratio_d = ratio.detach()
        none = m.numel() == 0  # no row at all: max/min of nothing
        zero = m.new_zeros(())
        # Every statistic in one tensor, brought to the host at once: one wait for the device
        # per micro-batch, not one per figure. float64 holds each float32 sum and count exactly.
        stats = torch.stack([t.to(torch.float64) for t in (
            m.sum(), has_tokens.sum(), loss_sum.detach(),
            (policy.detach() * (m if policy.ndim == 2 else 1.0)).sum(), (kl_tok.detach() * m).sum(),
            unit_mask.sum(), (on * (unit_ratio.detach() < 1.0).to(m.dtype)).sum(),
            (on * (unit_ratio.detach() > 1.0).to(m.dtype)).sum(), (ratio_d * m).sum(),
            zero if none else (ratio_d * m).max(),
            zero + math.inf if none else ratio_d.masked_fill(m == 0, math.inf).min(),
            (seq_ratio.detach() * has_tokens).sum(), (weight * m).sum(), capped.sum())]).tolist()
        (tokens_f, rows_f, loss_v, policy_v, kl_v, units_f, low_f, high_f, ratio_v, rmax, rmin,
         seq_v, isw_v, capped_f) = stats
        num_tokens, rows = round(tokens_f), round(rows_f)
        norm = {"gspo": float(rows),
                "dr_grpo": float(logp.shape[0] * obj.max_tokens)}.get(obj.loss, float(num_tokens))
        sums = LossSums(
            loss_sum=loss_v, policy_loss_sum=policy_v, kl_sum=kl_v, num_tokens=num_tokens,
            num_sequences=rows, norm=norm, clip_units=round(units_f), clipped_low=round(low_f),
            clipped_high=round(high_f), ratio_sum=ratio_v,
            ratio_max=rmax if num_tokens else 0.0, ratio_min=rmin if num_tokens else math.inf,
            seq_ratio_sum=seq_v, is_weight_sum=isw_v, is_capped_tokens=round(capped_f),
        )
    return loss_sum, sums
