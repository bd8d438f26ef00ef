"""GRPO math: advantages, clipped ratio, k3 KL, IS weights, order-free gradient accumulation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer
from workers.rl.grpo import (
    IncompleteGroupError,
    LossSums,
    build_token_batch,
    group_advantages,
    grpo_loss_sums,
    make_optimizer,
    optimizer_step,
    response_logprobs,
    scale_gradients,
)

torch.set_num_threads(1)
SPEC = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


def test_group_advantages_hand_computed_any_row_order():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 2, 5, 5, 5, 5])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean .5, unbiased std sqrt(1/3)
    b_std = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)  # group 5: mean .75
    want = [a, -a, -a, a, 0, 0, 0, 0, -0.75 / (b_std + 1e-6)] * 1
    want += [-0.75 / (b_std + 1e-6)] * 2 + [2.25 / (b_std + 1e-6)]
    got = group_advantages(rewards, groups, group_size=4)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(group_advantages(rewards[perm], groups[perm], group_size=4), got[perm])
    no_std = group_advantages(rewards, groups, group_size=4, std_normalize=False)
    assert torch.allclose(no_std[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_reject_incomplete_groups():
    with pytest.raises(IncompleteGroupError, match="group 3 has 2 rows"):
        group_advantages(torch.ones(6), torch.tensor([1, 1, 1, 1, 3, 3]), group_size=4)


def _logps(seed: int, shape=(4, 6)):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(shape, generator=g) * 3


def test_ratio_is_one_and_nothing_clipped_when_logp_equals_old():
    logp = _logps(0).requires_grad_()
    mask = torch.ones(4, 6)
    mask[0, 4:] = 0
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    loss, sums = grpo_loss_sums(logp, logp.detach().clone(), None, adv, mask, clip_eps=0.2)
    assert sums.ratio_sum == sums.num_tokens == 22 and sums.ratio_max == 1.0
    assert sums.clipped_tokens == 0 and sums.kl_sum == 0.0
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item())
    loss.backward()  # d/dlogp of -ratio*A at ratio 1 is -A on masked tokens
    assert torch.allclose(logp.grad, -(adv[:, None] * mask))


def test_clipping_counts_and_bounds_the_ratio():
    old = _logps(1)
    logp = old + 1.0  # ratio e > 1 + eps everywhere
    adv = torch.ones(4)
    _, sums = grpo_loss_sums(logp, old, None, adv, torch.ones(4, 6), clip_eps=0.2)
    assert sums.clipped_tokens == 24
    assert sums.policy_loss_sum == pytest.approx(-1.2 * 24, rel=1e-6)


def test_k3_kl_is_zero_at_reference_and_positive_elsewhere():
    logp = _logps(2)
    mask = torch.ones(4, 6)
    _, same = grpo_loss_sums(logp, logp, logp.clone(), torch.zeros(4), mask, kl_coef=0.1)
    assert same.kl_sum == 0.0
    _, diff = grpo_loss_sums(logp, logp, _logps(3), torch.zeros(4), mask, kl_coef=0.1)
    assert diff.kl_sum > 0.0
    assert diff.loss_sum == pytest.approx(0.1 * diff.kl_sum, rel=1e-5)


def _one_token_each(logp_minus_old: list[float], adv: list[float], clip_eps: float = 0.2):
    """Rows of one response token each: logp = old + given, so ratio_i = exp(given_i)."""
    old = torch.full((len(adv), 1), -1.0)
    logp = (old + torch.tensor(logp_minus_old)[:, None]).requires_grad_()
    loss, sums = grpo_loss_sums(logp, old, None, torch.tensor(adv), torch.ones(len(adv), 1),
                                clip_eps=clip_eps)
    loss.backward()
    return loss.item(), sums, logp.grad[:, 0].tolist()


def test_ppo_min_picks_the_pessimistic_term_hand_computed():
    """Per token: -min(r * A, clip(r, 0.8, 1.2) * A), by hand for both signs of A and r outside
    [1 - eps, 1 + eps]. The gradient w.r.t. logp is -A * r where the unclipped term is the min,
    else 0 (the clamp is flat)."""
    up, down = math.exp(0.5), math.exp(-0.5)  # ratios 1.6487 > 1.2 and 0.6065 < 0.8
    cases = [  # (log ratio, A, per-token loss, d loss / d logp, clipped?)
        (0.5, -1.0, up, up, False),  # A<0, r>1+eps: min(-1.6487, -1.2) = -1.6487 (unclipped)
        (-0.5, -1.0, 0.8, 0.0, True),  # A<0, r<1-eps: min(-0.6065, -0.8) = -0.8 (clipped)
        (0.5, 2.0, -2.4, 0.0, True),  # A>0, r>1+eps: min(3.2974, 2.4) = 2.4 (clipped)
        (-0.5, 2.0, -2 * down, -2 * down, False),  # A>0, r<1-eps: min(1.2131, 1.6) = 1.2131
    ]
    for log_r, a, want_loss, want_grad, clipped in cases:
        loss, sums, grad = _one_token_each([log_r], [a])
        assert loss == pytest.approx(want_loss, rel=1e-6), (log_r, a)
        assert grad[0] == pytest.approx(want_grad, rel=1e-6, abs=1e-9), (log_r, a)
        assert sums.clipped_tokens == int(clipped), (log_r, a)
    # All four at once: the sums add up (2 of 4 tokens clipped), ratio stats by hand.
    loss, sums, _ = _one_token_each([c[0] for c in cases], [c[1] for c in cases])
    assert loss == pytest.approx(up + 0.8 - 2.4 - 2 * down, rel=1e-6)
    assert sums.means()["clip_fraction"] == 0.5
    assert sums.ratio_max == pytest.approx(up) and sums.ratio_min == pytest.approx(down)
    assert sums.means()["ratio_mean"] == pytest.approx((2 * up + 2 * down) / 4)


def test_k3_kl_value_and_gradient_hand_computed():
    """k3 = exp(ref - logp) - (ref - logp) - 1 and d k3 / d logp = 1 - exp(ref - logp), by hand:
    ref - logp = 0.5 gives k3 = e^0.5 - 1.5 = 0.148721 and gradient 1 - e^0.5 = -0.648721;
    ref - logp = -0.7 gives k3 = e^-0.7 - 0.3 = 0.196585 and gradient 1 - e^-0.7 = 0.503415.
    (The other direction, exp(logp - ref) - (logp - ref) - 1, gives 0.106531 and 0.313753.)"""
    logp = torch.tensor([[-2.0], [-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5], [-1.7]])
    kl_coef = 0.1
    loss, sums = grpo_loss_sums(logp, logp.detach().clone(), ref, torch.zeros(2),
                                torch.ones(2, 1), kl_coef=kl_coef)
    loss.backward()
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-0.7) + 0.7 - 1]
    assert k3 == pytest.approx([0.148721, 0.196585], abs=1e-6)
    assert sums.kl_sum == pytest.approx(sum(k3), rel=1e-6)
    assert loss.item() == pytest.approx(kl_coef * sum(k3), rel=1e-6)  # A = 0: KL term only
    grad = [kl_coef * (1 - math.exp(0.5)), kl_coef * (1 - math.exp(-0.7))]
    assert logp.grad[:, 0].tolist() == pytest.approx(grad, rel=1e-6)
    assert grad == pytest.approx([-0.0648721, 0.0503415], abs=1e-7)


def test_is_weight_is_truncated_at_cap():
    old = _logps(4)
    behaviour = old - 5.0  # exp(5) >> cap
    adv = torch.ones(4)
    mask = torch.ones(4, 6)
    _, sums = grpo_loss_sums(
        old, old, None, adv, mask, behaviour_logp=behaviour, is_correction=True, is_cap=2.0
    )
    assert sums.is_capped_tokens == 24 and sums.is_weight_sum == pytest.approx(48.0)
    assert sums.policy_loss_sum == pytest.approx(-2.0 * 24)
    _, small = grpo_loss_sums(
        old, old, None, adv, mask, behaviour_logp=old + 0.5, is_correction=True, is_cap=2.0
    )
    assert small.is_capped_tokens == 0
    assert small.is_weight_sum == pytest.approx(24 * math.exp(-0.5), rel=1e-5)


def test_loss_sums_add_up():
    a = LossSums(loss_sum=1.0, num_tokens=3, ratio_max=1.1, clipped_tokens=1)
    b = LossSums(loss_sum=2.0, num_tokens=5, ratio_max=1.3, clipped_tokens=2)
    c = a + b
    assert (c.loss_sum, c.num_tokens, c.ratio_max, c.clipped_tokens) == (3.0, 8, 1.3, 3)
    assert c.means()["clip_fraction"] == pytest.approx(3 / 8)


def _rows(n: int, seed: int):
    rng = random.Random(seed)
    return [
        (
            [1, *[rng.randrange(4, 21) for _ in range(rng.randint(2, 6))]],
            [rng.randrange(4, 21) for _ in range(rng.randint(1, 5))],
        )
        for _ in range(n)
    ]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_microbatched_sums_equal_full_batch_token_mean_in_any_order():
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok).train()
    rows = _rows(10, seed=0)
    adv = torch.randn(10, generator=torch.Generator().manual_seed(1))
    ref_model = build_tiny_model(TinyModelSpec(**{**SPEC.__dict__, "seed": 5}), tok)

    def loss_of(idx):
        b = build_token_batch([rows[i] for i in idx])
        logp = response_logprobs(model, b.input_ids, b.attention_mask, b.response_mask)
        with torch.no_grad():
            ref = response_logprobs(ref_model, b.input_ids, b.attention_mask, b.response_mask)
        old = logp.detach() - 0.05  # ratio != 1 so clipping and the ratio path matter
        return grpo_loss_sums(logp, old, ref, adv[idx], b.response_mask, kl_coef=0.05)

    loss, sums = loss_of(list(range(10)))
    (loss / sums.num_tokens).backward()
    full = _grads(model)
    for seed in (0, 1):
        model.zero_grad(set_to_none=True)
        order = list(range(10))
        random.Random(seed).shuffle(order)
        total = LossSums()
        for chunk in (order[:3], order[3:4], order[4:]):
            part_loss, part = loss_of(chunk)
            part_loss.backward()
            total = total + part
        assert total.num_tokens == sums.num_tokens
        scale_gradients(model, 1.0 / total.num_tokens)
        micro = _grads(model)
        worst = max((micro[n] - full[n]).abs().max().item() for n in full)
        assert worst <= 1e-6


def test_response_logprobs_match_manual_and_zero_outside_response():
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok)
    rows = _rows(3, seed=2)
    b = build_token_batch(rows, pad_token_id=0)
    with torch.no_grad():
        got = response_logprobs(
            model, b.input_ids, b.attention_mask, b.response_mask, temperature=0.8
        )
        prompt, resp = rows[1]
        ids = torch.tensor([prompt + resp])
        logits = model(ids).logits[0].float() / 0.8
        lp = torch.log_softmax(logits, -1)
        want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(resp)]
    mask = b.response_mask[1].bool()
    assert torch.allclose(got[1][mask], torch.tensor(want), atol=1e-5)
    assert bool((got[~b.response_mask.bool()] == 0).all())


def test_optimizer_step_clips_and_zeroes_grads():
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok)
    opt = make_optimizer(model, lr=1e-3)
    before = model.model.norm.weight.detach().clone()
    out = model(torch.tensor([[1, 5, 6]])).logits.sum() * 1e3
    out.backward()
    norm = optimizer_step(model, opt, max_grad_norm=1.0)
    assert norm > 1.0
    assert all(p.grad is None for p in model.parameters())
    assert not torch.equal(before, model.model.norm.weight)
    with pytest.raises(ValueError, match="lr"):
        make_optimizer(model, lr=0.0)


def test_lr_warmup_ramps_linearly_then_holds():
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok)
    opt = make_optimizer(model, lr=1e-3, warmup_steps=4)
    seen = []
    for _ in range(6):
        model(torch.tensor([[1, 5, 6]])).logits.sum().backward()
        optimizer_step(model, opt, max_grad_norm=None)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(model, lr=1e-3, warmup_steps=-1)


def test_lr_warmup_resumes_where_the_saved_optimizer_left_it():
    # The ramp's position is saved with the optimizer (a resumed run must not ramp up again).
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok)
    opt = make_optimizer(model, lr=1e-3, warmup_steps=4)
    for _ in range(2):
        model(torch.tensor([[1, 5, 6]])).logits.sum().backward()
        optimizer_step(model, opt, max_grad_norm=None)
    resumed = make_optimizer(model, lr=1e-3, warmup_steps=4)
    resumed.load_state_dict(opt.state_dict())
    model(torch.tensor([[1, 5, 6]])).logits.sum().backward()
    optimizer_step(model, resumed, max_grad_norm=None)
    assert resumed.param_groups[0]["lr"] == pytest.approx(7.5e-4)
