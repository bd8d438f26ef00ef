"""The reference stage (workers/roles/reference.py): each row's log-probs land on that row, as float32
lists, whatever the order and lengths of the rows in the claim."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from storage.schema import Lease
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.packing import PackGroup, choose_layout, packed_response_logprobs
from workers.roles.reference import ReferenceScorer, ReferenceStage
from workers.settings import PackingSettings


@pytest.mark.parametrize("tokens_per_forward", [4096, 1])  # 1: one forward per group
@pytest.mark.parametrize("packing", [False, True])
def test_each_row_gets_its_own_log_probs(packing: bool, tokens_per_forward: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64), tok)
    prompts = {7: encode_prompt(tok, "12+34="), 3: encode_prompt(tok, "5+6="),
               9: encode_prompt(tok, "70+8=")}
    # groups interleaved, responses of different lengths, one of them empty
    rows = [(7, [5, 6, 7]), (3, [8]), (7, []), (9, [4, 4, 4, 4, 4]), (3, [9, 2]), (7, [1])]
    batch = pa.RecordBatch.from_pydict({
        "row_id": pa.array(list(range(100, 100 + len(rows))), pa.int64()),
        "group_id": pa.array([g for g, _ in rows], pa.int64()),
        "prompt_ids": pa.array([prompts[g] for g, _ in rows], pa.list_(pa.int32())),
        "response_ids": pa.array([r for _, r in rows], pa.list_(pa.int32())),
    })
    pack = PackingSettings(packing=packing, packing_min_saving=0.0,
                           tokens_per_forward=tokens_per_forward)
    stage = ReferenceStage(ReferenceScorer(model, temperature=1.0, pack=pack), max_rows=64)
    forwards: list[list[int]] = []

    def scoring(groups, models, **kw):  # noqa: ANN001, ANN003, ANN202 - one call per forward
        forwards.append([g.group_id for g in groups])
        return choose_layout(groups, models, **kw)

    monkeypatch.setattr("workers.rl.reference.choose_layout", scoring)
    out = stage.process(Lease(1, "samples", "reference", 0, 0.0, batch))
    # the three groups (~40 tokens) in one forward, or each alone, whole, past a 1-token budget
    assert forwards == ([[7, 3, 9]] if tokens_per_forward > 40 else [[7], [3], [9]])
    assert out.column("row_id").to_pylist() == batch.column("row_id").to_pylist()
    assert out.schema.field("ref_logprobs").type == pa.list_(pa.float32())
    got = out.column("ref_logprobs").to_pylist()
    assert [len(x) for x in got] == [len(r) for _, r in rows]
    assert stage.last_tokens == sum(len(r) for _, r in rows)
    for (gid, response), values in zip(rows, got, strict=True):  # each row scored on its own
        alone = packed_response_logprobs(model, [PackGroup(gid, prompts[gid], [response])],
                                         token_budget=256, min_saving=0.0, pack=False)[0][0]
        assert torch.allclose(torch.tensor(values), alone.float(), atol=1e-5), (gid, response)


def test_the_rollout_scores_its_responses_with_the_frozen_reference(tmp_path) -> None:
    """``reference.placement = rollout``: the rollout writes ``ref_logprobs`` of what it just
    generated, under the frozen reference (not the policy that generated), on the right rows."""
    import copy

    from storage.schema import ROW_ID
    from workers.engines.base import SamplingParams
    from workers.engines.torch_rollout import TorchRolloutEngine
    from workers.roles.rollout import RolloutStage
    from workers.weights.file_sync import WeightSubscriber

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    reference = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                               num_kv_heads=1, intermediate_size=64), tok)
    policy = copy.deepcopy(reference)  # a later policy version: the reference must not follow it
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompts = {4: encode_prompt(tok, "12+34="), 9: encode_prompt(tok, "5+6=")}
    gids = [9, 4, 9, 4]  # the groups' rows interleaved: results must go back by row
    batch = pa.RecordBatch.from_pydict({
        "group_id": pa.array(gids, pa.int64()),
        "iteration": pa.array([0] * 4, pa.int64()),
        "min_policy_version": pa.array([0] * 4, pa.int64()),
        "prompt_ids": pa.array([prompts[g] for g in gids], pa.list_(pa.int32())),
        ROW_ID: pa.array(range(4), pa.uint64()),
    })
    pack = PackingSettings(packing=True, packing_min_saving=0.0)
    stage = RolloutStage(
        TorchRolloutEngine(policy, tok), WeightSubscriber(tmp_path),
        SamplingParams(temperature=1.5, max_new_tokens=6), worker="r", group_size=2,
        groups_per_claim=2, seed=3, weight_wait_s=1.0,
        reference=ReferenceScorer(copy.deepcopy(reference), temperature=1.5,
                                  pack=pack), tail_cut=False)
    out = stage.process(Lease(1, "samples", "rollout", 0, 0.0, batch))
    assert out.schema.field("ref_logprobs").type == pa.list_(pa.float32())
    assert out.column(ROW_ID).to_pylist() == [0, 1, 2, 3]
    got = out.to_pydict()
    # what a reference worker would write for these rows, one row at a time
    for gid, response, ref, behaviour in zip(gids, got["response_ids"], got["ref_logprobs"],
                                             got["response_logprobs"], strict=True):
        assert len(ref) == len(response) > 0
        alone = packed_response_logprobs(reference, [PackGroup(gid, prompts[gid], [response])],
                                         temperature=1.5, token_budget=256, min_saving=0.0,
                                         pack=False)[0][0]
        assert torch.allclose(torch.tensor(ref), alone.float(), atol=1e-5), (gid, response)
        # the policy that generated is another model: its log-probs are not the reference's
        assert not torch.allclose(torch.tensor(ref), torch.tensor(behaviour), atol=1e-3)


def test_a_vllm_rollout_on_a_later_gpu_scores_on_the_gpu_it_pinned(tmp_path, monkeypatch) -> None:
    """vLLM places itself on the first GPU it sees, so the rollout worker hides every other
    one; its reference copy (and the collective receiver) must then name that GPU as this
    process sees it (cuda:0), not by the controller's index (cuda:1 no longer exists here)."""
    import workers.roles.build as main
    from workers.config import RolloutWorkerConfig, WorkerCommon
    from workers.runtime.events import EventSender

    placed: dict[str, str] = {}

    class Engine:  # stands in for vLLM: records the device it was built for
        policy_version = 0

    def engine_on(cfg, device):
        placed["engine"] = device
        return Engine()

    def reference_on(path, *, device, **kwargs):
        placed["reference"] = device
        placed["visible"] = main.os.environ["CUDA_VISIBLE_DEVICES"]
        return object()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    monkeypatch.setattr(main, "make_rollout_engine", engine_on)
    monkeypatch.setattr(main, "load_reference", reference_on)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64), tok)
    from workers.models.local import save_model

    save_model(model, tok, tmp_path / "m")
    cfg = RolloutWorkerConfig(
        common=WorkerCommon(name="rollout-1", role="rollout", store_addresses=[],
                            table="samples", seed=0, threads=1, trace_rows=False),
        model_path=str(tmp_path / "m"), weights_dir=str(tmp_path / "w"), weights_announce=None,
        group_size=2, groups_per_claim=1, engine="vllm", device="cuda:1", dtype="float32",
        reference_dtype="float32", agent_driven=False, reference_path=str(tmp_path / "m"))
    main.build_rollout(cfg, EventSender(None, trace=False))
    assert placed == {"engine": "cuda:0", "reference": "cuda:0", "visible": "6"}
