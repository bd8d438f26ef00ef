"""The torch engine's cut and resume (``generate_until``, ``done_tokens``), and per-token policy
versions of a trajectory cut at a weight update (docs/partial.md)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from testkit import CutAfter

from workers.agent.pieces import History, assemble, model_piece, version_runs
from workers.engines.base import FINISH_CUT, Interruptible, SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.tokens import build_token_batch, response_logprobs, to_token_tensor

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
PROMPTS = ["12+34=", "7+5=", "99+99="]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok, seed: int = 0, scale: float = 0.5):
    model = build_tiny_model(TinyModelSpec(**{**SPEC.__dict__, "seed": seed}), tok)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


@pytest.fixture(scope="module")
def engine(tok):
    # eos ids none: every row runs to MAX_NEW unless cut, so the cut rows are known; every cut
    # is honoured (a live fraction of 1)
    return TorchRolloutEngine(_model(tok), [], cut_live_fraction=1.0)


def _prompts(tok):
    return [encode_prompt(tok, p) for p in PROMPTS]


def _flat(groups):
    return [g for group in groups for g in group]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_cut_returns_the_prefix_and_resume_continues_the_uncut_tokens(engine, tok, temperature):
    # Breaks if the cut is not honoured between steps (wrong prefix length), or the resumed row
    # does not skip its used draws (sampled tokens differ after the cut).
    params = SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=5)
    uncut = _flat(engine.generate(_prompts(tok), 2, params))
    k = 4
    cut = _flat(engine.generate_until(_prompts(tok), 2, params, CutAfter(k)))
    assert [g.finish_reason for g in cut] == [FINISH_CUT] * len(cut)
    for c, u in zip(cut, uncut, strict=True):
        assert c.token_ids == u.token_ids[:k]
        assert c.logprobs == pytest.approx(u.logprobs[:k], abs=1e-5)
    # each row resumed alone, with its own seed (prompt seed + sample index) and done tokens
    seeds = [5 + i * 2 + j for i in range(len(PROMPTS)) for j in range(2)]
    prompts = [p for p in _prompts(tok) for _ in range(2)]
    resumed = _flat(engine.generate_until(
        [p + c.token_ids for p, c in zip(prompts, cut, strict=True)], 1,
        dataclasses.replace(params, max_new_tokens=MAX_NEW - k, seed=None,
                            prompt_seeds=tuple(seeds), done_tokens=(k,) * len(cut)), None))
    for c, r, u in zip(cut, resumed, uncut, strict=True):
        assert c.token_ids + r.token_ids == u.token_ids
        assert c.logprobs + r.logprobs == pytest.approx(u.logprobs, abs=1e-4)
        assert r.finish_reason == u.finish_reason


def test_never_cut_equals_generate_bitwise(engine, tok):
    # Breaks if generate_until changes the draws or the batching of an uncut call.
    assert isinstance(engine, Interruptible)
    params = SamplingParams(temperature=1.1, top_p=0.9, max_new_tokens=MAX_NEW, seed=3)
    done: list[int] = []
    a = _flat(engine.generate(_prompts(tok), 2, params))
    b = _flat(engine.generate_until(_prompts(tok), 2, params, threading.Event(),
                                    on_done=lambda i, g: done.append(i)))
    assert [(g.token_ids, g.logprobs, g.finish_reason) for g in a] == \
        [(g.token_ids, g.logprobs, g.finish_reason) for g in b]
    assert sorted(done) == list(range(len(a)))


def test_each_token_logprob_comes_from_the_version_that_sampled_it(tok):
    # Cut at step k, load perturbed weights as version 1, resume: every token's recorded
    # log-prob equals its recomputation under its own version's weights, and the runs say so.
    # Breaks if a token is attributed to the wrong version or a segment's log-probs are stale.
    v0, v1 = _model(tok, seed=0), _model(tok, seed=1)
    engine = TorchRolloutEngine(_model(tok, seed=0), [], cut_live_fraction=1.0)
    prompt = _prompts(tok)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, prompt_seeds=(9,))
    k = 5
    first = engine.generate_until([prompt], 1, params, CutAfter(k))[0][0]
    engine.load_weights(v1.state_dict(), 1)
    second = engine.generate_until(
        [prompt + first.token_ids], 1,
        dataclasses.replace(params, max_new_tokens=MAX_NEW - k, done_tokens=(k,)), None)[0][0]
    hist = History((model_piece(first.token_ids, first.logprobs, 0, FINISH_CUT, 9),
                    model_piece(second.token_ids, second.logprobs, 1, second.finish_reason, 9)))
    response = assemble(hist, second.finish_reason)
    assert version_runs(hist) == response.runs == [(0, 0), (k, 1)]
    batch = build_token_batch([(prompt, response.response_ids)], pad_token_id=0)
    where = batch.response_mask[0].bool()
    recomputed = []
    for model in (v0, v1):
        with torch.no_grad():
            lp = response_logprobs(model, batch.input_ids, batch.attention_mask,
                                   batch.response_mask, temperature=1.0)
        recomputed.append(lp[0][where])
    expected = to_token_tensor([response.response_logprobs], batch.response_mask)[0][where]
    assert len(expected) == MAX_NEW
    by_version = torch.cat([recomputed[0][:k], recomputed[1][k:]])
    assert (by_version - expected).abs().max().item() <= 1e-5
    # and the two versions really differ on the resumed tokens (the test can tell them apart)
    assert (recomputed[0][k:] - expected[k:]).abs().max() > 1e-3


def test_a_cut_waits_until_the_live_rows_are_a_small_fraction_of_the_batch(tok):
    # rollout.partial_cut_live_fraction: with the cut set from the first step, the call goes on
    # until at most a quarter of its rows are unfinished, then cuts them; the rows it finished
    # are the uncut call's. Breaks if the gate is ignored (cut at step 1) or never opens.
    eos = tok.eos_token_id
    engine = TorchRolloutEngine(_model(tok, scale=0.3), [eos], cut_live_fraction=0.25)
    params = SamplingParams(temperature=1.5, max_new_tokens=40, seed=11)
    prompts = _prompts(tok)
    uncut = _flat(engine.generate(prompts, 4, params))
    lengths = sorted(len(g.token_ids) for g in uncut)
    assert lengths[0] < lengths[-1]  # rows end at different steps: the gate has work to do
    cut = _flat(engine.generate_until(prompts, 4, params, CutAfter(1)))
    live = [c for c in cut if c.finish_reason == FINISH_CUT]
    assert live and len(live) <= 0.25 * len(cut)  # cut once a quarter at most were live
    assert min(len(c.token_ids) for c in live) > 1  # not at the first step, where all were
    for c, u in zip(cut, uncut, strict=True):
        assert c.token_ids == u.token_ids[: len(c.token_ids)]
        if c.finish_reason != FINISH_CUT:
            assert c.token_ids == u.token_ids
    with pytest.raises(ValueError, match="cut_live_fraction"):
        TorchRolloutEngine(_model(tok), [], cut_live_fraction=0.0)
