"""The objectives of workers.rl.objectives, each against a hand-written per-token reference (plain
Python floats and the derivative worked out by hand, not autograd) on one small batch: values,
gradients, normalisers, clip counts, and the off-policy weights.

What breaks these: a flipped sign, a swapped or symmetric clip bound (the log-ratios sit between
the symmetric and the decoupled bounds), a per-token instead of per-sequence ratio, a gradient
through the cispo weight, another normaliser, or a weight that is not truncated/dropped/exact.
"""

from __future__ import annotations

import math

import pytest
import torch
from testkit import objective

from workers.rl.objectives import LossSums, Objective, importance_weights, loss_sums

# 3 rows x 4 positions; row 2 has one masked (environment) token and one pad
LOG_R = [[0.22, -0.30, 0.05, 0.4], [-0.25, 0.10, 0.35, -0.02], [0.18, 0.0, -0.5, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
ADV = [1.5, -0.8, 0.6]
OLD = [[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -2.2, -0.9], [-1.1, -0.4, -3.0, -1.0]]
REF_D = [[0.3, -0.2, 0.1, 0.0], [-0.4, 0.25, 0.05, 0.1], [0.2, -0.1, 0.7, 0.0]]  # ref - logp
BEH_D = [[0.1, 0.9, -0.3, 0.2], [1.2, -0.1, 0.05, 0.3], [-0.2, 0.4, 2.0, 0.0]]  # old - behaviour
KL = 0.05
B, T = 3, 4


def _tensors():
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = (old + torch.tensor(LOG_R, dtype=torch.float64)).requires_grad_()
    ref = logp.detach() + torch.tensor(REF_D, dtype=torch.float64)
    behaviour = old - torch.tensor(BEH_D, dtype=torch.float64)
    return logp, old, ref, behaviour, torch.tensor(ADV, dtype=torch.float64), \
        torch.tensor(MASK, dtype=torch.float64)


def _run(obj: Objective) -> tuple[float, list[list[float]], LossSums]:
    logp, old, ref, behaviour, adv, mask = _tensors()
    loss, sums = loss_sums(obj, logp, old, adv, mask, ref_logp=ref, behaviour_logp=behaviour)
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), logp.grad.tolist(), sums


def _k3(d: float) -> tuple[float, float]:
    """k3 at ref - logp = d, and its derivative in logp: 1 - e^d."""
    return math.exp(d) - d - 1, 1 - math.exp(d)


def _weight(kind: str, i: int, t: int, cap: float) -> float:
    q = math.exp(BEH_D[i][t])
    if kind == "off":
        return 1.0
    if kind == "tis":
        return min(q, cap)
    if kind == "masked":
        return 1.0 if q <= cap else 0.0
    if kind == "decoupled":
        return q if q <= cap else 0.0
    row = sum(BEH_D[i][u] for u in range(T) if MASK[i][u])  # sequence
    return min(math.exp(row), cap)


def _ppo_reference(low: float, high: float, kind: str = "off", cap: float = 2.0):
    """grpo/dr_grpo/dapo per token: -w min(rA, clip(r)A) + KL k3; gradient -w A r where the
    unclipped term is the smaller one (the clamp is flat past its bound), else 0."""
    value, grad, clipped = 0.0, [[0.0] * T for _ in range(B)], [0, 0]
    for i in range(B):
        for t in range(T):
            if not MASK[i][t]:
                continue
            r, a, w = math.exp(LOG_R[i][t]), ADV[i], _weight(kind, i, t, cap)
            c = min(max(r, 1 - low), 1 + high)
            k, dk = _k3(REF_D[i][t])
            value += -w * min(r * a, c * a) + KL * k
            unclipped_active = r * a <= c * a
            grad[i][t] = (-w * a * r if unclipped_active else 0.0) + KL * dk
            if not unclipped_active:
                clipped[0 if r < 1 else 1] += 1
    return value, grad, clipped


def _close(got, want, tol=1e-9):
    assert got == pytest.approx(want, abs=tol)


@pytest.mark.parametrize(("loss", "low", "high"), [("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28),
                                                   ("dr_grpo", 0.2, 0.2)])
def test_clipped_losses_match_the_hand_reference(loss: str, low: float, high: float) -> None:
    value, grad, sums = _run(objective(loss, low, high, kl_coef=KL, max_tokens=16))
    want_value, want_grad, (c_low, c_high) = _ppo_reference(low, high)
    _close(value, want_value)
    for row, want_row in zip(grad, want_grad, strict=True):
        _close(row, want_row)
    assert (sums.clipped_low, sums.clipped_high) == (c_low, c_high)
    assert sums.num_tokens == sums.clip_units == 10 and sums.num_sequences == 3
    # the normaliser: the step's tokens, or (dr_grpo) rows x the generation budget
    assert sums.norm == (3 * 16 if loss == "dr_grpo" else 10)
    assert sums.means()["loss"] == pytest.approx(want_value / sums.norm)


def test_dapo_clip_higher_keeps_a_token_the_symmetric_clip_drops() -> None:
    """log r = 0.22 with A > 0: r = 1.246 is past 1.2 (clipped, zero gradient) but below 1.28."""
    _, sym, s_sums = _run(objective("grpo", 0.2, 0.2))
    _, dapo, d_sums = _run(objective("dapo", 0.2, 0.28))
    assert sym[0][0] == 0.0 and dapo[0][0] == pytest.approx(-1.5 * math.exp(0.22))
    assert s_sums.clipped_high == d_sums.clipped_high + 1


def test_gspo_matches_the_hand_reference() -> None:
    """Per response: s = exp(mean_t log r), -w min(sA, clip(s)A) + KL mean_t k3; gradient per
    token -A s / L (unclipped) or 0, plus KL dk / L; normaliser: responses."""
    low, high = 0.02, 0.03  # row 0: s = e^0.0925 (clipped), row 1: e^0.045 (A<0: unclipped)
    value, grad, sums = _run(objective("gspo", low, high, kl_coef=KL))
    want, clipped = 0.0, 0
    for i in range(B):
        tokens = [t for t in range(T) if MASK[i][t]]
        n = len(tokens)
        s = math.exp(sum(LOG_R[i][t] for t in tokens) / n)
        a = ADV[i]
        c = min(max(s, 1 - low), 1 + high)
        kl = sum(_k3(REF_D[i][t])[0] for t in tokens) / n
        want += -min(s * a, c * a) + KL * kl
        active = s * a <= c * a
        clipped += not active
        for t in range(T):
            g = ((-a * s / n if active else 0.0) + KL * _k3(REF_D[i][t])[1] / n
                 if MASK[i][t] else 0.0)
            assert grad[i][t] == pytest.approx(g, abs=1e-9), (i, t)
    _close(value, want)
    assert sums.norm == 3 and sums.clip_units == 3 and sums.clipped_low + sums.clipped_high == clipped
    assert clipped == 2  # rows 0 and 2 (A > 0, s past 1 + high); row 1 (A < 0) is not
    assert sums.means()["sequence_ratio_mean"] == pytest.approx(sum(
        math.exp(sum(LOG_R[i][t] for t in range(T) if MASK[i][t]) / sum(MASK[i]))
        for i in range(B)) / 3)


def test_cispo_matches_the_hand_reference() -> None:
    """Per token: value -sg(clip(r)) A, gradient -clip(r) A (never 0: the weight is detached,
    so a clipped token still gets its REINFORCE gradient); no lower bound with clip_low 1."""
    high = 0.2
    value, grad, sums = _run(objective("cispo", 1.0, high, kl_coef=KL))
    want, n_high = 0.0, 0
    for i in range(B):
        for t in range(T):
            if not MASK[i][t]:
                assert grad[i][t] == 0.0
                continue
            r = math.exp(LOG_R[i][t])
            w = min(r, 1 + high)
            n_high += r > 1 + high
            k, dk = _k3(REF_D[i][t])
            want += -w * ADV[i] + KL * k
            assert grad[i][t] == pytest.approx(-w * ADV[i] + KL * dk, abs=1e-9), (i, t)
    _close(value, want)
    assert (sums.clipped_low, sums.clipped_high, sums.norm) == (0, n_high, 10)
    assert n_high == 3  # log r 0.22, 0.4, 0.35 (the rest are inside)


@pytest.mark.parametrize("kind", ["tis", "masked", "sequence", "decoupled"])
def test_off_policy_weights_match_the_hand_reference(kind: str) -> None:
    """The weight multiplies each token's clipped term (detached: no gradient of its own)."""
    cap = 2.0
    value, grad, sums = _run(objective("grpo", 0.2, 0.2, kl_coef=KL, correction=kind,
                                       is_cap=cap))
    want_value, want_grad, _ = _ppo_reference(0.2, 0.2, kind, cap)
    _close(value, want_value)
    for row, want_row in zip(grad, want_grad, strict=True):
        _close(row, want_row)
    weights = [_weight(kind, i, t, cap) for i in range(B) for t in range(T) if MASK[i][t]]
    assert sums.is_weight_sum == pytest.approx(sum(weights))


def test_importance_weights_edge_values() -> None:
    """Past the cap: tis truncates to it, masked and decoupled drop the token (0), the sequence
    weight caps the product; below it decoupled keeps the exact ratio, masked 1."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    behaviour = -torch.tensor([[math.log(3.0), math.log(1.5), 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    got = {k: importance_weights(k, old, behaviour, mask, 2.0)[0][0].tolist()
           for k in ("tis", "masked", "decoupled", "sequence", "off")}
    assert got["tis"] == pytest.approx([2.0, 1.5, 1.0])
    assert got["masked"] == pytest.approx([0.0, 1.0, 1.0])
    assert got["decoupled"] == pytest.approx([0.0, 1.5, 1.0])
    assert got["sequence"] == pytest.approx([2.0] * 3)  # 3 x 1.5 = 4.5 capped
    assert got["off"] == [1.0, 1.0, 1.0]


def test_first_pass_ratio_is_one_and_the_gradient_is_minus_the_advantage() -> None:
    """On-policy (old = logp): value and gradient -A per model token for every PPO-style loss."""
    logp, _, _, _, adv, mask = _tensors()
    for loss in ("grpo", "dapo", "dr_grpo", "cispo"):
        x = logp.detach().clone().requires_grad_()
        value, sums = loss_sums(objective(loss, 0.2, 0.28), x, x.detach(), adv, mask)
        value.backward()
        assert x.grad is not None
        assert torch.allclose(x.grad, -adv[:, None] * mask), loss
        assert sums.clipped_low == sums.clipped_high == 0


def test_loss_sums_add_up_and_objective_rejects_bad_input() -> None:
    a = LossSums(loss_sum=1.0, num_tokens=3, norm=3.0, ratio_max=1.1, clipped_high=1, clip_units=3)
    b = LossSums(loss_sum=2.0, num_tokens=5, norm=5.0, ratio_max=1.3, clipped_low=2, clip_units=5)
    c = a + b
    assert (c.loss_sum, c.num_tokens, c.ratio_max, c.clipped_low, c.clipped_high) == (3.0, 8, 1.3,
                                                                                      2, 1)
    assert c.means()["clip_fraction"] == pytest.approx(3 / 8)
    assert c.means()["loss"] == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="unknown loss"):
        objective("ppo")
    with pytest.raises(ValueError, match="clip bounds"):
        objective("grpo", 1.5, 0.2)
    logp, old, _, _, adv, mask = _tensors()
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        loss_sums(objective(correction="tis"), logp, old, adv, mask)
