"""The ``simulated`` engine's roles (workers/engines/simulated.py) in isolation: what they draw,
write and hold. Whole runs through the controller are in tests/streamflow/test_run_simulated.py."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from storage.schema import ROW_ID, Lease
from workers.config import SimulatedDevice
from workers.engines.base import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams
from workers.engines.sim_cost import drawn_lengths, preset
from workers.engines.simulated import (
    VERSION_TENSOR,
    Device,
    SimulatedReferenceStage,
    SimulatedRewardStage,
    SimulatedRolloutEngine,
    SimulatedTrainingEngine,
    SimulatedTriModel,
    data_parallel_s,
    spread_generate_s,
)
from workers.rl.packing import PackGroup

SPEC = SimulatedDevice(cost="7b-1acc", time_scale=1e6, median_response_tokens=50, skew=1.0)
COST = preset("7b-1acc")


def _lease(columns: dict[str, pa.Array]) -> Lease:
    n = len(next(iter(columns.values())))
    batch = pa.RecordBatch.from_pydict({ROW_ID: pa.array(range(n), pa.uint64()), **columns})
    return Lease(1, "samples", "task", 0, 0.0, batch)


def test_rollout_engine_draws_seeded_capped_lengths_and_holds_the_cost_models_time():
    engine = SimulatedRolloutEngine(SPEC, vocab_size=100, eos_ids=(7,))
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(max_new_tokens=64, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out = engine.generate(prompts, 4, params)
    assert [len(g) for g in out] == [4, 4]
    lengths = [len(s.token_ids) for g in out for s in g]
    assert all(1 <= n <= 64 for n in lengths) and len(set(lengths)) > 1  # skew 1: they differ
    for s in (s for g in out for s in g):
        assert len(s.logprobs) == len(s.token_ids)
        assert all(0 <= t < 100 for t in s.token_ids)
        if s.finish_reason == FINISH_STOP:  # ended early: on a stop token
            assert len(s.token_ids) < 64 and s.token_ids[-1] == 7
        else:
            assert s.finish_reason == FINISH_LENGTH and len(s.token_ids) == 64
    # Held: the batch's generation time (mean prompt length 4 tokens).
    assert engine.device.busy_s == pytest.approx(COST.generate_s(4, lengths))
    # The same seed draws the same responses; another seed other ones.
    again = SimulatedRolloutEngine(SPEC, vocab_size=100, eos_ids=(7,)).generate(prompts, 4, params)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in out]
    other = SimulatedRolloutEngine(SPEC, vocab_size=100, eos_ids=(7,))
    assert [len(s.token_ids) for g in other.generate(prompts, 4, SamplingParams(
        max_new_tokens=64, seed=4)) for s in g] != lengths
    # A weight load holds the device for the sync time; the file is not read.
    engine.load_weights_file("/nonexistent", 5)
    assert engine.policy_version == 5
    assert engine.device.busy_s == pytest.approx(COST.generate_s(4, lengths) + COST.sync_s())


def test_rollout_engine_median_follows_the_spec():
    engine = SimulatedRolloutEngine(SPEC, vocab_size=10)
    drawn = engine.lengths(1, 4001, SamplingParams(max_new_tokens=10_000, seed=0))
    assert sorted(drawn)[2000] == pytest.approx(50, rel=0.1)


def test_each_prompts_lengths_come_from_its_own_seed_whatever_the_batch():
    engine = SimulatedRolloutEngine(SPEC, vocab_size=10)
    pair = engine.lengths(2, 4, SamplingParams(max_new_tokens=64, prompt_seeds=(11, 12)))
    alone = engine.lengths(1, 4, SamplingParams(max_new_tokens=64, prompt_seeds=(12,)))
    assert pair[4:] == alone == drawn_lengths(12, 4, 50, 1.0, 64)
    assert pair[:4] == drawn_lengths(11, 4, 50, 1.0, 64) != alone


def test_reference_stage_writes_placeholders_of_each_response_length():
    stage = SimulatedReferenceStage(SPEC, max_rows=8)
    lease = _lease({
        "group_id": pa.array([0, 0, 1], pa.int64()),
        "iteration": pa.array([0, 0, 0], pa.int64()),
        "prompt_ids": pa.array([[1, 2], [1, 2], [3, 4, 5, 6]], pa.list_(pa.int32())),
        "response_ids": pa.array([[9], [9, 9, 9], []], pa.list_(pa.int32())),
    })
    out = stage.process(lease)
    assert out.column(ROW_ID).to_pylist() == [0, 1, 2]
    assert [len(x) for x in out.column("ref_logprobs").to_pylist()] == [1, 3, 0]
    assert out.schema.field("ref_logprobs").type == pa.list_(pa.float32())
    assert stage.device.busy_s == pytest.approx(COST.reference_s(math.ceil(8 / 3), [1, 3, 0]))


def test_reward_stage_is_the_real_stage_plus_the_verifier_time():
    class Inner:
        task, columns, whole_groups, max_rows = "reward", ("response_ids",), False, 4
        closed = False

        def process(self, lease: Lease) -> pa.RecordBatch:
            return lease.batch

        def close(self) -> None:
            self.closed = True

    inner = Inner()
    stage = SimulatedRewardStage(inner, SPEC)
    lease = _lease({"response_ids": pa.array([[1], [2]], pa.list_(pa.int32()))})
    assert stage.process(lease) is lease.batch
    assert (stage.task, stage.max_rows) == ("reward", 4)
    assert stage.device.busy_s == pytest.approx(COST.reward_s(2))
    stage.close()
    assert inner.closed


def test_training_engine_holds_train_and_step_times_and_publishes_the_version():
    device = Device(SPEC)
    tri = SimulatedTriModel(device, reference=True, devices=1)
    groups = [PackGroup(group_id=0, prompt_ids=[1, 2], responses=[[5], [5, 5, 5]]),
              PackGroup(group_id=1, prompt_ids=[1, 2, 3, 4], responses=[[6, 6]])]
    out = tri.forward(groups, temperature=1.0, token_budget=64, pack=False)
    assert [[len(t) for t in g] for g in out.policy] == [[1, 3], [2]]
    assert out.ref is not None and all(float(t.abs().sum()) == 0 for g in out.ref for t in g)
    assert device.busy_s == pytest.approx(COST.train_s(math.ceil(8 / 3), [1, 3, 2]))
    assert SimulatedTriModel(device, reference=False, devices=1).forward(groups).ref is None
    engine = SimulatedTrainingEngine(Device(SPEC), updates_per_batch=2, devices=1)
    assert engine.step(1.0) == 0.0 and engine.step(1.0) == 0.0
    assert engine.device.busy_s == pytest.approx(2 * COST.step_s(1))
    assert engine.state_dict()[VERSION_TENSOR].tolist() == [1]  # two steps make one version
    with pytest.raises(RuntimeError, match="no checkpoints"):
        engine.save_state("/nonexistent")


def test_data_parallel_devices_share_a_micro_batch_and_pay_the_all_reduce():
    assert data_parallel_s([4.0, 3.0, 3.0, 2.0], 2) == 6.0  # {4, 2} and {3, 3}
    assert data_parallel_s([4.0, 1.0, 1.0], 3) == 4.0  # a row is not split: the costliest
    assert data_parallel_s([1.0, 2.0], 1) == 3.0 and data_parallel_s([], 4) == 0.0
    groups = [PackGroup(group_id=g, prompt_ids=[1, 2], responses=[[5] * 10] * 4)
              for g in range(2)]  # 8 equal rows
    one, four = Device(SPEC), Device(SPEC)
    SimulatedTriModel(one, reference=False, devices=1).forward(groups)
    SimulatedTriModel(four, reference=False, devices=4).forward(groups)
    assert four.busy_s == pytest.approx(one.busy_s / 4) and four.busy_s > 0
    engine = SimulatedTrainingEngine(Device(SPEC), updates_per_batch=1, devices=4)
    engine.step(1.0)
    assert engine.device.busy_s == pytest.approx(COST.step_s(4))
    assert COST.step_s(4) != pytest.approx(COST.step_s(1))  # all-reduce in, optimizer sharded
    with pytest.raises(ValueError, match="num_ranks"):
        SimulatedTriModel(Device(SPEC), reference=False, devices=0)


def test_colocated_devices_spread_each_stages_batch():
    """simulated.devices = D (sync): a batch is dealt out whole (groups, rows) to D devices."""
    lengths = [[40, 10], [30, 30], [5, 5], [50, 1]]
    one = spread_generate_s(COST, [4, 4, 4, 4], lengths, 1)
    assert one == pytest.approx(COST.generate_s(4, [n for ls in lengths for n in ls]))
    two = spread_generate_s(COST, [4, 4, 4, 4], lengths, 2)
    alone = [COST.generate_s(4, ls) for ls in lengths]
    assert max(alone) <= two < one and two >= one / 2  # batching only saves decode steps
    assert spread_generate_s(COST, [4] * 4, lengths, 8) == pytest.approx(max(alone))
    spec = SimulatedDevice(cost="7b-1acc", time_scale=1e6, median_response_tokens=50, devices=4)
    engine = SimulatedRolloutEngine(spec, vocab_size=100)
    out = engine.generate([[1, 2]] * 8, 2, SamplingParams(max_new_tokens=64, seed=1))
    drawn = [[len(s.token_ids) for s in g] for g in out]
    assert engine.device.busy_s == pytest.approx(spread_generate_s(COST, [2] * 8, drawn, 4))
    stage = SimulatedReferenceStage(spec, max_rows=8)
    stage.process(_lease({
        "prompt_ids": pa.array([[1, 2]] * 8, pa.list_(pa.int32())),
        "response_ids": pa.array([[3] * 10] * 8, pa.list_(pa.int32())),
    }))
    assert stage.device.busy_s == pytest.approx(COST.reference_s(2, [10] * 8) / 4)


class _Clock:
    """The simulated device's clock in a test: only ``sleep`` and the test move it."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_a_hold_begun_by_the_forward_covers_the_trainers_math_until_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr("workers.engines.simulated.time", clock)
    device = Device(SimulatedDevice(cost="7b-1acc", time_scale=1.0))
    device.begin(0.5)
    clock.now += 0.3  # the trainer's loss math on the placeholders: inside the hold
    device.finish()
    assert clock.now == pytest.approx(100.5) and device.busy_s == 0.5
    device.begin(0.5)
    clock.now += 0.8  # math longer than the hold: finish adds nothing
    device.finish()
    assert clock.now == pytest.approx(101.3) and device.busy_s == 1.0


def test_the_simulated_trainer_holds_the_send_of_each_version_before_publishing():
    from workers.roles.simulated_trainer import SendingPublisher

    calls = []

    class Inner:
        def publish(self, state, version):  # noqa: ANN001, ANN202
            calls.append((version, device.busy_s))
            return "published"

        def close(self):  # noqa: ANN202
            calls.append("closed")

    device = Device(SPEC)
    publisher = SendingPublisher(Inner(), device)
    assert publisher.publish({}, 3) == "published"
    assert calls == [(3, pytest.approx(COST.sync_s()))]  # held before the version went out
    publisher.close()
    assert calls[-1] == "closed"
