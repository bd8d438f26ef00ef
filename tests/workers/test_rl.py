"""Token batches, the unpacked log-prob forward, order-free gradient accumulation of the loss sums,
and the optimizer helpers (the objectives themselves: test_objectives.py)."""

from __future__ import annotations

import random

import pytest
import torch
from testkit import objective

from workers.engines.optim import make_optimizer, optimizer_step, scale_gradients
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer
from workers.rl.objectives import LossSums, loss_sums
from workers.rl.tokens import build_token_batch, response_logprobs

torch.set_num_threads(1)
SPEC = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


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
        return loss_sums(objective(kl_coef=0.05), logp, old, adv[idx], b.response_mask,
                         ref_logp=ref)

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


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_every_optimizer_walk_is_independent_of_parameter_order(impl):
    """The same gradients give bitwise the same parameters whatever order the optimizer gets
    the parameters in (a trainer that registers them differently after a restart, DeepSpeed's
    flat groups); "foreach" matches torch's reference loop bitwise and "fused" to rounding, and
    a resumed optimizer continues alike. Breaks if a walk mixes elements across tensors."""
    from workers.engines.optim import make_optimizer, optimizer_step, scale_gradients

    def trained(walk: str, reverse: bool, steps: int = 4) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8) for _ in range(3)]
        # the same layers, their parameters registered in the opposite order
        model = torch.nn.Sequential(*(reversed(layers) if reverse else layers))
        opt = make_optimizer(model, lr=1e-2, weight_decay=0.01, warmup_steps=2, impl=walk)
        gen = torch.Generator().manual_seed(1)
        for step in range(steps):
            if step == 2:  # a resume halfway: state saved and loaded into a fresh optimizer
                fresh = make_optimizer(model, lr=1e-2, weight_decay=0.01, warmup_steps=2,
                                       impl=walk)
                fresh.load_state_dict(opt.state_dict())
                opt = fresh
            for layer in layers:  # each layer's gradient, whatever its position in the model
                torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
                for p in layer.parameters():
                    p.grad = torch.randn(p.shape) * 3.0
            scale_gradients(model, 0.5)
            optimizer_step(model, opt, max_grad_norm=None)
        return [p.detach().clone() for layer in layers for p in layer.parameters()]

    forward, backward = trained(impl, False), trained(impl, True)
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    reference = trained("single", False)
    for a, b in zip(forward, reference, strict=True):
        if impl == "fused":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="impl"):
        make_optimizer(torch.nn.Linear(2, 2), lr=1e-3, impl="apex")
