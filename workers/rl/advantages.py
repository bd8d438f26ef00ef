"""Advantage estimators of the GRPO family, and DAPO's overlong reward shaping: pure functions of
a batch's rewards and group ids (no model, no store).

Every estimator is computed from COMPLETE groups only (``IncompleteGroupError`` otherwise) and
gives one advantage per response (outcome rewards: the same value at each of its tokens):

* ``grpo``: (r - group mean) / (group std + eps), the std dropped with ``std_normalize=False``
  (Dr.GRPO: the std division over-weights groups that are nearly solved or nearly failed);
* ``rloo``: r - the mean of the OTHER responses of its group (leave-one-out baseline),
  = G / (G - 1) x (r - group mean); needs G >= 2;
* ``reinforce_pp``: REINFORCE++ with the group baseline: (r - group mean) / the std of those
  centred values over the whole step's batch (global normalisation: one scale per step, so it
  needs every row of the step before the first is trained; the trainer waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.settings import GrpoSettings

ADVANTAGES = ("grpo", "rloo", "reinforce_pp")


class IncompleteGroupError(ValueError):
    """A group does not have exactly ``group_size`` rows."""


@dataclass(frozen=True)
class Groups:
    """Rows of whole groups: each row's group index, and the group count."""

    inverse: torch.Tensor  # [N] long, index of each row's group in 0..count-1
    count: int
    size: int


def groups_of(group_ids: torch.Tensor, group_size: int) -> Groups:
    """The groups of rows ``group_ids`` [N]; every group must have exactly ``group_size`` rows."""
    if group_ids.ndim != 1:
        raise ValueError(f"groups_of: group_ids must be 1-D, got {tuple(group_ids.shape)}")
    if group_size < 1:
        raise ValueError(f"groups_of: group_size must be >= 1, got {group_size}")
    uniq, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    bad = counts != group_size
    if bool(bad.any()):
        gid, cnt = int(uniq[bad][0]), int(counts[bad][0])
        raise IncompleteGroupError(f"group {gid} has {cnt} rows, expected group_size={group_size}; "
                                   "advantages are computed only from complete groups")
    return Groups(inverse, len(uniq), group_size)


def _group_mean(r: torch.Tensor, g: Groups) -> torch.Tensor:
    """Each row's group mean [N] (float64)."""
    sums = torch.zeros(g.count, dtype=torch.float64).index_add_(0, g.inverse, r)
    return (sums / g.size)[g.inverse]


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"advantages: rewards and group_ids must be 1-D of equal length, "
                         f"got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, group_size: int,
                     std_normalize: bool = GrpoSettings.std_normalize,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: per-row advantage [N] = (r - mean of its group) [/ (unbiased std of its group + eps)]."""
    _check(rewards, group_ids)
    g = groups_of(group_ids, group_size)
    r = rewards.double()
    centered = r - _group_mean(r, g)
    if not std_normalize:
        return centered.to(_out_dtype(rewards))
    sq = torch.zeros(g.count, dtype=torch.float64).index_add_(0, g.inverse, centered * centered)
    std = (sq / (group_size - 1)).sqrt() if group_size > 1 else torch.zeros_like(sq)
    return (centered / (std[g.inverse] + eps)).to(_out_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                    group_size: int) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i} r_j over its group [N] (Ahmadian et al. 2024)."""
    _check(rewards, group_ids)
    if group_size < 2:
        raise ValueError("rloo_advantages: a leave-one-out baseline needs group_size >= 2")
    g = groups_of(group_ids, group_size)
    r = rewards.double()
    others = (_group_mean(r, g) * group_size - r) / (group_size - 1)
    return (r - others).to(_out_dtype(rewards))


def centred_std(rewards: torch.Tensor, group_ids: torch.Tensor, *, group_size: int) -> float:
    """The std (unbiased) over a whole batch of its group-centred rewards: REINFORCE++'s global
    scale (their batch mean is 0 by construction, so centring again changes nothing)."""
    centered = group_advantages(rewards.double(), group_ids, group_size=group_size,
                                std_normalize=False)
    return float(centered.std()) if centered.numel() > 1 else 0.0


def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, group_size: int,
                            batch_std: float, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (group baseline, global normalisation; Hu et al. 2025): (r - group mean) /
    (``batch_std`` + eps), ``batch_std`` = ``centred_std`` of the step's whole batch."""
    centered = group_advantages(rewards, group_ids, group_size=group_size, std_normalize=False)
    return (centered.double() / (batch_std + eps)).to(_out_dtype(rewards))


def advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, *, group_size: int,
               std_normalize: bool = GrpoSettings.std_normalize,
               batch_std: float | None = None) -> torch.Tensor:
    """The advantage [N] of estimator ``name`` (``ADVANTAGES``); ``batch_std`` for reinforce_pp."""
    if name == "grpo":
        return group_advantages(rewards, group_ids, group_size=group_size,
                                std_normalize=std_normalize)
    if name == "rloo":
        return rloo_advantages(rewards, group_ids, group_size=group_size)
    if name == "reinforce_pp":
        if batch_std is None:
            raise ValueError("advantages: reinforce_pp needs the batch's centred_std")
        return reinforce_pp_advantages(rewards, group_ids, group_size=group_size,
                                       batch_std=batch_std)
    raise ValueError(f"advantages: unknown estimator {name!r}; one of {ADVANTAGES}")


def overlong_penalty(lengths: torch.Tensor, *, max_tokens: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [N] (<= 0), added to the reward: 0 up to ``max_tokens -
    buffer`` response tokens, then falling linearly to ``-penalty`` at ``max_tokens`` (and
    ``-penalty`` past it). ``buffer`` 0: no shaping."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_tokens:
        raise ValueError(f"overlong_penalty: buffer {buffer} exceeds max_tokens {max_tokens}")
    over = (lengths.double() - (max_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return (-penalty * over / buffer).float()
