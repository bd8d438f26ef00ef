"""Shared-prompt packing: layout, exactness of log-probs and gradients, errors, fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from workers.rl import packing
from workers.rl.packing import (
    PackGroup,
    PackingError,
    PackingFallbackWarning,
    PackingUnsupportedError,
    batch_logprobs,
    pack_groups,
    packed_response_logprobs,
    packing_unsupported_reason,
    unpacked_rows,
)

torch.set_num_threads(1)
VOCAB = 64


def tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param)


def make_groups(prompt_lens, response_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for gi, (p, lens) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        tok = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
        groups.append(PackGroup(100 + gi, tok(p), [tok(n) for n in lens]))
    return groups


def reference_logprobs(model, groups, temperature=1.0):
    """Straightforward unpacked forward: one unpadded sequence per response."""
    out = []
    for g in groups:
        per = []
        for r in g.responses:
            ids = torch.tensor([g.prompt_ids + r])
            logits = model(input_ids=ids).logits[0].float() / temperature
            p = len(g.prompt_ids)
            logp = torch.log_softmax(logits[p - 1 : p + len(r) - 1], dim=-1)
            per.append(logp.gather(1, torch.tensor(r)[:, None])[:, 0])
        out.append(per)
    return out


def weighted_loss(logps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(())
    for g in logps:
        for t in g:
            total = total + (t * torch.rand(t.shape, generator=gen)).sum()
    return total


def grads(model, fn):
    model.zero_grad(set_to_none=True)
    weighted_loss(fn()).backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def max_diff(a, b):
    return max(
        float((x - y).detach().abs().max())
        for ga, gb in zip(a, b, strict=True)
        for x, y in zip(ga, gb, strict=True)
    )


# (prompt lengths, response lengths per group, token_budget, max_responses_per_row)
SCENARIOS = {
    "length-1 responses": ([5, 3], [[1, 1, 1, 1], [1, 1]], 64, None),
    "very uneven lengths": ([4, 7], [[1, 40, 2, 17], [33, 1]], 128, None),
    "m=1 per row": ([6], [[5, 9, 3, 7]], 64, 1),
    "m=G/2 per row": ([6], [[5, 9, 3, 7]], 64, 2),
    "m=G per row": ([6], [[5, 9, 3, 7]], 64, 4),
    "several groups per row": ([3, 5, 2], [[4, 2], [1, 6, 3], [7]], 64, None),
    "group split by budget, padded rows": ([8, 4], [[10, 12, 9, 11], [3, 2]], 32, None),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_packed_logprobs_and_grads_equal_unpacked(model, name, attention):
    prompts, lens, budget, m = SCENARIOS[name]
    groups = make_groups(prompts, lens)
    batch = pack_groups(groups, token_budget=budget, max_responses_per_row=m)
    temperature = 0.7
    want = reference_logprobs(model, groups, temperature)
    got = batch_logprobs(model, batch, temperature=temperature, attention=attention)
    assert [[len(t) for t in g] for g in got] == lens
    assert max_diff(got, want) <= 1e-5
    g_packed = grads(
        model, lambda: batch_logprobs(model, batch, temperature=temperature, attention=attention)
    )
    g_ref = grads(model, lambda: reference_logprobs(model, groups, temperature))
    assert float((g_packed - g_ref).norm() / g_ref.norm()) <= 1e-5
    # the switch: unpacked rows give the same numbers
    unp = packed_response_logprobs(
        model, groups, temperature=temperature, token_budget=budget, min_saving=0.0, pack=False
    )
    assert max_diff(unp, want) <= 1e-5


def test_layout_of_a_packed_row():
    g = PackGroup(7, [11, 12, 13], [[21, 22], [31], [41, 42, 43]])
    b = pack_groups([g], token_budget=16, pad_id=0)
    assert b.num_rows == 1 and b.seq_len == 9 and b.packed
    assert b.input_ids[0].tolist() == [11, 12, 13, 21, 22, 31, 41, 42, 43]
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5]
    # the first token of every response is scored from the prompt's last position (2)
    assert b.target_pos.tolist() == [2, 3, 2, 2, 6, 7]
    assert b.target_token.tolist() == [21, 22, 31, 41, 42, 43]
    targets = list(zip(b.target_row.tolist(), b.target_pos.tolist(), strict=True))
    assert targets[3:] == [(0, 2), (0, 6), (0, 7)]  # (row, position) scoring response 2
    mask = b.attention_mask[0, 0]
    assert mask[5, :3].all() and not mask[5, 3:5].any()  # r2 sees the prompt, not r1
    assert mask[7, 6] and not mask[6, 7]  # causal inside r3
    assert not mask[6, 3:6].any()  # r3 never sees its siblings


def test_split_group_gets_a_prompt_copy_per_chunk_and_padding_is_masked():
    g = PackGroup(3, [1, 2, 3, 4], [[5] * 6, [6] * 6, [7] * 2])
    b = pack_groups([g], token_budget=12)
    assert len(b.chunks) == 2 and b.num_rows == 2
    assert [c.response_indices for c in b.chunks] == [(0,), (1, 2)]
    assert b.input_ids[0, :4].tolist() == [1, 2, 3, 4] == b.input_ids[1, :4].tolist()
    assert b.token_mask[0].tolist() == [True] * 10 + [False] * 2  # padding at the end
    pad_rows = b.attention_mask[0, 0, 10:]
    assert pad_rows.sum(dim=1).tolist() == [1, 1]  # a pad sees only itself
    assert not b.attention_mask[0, 0, :10, 10:].any()  # nobody sees a pad


def test_max_responses_per_row_sets_the_chunks():
    g = PackGroup(0, [1, 2], [[3], [4], [5], [6]])
    for m, chunks in [(1, 4), (2, 2), (4, 1)]:
        b = pack_groups([g], token_budget=64, max_responses_per_row=m)
        assert len(b.chunks) == chunks
        assert b.num_rows == 1  # the chunks still share one row
        assert b.num_tokens == 4 + 2 * chunks


def test_results_follow_input_order_not_layout(model):
    groups = make_groups([3, 6, 2], [[4, 2], [1, 6], [7, 5]], seed=3)
    a = packed_response_logprobs(model, groups, token_budget=24, min_saving=0.0)
    b = packed_response_logprobs(model, groups[::-1], token_budget=24, min_saving=0.0)
    assert max_diff(a, b[::-1]) == pytest.approx(0.0, abs=1e-6)
    assert pack_groups(groups, token_budget=24).group_ids == [100, 101, 102]


def test_empty_response_gives_an_empty_tensor(model):
    groups = [PackGroup(1, [3, 4], [[5, 6], [], [7]])]
    got = packed_response_logprobs(model, groups, token_budget=16, min_saving=0.0)
    assert [len(t) for t in got[0]] == [2, 0, 1]
    want = reference_logprobs(model, [PackGroup(1, [3, 4], [[5, 6], [7]])])[0]
    assert max_diff([[got[0][0], got[0][2]]], [want]) <= 1e-5


@pytest.mark.parametrize(
    "groups, kwargs, match",
    [
        ([], {"token_budget": 8}, "no groups"),
        ([PackGroup(1, [1], [[2]])], {"token_budget": 1}, "token_budget"),
        ([PackGroup(1, [1, 2], [[2] * 9])], {"token_budget": 8}, "group 1 response 0"),
        ([PackGroup(1, [], [[2]])], {"token_budget": 8}, "empty prompt"),
        ([PackGroup(1, [1], [[2]]), PackGroup(1, [1], [[3]])], {"token_budget": 8}, "twice"),
        ([PackGroup(1, [1], [[-2]])], {"token_budget": 8}, "negative"),
        (
            [PackGroup(1, [1], [[2]])],
            {"token_budget": 8, "max_responses_per_row": 0},
            "max_responses",
        ),
    ],
)
def test_bad_input_is_a_clear_error(groups, kwargs, match):
    with pytest.raises(PackingError, match=match):
        pack_groups(groups, **kwargs)


def test_token_outside_vocab_and_bad_temperature(model):
    batch = pack_groups([PackGroup(1, [1], [[VOCAB + 3]])], token_budget=8)
    with pytest.raises(PackingError, match="vocab_size"):
        batch_logprobs(model, batch)
    with pytest.raises(ValueError, match="temperature"):
        batch_logprobs(
            model, pack_groups([PackGroup(1, [1], [[2]])], token_budget=8), temperature=0.0
        )


def test_unsupported_model_falls_back_with_a_warning():
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    )
    gpt2.eval()  # GPT-2 has dropout
    groups = make_groups([4], [[3, 5]])
    with pytest.warns(PackingFallbackWarning, match="GPT2LMHeadModel"):
        got = packed_response_logprobs(gpt2, groups, token_budget=32, min_saving=0.0)
    assert max_diff(got, reference_logprobs(gpt2, groups)) <= 1e-5
    with pytest.raises(PackingUnsupportedError):
        batch_logprobs(gpt2, pack_groups(groups, token_budget=32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per model, not on every call
        packed_response_logprobs(gpt2, groups, token_budget=32, min_saving=0.0)


def test_self_check_rejects_an_inexact_attention(monkeypatch):
    broken = tiny_model("qwen2")

    def leaky(module, q, k, v, mask, dropout=0.0, scaling=None, sliding_window=None, **kw):
        kw.pop(packing.LAYOUT_KWARG)  # ignores the layout: plain causal over the whole row
        return sdpa_attention_forward(
            module, q, k, v, None, dropout=dropout, scaling=scaling, **kw
        )

    mapping = AttentionInterface._global_mapping
    monkeypatch.setitem(mapping, packing.ATTENTION_NAME, leaky)
    with pytest.warns(PackingFallbackWarning, match="differ"):
        assert "differ" in packing_unsupported_reason(broken)
    monkeypatch.setitem(mapping, packing.ATTENTION_NAME, packing.shared_prompt_attention)
    assert packing_unsupported_reason(tiny_model("llama")) is None


@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_models_built_with_eager_attention(attention):
    model = tiny_model("llama")  # workers.models.local builds its models with eager attention
    model.config._attn_implementation = "eager"
    groups = make_groups([5, 3], [[4, 1, 6], [2]], seed=5)
    got = batch_logprobs(model, pack_groups(groups, token_budget=40), attention=attention)
    assert max_diff(got, reference_logprobs(model, groups)) <= 1e-5
    assert model.config._attn_implementation == "eager"


def test_model_attention_setting_is_restored_after_a_packed_call(model):
    before = model.config._attn_implementation
    packed_response_logprobs(model, make_groups([3], [[2, 2]]), token_budget=16, min_saving=0.0)
    assert model.config._attn_implementation == before


def test_unpacked_rows_one_response_per_row():
    groups = make_groups([3, 5], [[2, 4], [1]])
    b = unpacked_rows(groups)
    assert not b.packed and b.num_rows == 3 and b.seq_len == 7
    assert b.num_tokens == (3 + 2) + (3 + 4) + (5 + 1)
    assert b.token_mask[0].tolist() == [True] * 5 + [False] * 2


def test_unpacked_rows_feed_the_model_only_up_to_the_last_scored_column(model):
    # rows of 3+2, 3+4 and 5+1 tokens: width 7, but the last scored logit is at column 5 (the
    # 3+4 row's token 6 is scored from column 5; its own logit at column 6 scores nothing)
    groups = make_groups([3, 5], [[2, 4], [1]])
    batch = unpacked_rows(groups)
    assert batch.seq_len == 7 and batch.scored_width == 6
    widths: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: widths.append(int(args[0].shape[1])))
    try:
        got = batch_logprobs(model, batch)
    finally:
        hook.remove()
    assert widths == [6]
    for g_got, g_want in zip(got, reference_logprobs(model, groups), strict=True):
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_forward_slices_are_near_equal_whole_groups_within_the_budget():
    from workers.rl.packing_layout import forward_slices

    def lens(sizes, budget):  # noqa: ANN001, ANN202
        return [len(r) for r in forward_slices(sizes, budget)]

    # G1's iteration: 16 groups of 8 x (6 + 64) tokens in 4096-token forwards -> 3, near equal
    assert lens([560] * 16, 4096) == [6, 5, 5]
    assert lens([560] * 16, 0) == [16] and lens([560] * 4, 4096) == [4]  # 0 or fits: one
    assert forward_slices([], 4096) == []
    # never over the budget, never a group split; one above it stands alone
    slices = forward_slices([100, 5000, 100, 100], 1000)
    assert [list(r) for r in slices] == [[0], [1], [2, 3]]
    sizes = [37, 250, 12, 90, 90, 301, 5, 64, 64, 64, 200]
    for budget in (1, 64, 300, 301, 500, 2000):
        parts = forward_slices(sizes, budget)
        assert [i for r in parts for i in r] == list(range(len(sizes)))
        for r in parts:
            assert len(r) == 1 or sum(sizes[i] for i in r) <= budget, (budget, list(r))


def test_token_saving_and_the_auto_rule():
    from workers.rl.packing import should_pack, token_saving
    from workers.settings import PackingSettings

    short = PackGroup(0, [1] * 6, [[2] * 64 for _ in range(8)])  # 560 tokens unpacked, 518 packed
    assert token_saving([short]) == pytest.approx(1 - 518 / 560)
    assert not should_pack([short])  # ~7 % saved: measured slower packed (docs/engines.md)
    assert should_pack([short], min_saving=0.0)  # 0 = always pack
    long = PackGroup(1, [1] * 64, [[2] * 64 for _ in range(8)])
    assert token_saving([long]) == pytest.approx(1 - 576 / 1024) and should_pack([long])
    # A batch is judged as a whole; empty responses carry no prompt copy either way.
    both = token_saving([short, long])
    assert both == pytest.approx(1 - (518 + 576) / (560 + 1024))
    assert token_saving([PackGroup(2, [1] * 9, [[], []])]) == 0.0
    assert should_pack([short, long]) is (both >= PackingSettings.packing_min_saving)


def test_below_the_threshold_the_batch_runs_unpacked(model, monkeypatch):
    seen = []
    real = packing.batch_logprobs
    monkeypatch.setattr(packing, "batch_logprobs",
                        lambda m, b, **kw: seen.append(b.packed) or real(m, b, **kw))
    short = [PackGroup(0, [1, 2], [[3, 4, 5], [6, 7, 8]])]  # 1 - 8/10 = 20 % saved
    packed = packed_response_logprobs(model, short, token_budget=64,
                                      min_saving=0.0)  # min_saving 0: packs
    rows = packed_response_logprobs(model, short, token_budget=64, min_saving=0.5)
    assert seen[-2:] == [True, False]
    for a, b in zip(rows[0], packed[0], strict=True):
        assert torch.allclose(a, b, atol=1e-5)
