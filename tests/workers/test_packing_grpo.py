"""A few GRPO-style AdamW steps give the same parameters with packing on and off."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from workers.rl.packing import PackGroup, packed_response_logprobs

torch.set_num_threads(1)
VOCAB = 64


def random_groups(step: int, num_groups: int = 3, group_size: int = 4):
    gen = torch.Generator().manual_seed(100 + step)
    tok = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    groups, rewards = [], []
    for gi in range(num_groups):
        prompt = tok(int(torch.randint(2, 9, (1,), generator=gen)))
        lens = torch.randint(1, 12, (group_size,), generator=gen).tolist()
        groups.append(PackGroup(gi, prompt, [tok(n) for n in lens]))
        rewards.append(torch.rand(group_size, generator=gen))
    return groups, rewards


def grpo_loss_sum(logps, rewards):
    """Token-sum policy-gradient loss with group-normalised advantages (ratio 1, on-policy)."""
    total = torch.zeros(())
    for per_response, r in zip(logps, rewards, strict=True):
        adv = (r - r.mean()) / (r.std() + 1e-6)
        for a, lp in zip(adv, per_response, strict=True):
            total = total - a * lp.sum()
    return total


def train(model, pack: bool, steps: int = 3):
    # eps 1e-5 rather than 1e-8: Adam divides by sqrt(v) + eps, so a parameter whose true gradient
    # is 0 (the key bias: softmax ignores a per-query constant) would turn pure float round-off
    # into lr-sized steps in opposite directions for the two runs.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-5)
    for step in range(steps):
        groups, rewards = random_groups(step)
        logps = packed_response_logprobs(model, groups, token_budget=48, min_saving=0.0, pack=pack)
        num_tokens = sum(len(t) for g in logps for t in g)
        opt.zero_grad(set_to_none=True)
        (grpo_loss_sum(logps, rewards) / num_tokens).backward()
        opt.step()
    return model


def test_grpo_steps_packed_equal_unpacked():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    initial = AutoModelForCausalLM.from_config(config).float()
    packed = train(copy.deepcopy(initial), pack=True)
    unpacked = train(copy.deepcopy(initial), pack=False)
    for (name, p), q in zip(packed.named_parameters(), unpacked.parameters(), strict=True):
        assert float((p - q).detach().abs().max()) <= 1e-5, name
    moved = torch.cat(
        [
            (p - p0).detach().abs().flatten()
            for p, p0 in zip(packed.parameters(), initial.parameters(), strict=True)
        ]
    )
    assert float(moved.median()) > 1e-4  # the steps really moved the parameters, far beyond 1e-5
