"""Unified tri-model: the fused reference equals a standalone reference, its bf16 copy, bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from workers.rl.packing import PackGroup
from workers.rl.trimodel import TriModel

torch.set_num_threads(1)
VOCAB = 64


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(config).float()


def groups(seed: int = 0) -> list[PackGroup]:
    gen = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    return [
        PackGroup(10, tok(5), [tok(3), tok(1), tok(7)]),
        PackGroup(11, tok(3), [tok(4), tok(2)]),
    ]


def standalone(model, gs):
    """An independent frozen forward, one unpadded sequence per response."""
    out = []
    with torch.no_grad():
        for g in gs:
            per = []
            for r in g.responses:
                logits = model(input_ids=torch.tensor([g.prompt_ids + r])).logits[0]
                p = len(g.prompt_ids)
                logp = torch.log_softmax(logits[p - 1 : p + len(r) - 1].float(), -1)
                per.append(logp.gather(1, torch.tensor(r)[:, None])[:, 0])
            out.append(per)
    return out


def flat(nested):
    return torch.cat([t.detach() for g in nested for t in g])


def sgd_step(tri, gs, lr=0.05):
    out = tri.forward(gs, token_budget=64, min_saving=0.0)
    (-flat_grad(out.policy)).backward()
    with torch.no_grad():
        for p in tri.policy.parameters():
            p -= lr * p.grad
            p.grad = None


def flat_grad(nested):
    return torch.cat([t for g in nested for t in g]).sum()


@pytest.mark.parametrize("pack", [True, False])
def test_fused_reference_equals_a_standalone_frozen_reference(pack):
    policy = tiny_policy()
    initial = copy.deepcopy(policy).eval()
    tri = TriModel(policy, reference="copy")
    sgd_step(tri, groups(1))  # the policy moves; the reference must not
    out = tri.forward(groups(), token_budget=64, min_saving=0.0, pack=pack)
    assert out.batch.packed is pack
    assert float((flat(out.ref) - flat(standalone(initial, groups()))).abs().max()) <= 1e-5
    assert float((flat(out.policy) - flat(out.ref)).abs().max()) > 1e-3  # it did move
    assert all(not p.requires_grad for p in tri.reference.parameters())


def test_reference_loaded_from_a_model_directory(tmp_path):
    ref_model = tiny_policy(seed=5)
    ref_model.save_pretrained(tmp_path)
    tri = TriModel(tiny_policy(), reference=str(tmp_path))
    out = tri.forward(groups(), token_budget=64, min_saving=0.0)
    assert float((flat(out.ref) - flat(standalone(ref_model.eval(), groups()))).abs().max()) <= 1e-5


def test_no_reference_holds_no_frozen_copy():
    """The old policy is never a held copy (the trainer keeps the first pass's log-probs, see
    tests/workers/test_trainer.py); without a reference nothing frozen is held at all."""
    tri = TriModel(tiny_policy(), reference=None)
    assert tri.reference is None and tri.extra_bytes() == 0
    out = tri.forward(groups(), token_budget=64, min_saving=0.0)
    assert out.ref is None
    assert all(t.requires_grad for g in out.policy for t in g)


def test_bf16_frozen_reference_halves_the_extra_bytes():
    policy = tiny_policy()
    full = TriModel(policy, reference="copy")
    half = TriModel(policy, reference="copy", frozen_dtype=torch.bfloat16)
    param_bytes = sum(p.numel() * 4 for p in policy.parameters())
    # one fp32 reference copy: its parameters plus small buffers (rotary frequencies)
    assert param_bytes <= full.extra_bytes() < 1.01 * param_bytes
    assert half.extra_bytes() < 0.6 * full.extra_bytes()
    assert next(half.reference.parameters()).dtype == torch.bfloat16
    out = half.forward(groups(), token_budget=64, min_saving=0.0)
    assert flat(out.ref).dtype == torch.float32
    want = flat(standalone(copy.deepcopy(policy).eval(), groups()))
    assert float((flat(out.ref) - want).abs().max()) < 0.1  # bf16 rounding only


def test_bad_arguments():
    with pytest.raises(TypeError, match="reference"):
        TriModel(tiny_policy(), reference=3.5)
    with pytest.raises(FileNotFoundError, match="reference model directory"):
        TriModel(tiny_policy(), reference="/nonexistent/ref-model")
