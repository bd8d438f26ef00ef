"""The advantage estimators and DAPO's overlong shaping (workers.rl.advantages), by hand.

What breaks these: a biased std, a baseline that includes the row itself (rloo), a per-group
instead of a batch-wide scale (reinforce_pp), a row order dependence, a penalty that starts at
the wrong length or has the wrong sign.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.rl.advantages import (
    IncompleteGroupError,
    advantages,
    centred_std,
    group_advantages,
    overlong_penalty,
    rloo_advantages,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
GROUPS = torch.tensor([7, 7, 7, 7, 2, 2, 2, 2, 5, 5, 5, 5])


def test_group_advantages_hand_computed_any_row_order() -> None:
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean .5, unbiased std sqrt(1/3)
    b_std = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)  # group 5: mean .75
    want = [a, -a, -a, a, 0, 0, 0, 0] + [-0.75 / (b_std + 1e-6)] * 3 + [2.25 / (b_std + 1e-6)]
    got = group_advantages(REWARDS, GROUPS, group_size=4)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(group_advantages(REWARDS[perm], GROUPS[perm], group_size=4), got[perm])
    no_std = group_advantages(REWARDS, GROUPS, group_size=4, std_normalize=False)
    assert torch.allclose(no_std[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(IncompleteGroupError, match="group 3 has 2 rows"):
        group_advantages(torch.ones(6), torch.tensor([1, 1, 1, 1, 3, 3]), group_size=4)


def test_rloo_is_the_reward_minus_the_mean_of_the_others() -> None:
    got = rloo_advantages(REWARDS, GROUPS, group_size=4).tolist()
    want = [REWARDS[i].item() - sum(REWARDS[j].item() for j in range(12)
                                    if GROUPS[j] == GROUPS[i] and j != i) / 3 for i in range(12)]
    assert got == pytest.approx(want)
    assert got[:4] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])  # = 4/3 x (r - mean)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.ones(2), torch.tensor([0, 1]), group_size=1)


def test_reinforce_pp_scales_every_group_by_one_batch_std() -> None:
    """(r - group mean) / std over the batch of those centred values: the all-equal group stays
    0, and groups 7 and 5 share ONE scale (a per-group std would give group 7 +-0.866)."""
    centred = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25]
    mean = sum(centred) / 12
    std = math.sqrt(sum((c - mean) ** 2 for c in centred) / 11)
    assert mean == 0.0 and centred_std(REWARDS, GROUPS, group_size=4) == pytest.approx(std)
    got = advantages("reinforce_pp", REWARDS, GROUPS, group_size=4, batch_std=std).tolist()
    assert got == pytest.approx([c / (std + 1e-6) for c in centred])
    with pytest.raises(ValueError, match="centred_std"):
        advantages("reinforce_pp", REWARDS, GROUPS, group_size=4)
    with pytest.raises(ValueError, match="unknown estimator"):
        advantages("ppo", REWARDS, GROUPS, group_size=4)


def test_overlong_penalty_is_zero_then_linear_to_the_budget() -> None:
    """Budget 20, buffer 5: 0 up to 15 tokens, then -penalty x (len - 15) / 5, -penalty at and
    past 20."""
    lengths = torch.tensor([3, 15, 16, 18, 20, 25])
    got = overlong_penalty(lengths, max_tokens=20, buffer=5, penalty=0.5).tolist()
    assert got == pytest.approx([0.0, 0.0, -0.1, -0.3, -0.5, -0.5])
    assert overlong_penalty(lengths, max_tokens=20, buffer=0, penalty=0.5).tolist() == [0.0] * 6
