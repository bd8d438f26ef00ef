"""Dynamic sampling's trainer side (workers.rl.dynamic): the zero-variance test, the resolution
of trainer.dynamic_sampling (GrpoSettings.dynamic), and the filter that splits a claim into rows
to train and to ack."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from workers.rl.dynamic import GroupFilter, zero_variance_groups
from workers.runtime.events import SamplingReport
from workers.settings import GrpoSettings


def test_zero_variance_groups_are_exactly_the_all_equal_ones() -> None:
    """Broken by a test on the mean (group 2 and 3 share it), on a tolerance (group 4 differs in
    its last bits), or by ids taken from the wrong position (group 7 comes first)."""
    groups = np.array([7, 7, 2, 2, 3, 3, 4, 4, 5, 5, 5])
    rewards = np.array([1, 1, 0.5, 0.5, 0, 1, 1.0, np.nextafter(1.0, 2.0), 0, 0, 1],
                       dtype=np.float64)
    assert zero_variance_groups(rewards, groups).tolist() == [2, 7]
    assert zero_variance_groups(np.zeros(1), np.array([9])).tolist() == [9]  # one sample: none


@pytest.mark.parametrize(("mode", "loss", "on"), [
    ("auto", "grpo", False), ("auto", "dapo", True), ("on", "grpo", True),
    ("off", "dapo", False), (True, "grpo", True), (False, "dapo", False)])
def test_dynamic_sampling_resolves_auto_by_the_loss(mode, loss, on) -> None:
    assert GrpoSettings(loss=loss, dynamic_sampling=mode).dynamic is on


def _rows(rewards: dict[int, list[float]]) -> pa.RecordBatch:
    ids = [g for g, r in rewards.items() for _ in r]
    return pa.RecordBatch.from_pydict({
        "group_id": pa.array(ids, pa.int64()),
        "reward": pa.array([x for r in rewards.values() for x in r], pa.float32()),
        "row": pa.array(range(len(ids)), pa.int64())})


def test_filter_acks_zero_variance_groups_and_caps_the_step() -> None:
    """Two groups per step: the all-equal groups (solved 1s, failed 0s) are only acked, the
    first two groups with variance (by id) are kept, a third is surplus; a later claim of the
    same iteration adds nothing to train. Broken by keeping an all-equal group, by no cap, or by
    reports that are not cumulative."""
    sent: list = []
    f = GroupFilter(True, groups_per_step=2, send=sent.append)
    train, ack = f.split(3, _rows({10: [1, 1], 11: [0, 1], 12: [0, 0], 13: [1, 0], 14: [1, 0]}))
    assert sorted(set(train.column("group_id").to_pylist())) == [11, 13]
    assert ack is not None and sorted(set(ack.column("group_id").to_pylist())) == [10, 12, 14]
    assert train.num_rows + ack.num_rows == 10
    train, ack = f.split(3, _rows({15: [0, 1], 16: [1, 1]}))
    assert train.num_rows == 0 and ack is not None and ack.num_rows == 4
    assert sent == [SamplingReport(3, 2, 2, 1), SamplingReport(3, 2, 3, 2)]
    assert f.step_fields(3) == {"filtered_groups": 3, "surplus_groups": 2,
                                "zero_variance_rate": 3 / 7}
    assert f.step_fields(3)["filtered_groups"] == 0  # forgotten once reported


def test_filter_off_trains_everything_and_still_measures_the_rate() -> None:
    sent: list = []
    f = GroupFilter(False, groups_per_step=1, send=sent.append)
    rows = _rows({1: [1, 1], 2: [0, 1], 3: [0.5, 0.5], 4: [1, 0]})
    train, ack = f.split(0, rows)
    assert train is rows and ack is None and sent == []
    assert f.step_fields(0) == {"filtered_groups": 0, "surplus_groups": 0,
                                "zero_variance_rate": 0.5}
