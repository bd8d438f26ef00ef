"""TorchRolloutEngine: KV-cache sampling equals naive decoding; log-probs, stops, seeds, weights."""

from __future__ import annotations

import pytest
import torch

from workers.engines.base import RolloutEngine, SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models import TinyModelSpec, build_tiny_model
from workers.rl import build_token_batch, response_logprobs, to_token_tensor
from workers.tokenizer import build_char_tokenizer, encode_prompt

torch.set_num_threads(1)
SPEC = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
PROMPTS = ["12+34=", "7+5=", "99+99=", "3+40=", "0+0="]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _peaked_model(tok, seed: int = 0, scale: float = 1.0):
    """A random model with peaked, varied next-token distributions (no near-ties for argmax).

    The default init (std 0.02) gives near-uniform logits whose argmax could flip on float noise.
    """
    model = build_tiny_model(TinyModelSpec(**{**SPEC.__dict__, "seed": seed}), tok)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * scale * (1.0 if "embed" in name else 0.5)
                )
    return model


@pytest.fixture(scope="module")
def model(tok):
    return _peaked_model(tok)


def _prompt_ids(tok):
    return [encode_prompt(tok, p) for p in PROMPTS]


@torch.no_grad()
def _naive_greedy(model, prompt, max_new, stop_ids):
    ids = list(prompt)
    out, lps = [], []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        t = int(logp.argmax())
        out.append(t)
        lps.append(float(logp[t]))
        ids.append(t)
        if t in stop_ids:
            break
    return out, lps


def test_engine_satisfies_protocol(model, tok):
    assert isinstance(TorchRolloutEngine(model, tok), RolloutEngine)


def test_greedy_equals_naive_loop_with_left_padding(model, tok):
    engine = TorchRolloutEngine(model, tok, max_batch_size=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=7)
    batched = engine.generate(_prompt_ids(tok), 2, params)
    assert len(batched) == len(PROMPTS) and all(len(g) == 2 for g in batched)
    for prompt, gens in zip(_prompt_ids(tok), batched, strict=True):
        want, want_lp = _naive_greedy(model, prompt, 7, {tok.eos_token_id})
        alone = engine.generate([prompt], 1, params)[0][0]
        for g in (*gens, alone):
            assert g.token_ids == want
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(want_lp), atol=1e-5)


def test_sampled_logprobs_equal_full_forward_recomputation(tok):
    # Milder weights than the other tests: float error grows with the logits' magnitude, and a
    # trained LM's logits are nearer this scale than the extreme random model's.
    model = _peaked_model(tok, scale=0.5)
    engine = TorchRolloutEngine(model, tok, max_batch_size=6)
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=6, seed=11)
    gens = engine.generate(_prompt_ids(tok), 3, params)
    pairs, behaviour = [], []
    for prompt, group in zip(_prompt_ids(tok), gens, strict=True):
        for g in group:
            pairs.append((prompt, g.token_ids))
            behaviour.append(g.logprobs)
    batch = build_token_batch(pairs, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        recomputed = response_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.response_mask,
            temperature=temperature,
        )
    expected = to_token_tensor(behaviour, batch.response_mask)
    assert (recomputed - expected).abs().max().item() <= 1e-5


def test_same_seed_same_outputs_and_different_seed_differs(model, tok):
    engine = TorchRolloutEngine(model, tok)
    p = SamplingParams(temperature=1.5, max_new_tokens=8, seed=3)
    a = engine.generate(_prompt_ids(tok), 4, p)
    b = engine.generate(_prompt_ids(tok), 4, p)
    c = engine.generate(
        _prompt_ids(tok), 4, SamplingParams(temperature=1.5, max_new_tokens=8, seed=4)
    )
    tokens = lambda gs: [g.token_ids for group in gs for g in group]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


def test_stop_tokens_end_generation_and_are_included(model, tok):
    engine = TorchRolloutEngine(model, tok)
    greedy = engine.generate(_prompt_ids(tok), 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    first = greedy[0][0].token_ids[0]
    stop = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(first,))
    g = engine.generate(_prompt_ids(tok)[:1], 1, stop)[0][0]
    assert g.token_ids == [first] and g.finish_reason == "stop" and len(g.logprobs) == 1
    # Sampling: every generation ends at its first stop token or at exactly max_new_tokens.
    stops = {3, 5, 7, tok.eos_token_id}
    params = SamplingParams(temperature=2.0, max_new_tokens=6, stop_token_ids=(3, 5, 7), seed=0)
    reasons = set()
    for group in engine.generate(_prompt_ids(tok), 8, params):
        for g in group:
            assert len(g.token_ids) == len(g.logprobs) <= 6
            hits = [i for i, t in enumerate(g.token_ids) if t in stops]
            if g.finish_reason == "stop":
                assert hits == [len(g.token_ids) - 1]
            else:
                assert g.finish_reason == "length" and not hits and len(g.token_ids) == 6
            reasons.add(g.finish_reason)
    assert reasons == {"stop", "length"}


def test_top_p_tiny_is_greedy_but_logprobs_are_untruncated(model, tok):
    engine = TorchRolloutEngine(model, tok)
    greedy = engine.generate(_prompt_ids(tok), 1, SamplingParams(temperature=0.0, max_new_tokens=4))
    nucleus = engine.generate(
        _prompt_ids(tok), 2, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=4, seed=1)
    )
    for g0, group in zip(greedy, nucleus, strict=True):
        for g in group:
            assert g.token_ids == g0[0].token_ids
            # temperature 1: the behaviour log-prob is the full-vocab one, not log(1) = 0.
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(g0[0].logprobs), atol=1e-6)
            assert all(lp < 0 for lp in g.logprobs)


def test_load_weights_changes_outputs_and_version(tok):
    engine = TorchRolloutEngine(_peaked_model(tok, seed=0), tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(_prompt_ids(tok), 1, params)
    other = _peaked_model(tok, seed=1).state_dict()
    engine.load_weights(other, version=3)
    assert engine.policy_version == 3
    after = engine.generate(_prompt_ids(tok), 1, params)
    assert [g[0].token_ids for g in before] != [g[0].token_ids for g in after]
    with pytest.raises(KeyError, match="unknown parameter"):
        engine.load_weights({"nope.weight": torch.zeros(1)}, version=4)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match=name):
        engine.load_weights({name: torch.zeros(3)}, version=4)
    assert engine.policy_version == 3


def test_bad_arguments_are_clear_errors(model, tok):
    engine = TorchRolloutEngine(model, tok)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
