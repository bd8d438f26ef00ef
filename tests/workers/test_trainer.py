"""The trainer over a real (embedded) store: order invariance, group integrity, ratio == 1.

Every test drives the real stages in-process: prompts are put, the rollout stage generates, rewards
are written (in the order the test chooses), and the trainer claims whole groups as they complete.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import storage
from storage.schema import TaskSpec
from workers.config import RolloutWorkerConfig, TrainerWorkerConfig, WorkerCommon
from workers.events import EventSender, StepReport
from workers.loop import StageLoop
from workers.main import build_rollout, build_trainer
from workers.models import TinyModelSpec, build_tiny_model, save_model
from workers.schema import PUT_COLUMNS, SAMPLES_SCHEMA, samples_table_spec
from workers.tokenizer import build_char_tokenizer, encode_prompt

G = 4
PROMPTS = 4
ROWS = G * PROMPTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64), tok)
    path = tmp_path_factory.mktemp("model") / "tiny"
    save_model(model, tok, path)
    return path


def _configs(model_dir: Path, weights: Path, iterations: int, rows_per_claim: int,
             deterministic: bool = False):
    common = WorkerCommon(name="t", role="t", store_addresses=[], table="samples", seed=3)
    rollout = RolloutWorkerConfig(
        common=replace(common, name="rollout-0", role="rollout"), model_path=str(model_dir),
        weights_dir=str(weights), weights_announce=None, group_size=G, groups_per_claim=1,
        max_new_tokens=4,
    )
    trainer = TrainerWorkerConfig(
        common=replace(common, name="trainer-0", role="trainer"), model_path=str(model_dir),
        reference_path=None, weights_dir=str(weights), weights_bind=None,
        rows_per_iteration=ROWS, iterations=iterations, group_size=G, reference_worker=False,
        lr=1e-2, rows_per_claim=rows_per_claim, checkpoint_dir=None, deterministic=deterministic,
    )
    return rollout, trainer


def _spec(audit: bool):
    spec = samples_table_spec("samples", group_size=G, reference_worker=False)
    if audit:  # keeps rows alive after the trainer, so the test can read what it wrote
        spec = replace(spec, tasks=spec.tasks + (TaskSpec("audit", ("advantage",)),))
    return spec


def _put(client, k: int) -> None:
    tok = build_char_tokenizer()
    problems = [(f"{a}+{a + k}=", str(2 * a + k)) for a in range(PROMPTS)]
    batch = pa.RecordBatch.from_pydict(
        {
            "group_id": [k * PROMPTS + i for i in range(PROMPTS) for _ in range(G)],
            "iteration": [k] * ROWS,
            "min_policy_version": [k] * ROWS,
            "prompt_ids": [encode_prompt(tok, p) for p, _ in problems for _ in range(G)],
            "answer": [a for _, a in problems for _ in range(G)],
        },
        schema=pa.schema([SAMPLES_SCHEMA.field(c) for c in PUT_COLUMNS]),
    )
    client.put("samples", batch)


def _reward_rows(client, order_seed: int | None) -> None:
    """Claim every response, and write synthetic rewards row by row in a chosen order."""
    lease = client.claim("samples", "reward", ["response_ids", "group_id"], ROWS, timeout=0.0)
    ids = lease.row_ids
    rewards = {rid: float(len(resp) % 3) for rid, resp in
               zip(ids, lease.batch.column("response_ids").to_pylist(), strict=True)}
    order = list(ids)
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    for rid in order:
        client.write("samples", [rid], pa.RecordBatch.from_pydict(
            {"reward": pa.array([rewards[rid]], pa.float32()),
             "reward_ok": [True], "reward_error": pa.array([None], pa.string())}))
        yield rid
    client.ack(lease)


def _train(model_dir: Path, tmp: Path, *, iterations: int, order_seed: int | None,
           rows_per_claim: int, audit: bool = False, deterministic: bool = False):
    weights = tmp / f"w-{order_seed}-{rows_per_claim}-{deterministic}"
    rollout_cfg, trainer_cfg = _configs(model_dir, weights, iterations, rows_per_claim,
                                        deterministic)
    events = EventSender(None)
    with storage.embedded(2) as store:
        client = store.client()
        client.create_table(_spec(audit))
        rollout = build_rollout(rollout_cfg, events)
        trainer = build_trainer(trainer_cfg, client, events)
        trainer.publish_current()
        for k in range(iterations):
            _put(client, k)
            loop = StageLoop(client, "samples", rollout, worker="r", role="rollout", events=events)
            while loop.turn(0.0):  # the last, empty claim carries the last write+ack
                pass
            stepped = False
            for _ in _reward_rows(client, order_seed):
                if order_seed is not None:  # streaming: train on whatever groups are complete
                    stepped = trainer.poll(0.0) or stepped
            while not stepped:
                stepped = trainer.poll(0.0)
        audit_batch = None
        if audit:
            lease = client.claim("samples", "audit", ["group_id", "prompt_ids", "response_ids",
                                                      "reward", "advantage"], 10_000, timeout=1.0)
            audit_batch = lease.batch
        params = {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}
        reports = [r for r in events.sent if isinstance(r, StepReport)]
        client.close()
    return params, reports, audit_batch


def test_streamed_random_order_equals_whole_batch(model_dir: Path, tmp_path: Path) -> None:
    """periodic ≡ sync at the trainer: same parameters whatever order groups complete in."""
    base, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS)
    for seed in (1, 2):
        other, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=seed, rows_per_claim=G)
        worst = max(float((base[k] - other[k]).abs().max()) for k in base)
        assert worst <= 1e-6, f"order seed {seed}: max abs diff {worst}"
    # Deterministic mode (one group per forward, fp64 gradient sums): bitwise, in any order.
    exact, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS,
                         deterministic=True)
    for seed in (3, 4):
        other, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=seed, rows_per_claim=G,
                             deterministic=True)
        assert all(torch.equal(exact[k], other[k]) for k in exact), f"order seed {seed}"
    untouched = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                               num_kv_heads=1, intermediate_size=64),
                                 build_char_tokenizer()).state_dict()
    assert any(float((base[k] - untouched[k]).abs().max()) > 1e-4 for k in base), "no learning"


def test_ratio_is_exactly_one_and_versions_match(model_dir: Path, tmp_path: Path) -> None:
    _, reports, _ = _train(model_dir, tmp_path, iterations=2, order_seed=5, rows_per_claim=G)
    assert [r.iteration for r in reports] == [0, 1]
    for r in reports:
        assert r.ratio_mean == 1.0 and r.ratio_max == 1.0 and r.clip_fraction == 0.0
        assert r.staleness_max == 0  # every sample's version equals the trainer's step
        assert r.samples == ROWS


def test_group_integrity_under_random_completion(model_dir: Path, tmp_path: Path) -> None:
    _, _, batch = _train(model_dir, tmp_path, iterations=1, order_seed=7, rows_per_claim=G,
                         audit=True)
    assert batch is not None and batch.num_rows == ROWS
    rows = batch.to_pylist()
    by_group: dict[int, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group_id"], []).append(row)
    assert len(by_group) == PROMPTS
    for gid, members in by_group.items():
        assert len(members) == G
        assert len({tuple(m["prompt_ids"]) for m in members}) == 1, f"group {gid} mixes prompts"
        rewards = torch.tensor([m["reward"] for m in members])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        got = torch.tensor([m["advantage"] for m in members])
        assert torch.allclose(got, expected, atol=1e-5), f"group {gid}: {got} vs {expected}"
