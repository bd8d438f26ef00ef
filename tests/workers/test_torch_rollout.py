"""TorchRolloutEngine: KV-cache sampling equals naive decoding; log-probs, stops, seeds, weights."""

from __future__ import annotations

import pytest
import torch

from workers.engines.base import RolloutEngine, SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.tokens import build_token_batch, response_logprobs, to_token_tensor

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


# -- per-group seeds ---------------------------------------------------------------------------
def _tokens_and_logprobs(groups):
    return [g.token_ids for g in groups], [g.logprobs for g in groups]


def test_a_group_samples_the_same_alone_or_batched_with_other_groups(model, tok):
    prompts = _prompt_ids(tok)
    seeds = (101, 202, 303, 404, 505)
    params = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=8, prompt_seeds=seeds)
    together = {
        rows: TorchRolloutEngine(model, tok, max_batch_size=rows).generate(prompts, 4, params)
        for rows in (None, 3, 8)  # one batch; chunks that cut groups apart; other chunks
    }
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        alone = TorchRolloutEngine(model, tok).generate(
            [prompt], 4, SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=8,
                                        prompt_seeds=(seed,))
        )[0]
        want_tokens, want_lp = _tokens_and_logprobs(alone)
        for out in together.values():
            got_tokens, got_lp = _tokens_and_logprobs(out[i])
            assert got_tokens == want_tokens
            for a, b in zip(got_lp, want_lp, strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    # Reordering the other groups changes nothing either; a group's own seed does.
    swapped = TorchRolloutEngine(model, tok).generate(
        prompts[::-1], 4, SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=8,
                                         prompt_seeds=seeds[::-1])
    )
    assert [g.token_ids for g in swapped[-1]] == [g.token_ids for g in together[None][0]]
    reseeded = TorchRolloutEngine(model, tok).generate(
        prompts[:1], 4, SamplingParams(temperature=1.5, max_new_tokens=8, prompt_seeds=(7,))
    )
    assert [g.token_ids for g in reseeded[0]] != [g.token_ids for g in together[None][0]]
    # The samples of one group differ from each other (each row has its own stream).
    assert len({tuple(g.token_ids) for g in together[None][0]}) > 1
    with pytest.raises(ValueError, match="prompt_seeds has 1 seeds for 5 prompts"):
        TorchRolloutEngine(model, tok).generate(prompts, 1, SamplingParams(prompt_seeds=(1,)))


def test_sampling_draws_from_the_tempered_top_p_distribution(tok):
    # Inverse-CDF sampling: the empirical frequency of the first token matches its probability.
    model = _peaked_model(tok, scale=0.3)
    prompt = _prompt_ids(tok)[0]
    temperature, top_p = 1.3, 0.8
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float() / temperature
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < top_p]
    nucleus = torch.zeros_like(probs)
    nucleus[keep] = probs[keep] / probs[keep].sum()
    n = 4000
    out = TorchRolloutEngine(model, tok).generate(
        [prompt], n, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=1, seed=5)
    )[0]
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in out]), minlength=len(probs))
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(keep.tolist())
    freq = counts.float() / n
    # 4 standard errors of a binomial proportion
    assert torch.all((freq - nucleus).abs() <= 4 * (nucleus * (1 - nucleus) / n).sqrt() + 1e-3)


def test_rollout_stage_seeds_each_group_by_its_own_id(model, tok, tmp_path):
    # Before: the claim's first group id seeded the whole call, so a group's responses depended
    # on which groups it was claimed with (identical redelivery needed groups_per_claim = 1).
    import pyarrow as pa

    from storage.schema import ROW_ID, Lease
    from workers.roles.rollout import RolloutStage
    from workers.weights.file_sync import WeightSubscriber

    group_size = 3
    prompts = {7: _prompt_ids(tok)[0], 8: _prompt_ids(tok)[1], 9: _prompt_ids(tok)[2]}

    def claim(group_ids):
        gids = [g for g in group_ids for _ in range(group_size)]
        batch = pa.RecordBatch.from_pydict({
            "group_id": pa.array(gids, pa.int64()),
            "iteration": pa.array([0] * len(gids), pa.int64()),
            "min_policy_version": pa.array([0] * len(gids), pa.int64()),
            "prompt_ids": pa.array([prompts[g] for g in gids], pa.list_(pa.int32())),
            ROW_ID: pa.array(range(len(gids)), pa.uint64()),
        })
        stage = RolloutStage(
            TorchRolloutEngine(model, tok), WeightSubscriber(tmp_path),
            SamplingParams(temperature=1.5, max_new_tokens=6), worker="r", group_size=group_size,
            groups_per_claim=len(group_ids), seed=3, weight_wait_s=1.0, tail_cut=False)
        out = stage.process(Lease(1, "t", "rollout", 0, 0.0, batch)).to_pydict()
        by_group: dict[int, list] = {}
        for g, ids, lp in zip(gids, out["response_ids"], out["response_logprobs"], strict=True):
            by_group.setdefault(g, []).append((ids, lp))
        return by_group

    alone = {g: claim([g])[g] for g in prompts}
    for together in (claim([7, 8, 9]), claim([9, 8, 7]), claim([8, 9])):
        for g, samples in together.items():
            assert [ids for ids, _ in samples] == [ids for ids, _ in alone[g]]
            for (_, a), (_, b) in zip(samples, alone[g], strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


# -- attention implementation ----------------------------------------------------------------
@pytest.mark.parametrize("weights", ["embedded", "peaked"])
def test_sdpa_and_eager_give_the_same_tokens_and_logprobs_with_padding(tok, weights):
    """The rollout default (sdpa) against eager on the embedded model: left-padded prompts of
    different lengths in one batch (generation), right-padded rows (the trainer's recomputation).
    """
    def make(attn):
        if weights == "embedded":
            m = build_tiny_model(TinyModelSpec(), tok)  # the embedded model as built (default init)
        else:
            m = _peaked_model(tok, scale=0.5)
        m.set_attn_implementation(attn)
        assert m.config._attn_implementation == attn
        return m

    eager, sdpa = make("eager"), make("sdpa")
    prompts = _prompt_ids(tok) + [encode_prompt(tok, "1234+5678=")]
    assert len({len(p) for p in prompts}) > 2  # several pad widths
    outs = {}
    for name, m in (("eager", eager), ("sdpa", sdpa)):
        engine = TorchRolloutEngine(m, tok)
        outs[name] = (
            engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12, seed=9)),
            engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=12)),
        )
    for got_all, want_all in zip(outs["sdpa"], outs["eager"], strict=True):
        for got_group, want_group in zip(got_all, want_all, strict=True):
            for got, want in zip(got_group, want_group, strict=True):
                assert got.token_ids == want.token_ids
                diff = (torch.tensor(got.logprobs) - torch.tensor(want.logprobs)).abs()
                assert torch.isfinite(torch.tensor(got.logprobs)).all() and diff.max() <= 1e-5
    pairs = [(p, g.token_ids) for p, group in zip(prompts, outs["eager"][0], strict=True)
             for g in group]
    batch = build_token_batch(pairs, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        lp = [
            response_logprobs(m, batch.input_ids, batch.attention_mask, batch.response_mask)
            for m in (eager, sdpa)
        ]
    assert torch.isfinite(lp[1]).all() and (lp[0] - lp[1]).abs().max() <= 1e-5
