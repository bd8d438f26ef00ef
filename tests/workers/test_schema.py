"""The sample table's declarations: prompt rows as the controller puts them, each task's columns."""

from __future__ import annotations

import pyarrow as pa

from workers.schema import (
    PUT_COLUMNS,
    REWARD_COLUMNS,
    ROLLOUT_COLUMNS,
    SAMPLES_SCHEMA,
    TRAINER_READS,
    prompt_rows,
    samples_table_spec,
    trainer_columns,
)


def test_prompt_rows_repeat_each_prompt_once_per_sample_of_its_group():
    batch = prompt_rows(3, [[5, 6], [7]], ["11", "7"], group_size=2, min_policy_version=2)
    assert batch.schema == pa.schema([SAMPLES_SCHEMA.field(c) for c in PUT_COLUMNS])
    assert batch.to_pydict() == {
        "group_id": [6, 6, 7, 7],  # prompt i of iteration k: group k * prompts + i
        "iteration": [3] * 4,
        "min_policy_version": [2] * 4,
        "prompt_ids": [[5, 6], [5, 6], [7], [7]],
        "answer": ["11", "11", "7", "7"],
    }


def test_every_declared_column_is_in_the_table_and_tasks_wait_for_their_inputs():
    for reference in (False, True):
        spec = samples_table_spec("t", group_size=2, reference_worker=reference, fsync="never")
        names = set(SAMPLES_SCHEMA.names)
        assert set(trainer_columns(reference, False)) <= names
        trainer = next(t for t in spec.tasks if t.name == "trainer")
        assert set(trainer.needs) <= set(trainer_columns(reference, False))
    assert trainer_columns(True, False) == (*TRAINER_READS, "ref_logprobs")
    # the store hands out written cells only: whatever the trainer claims, a task before it writes
    # (response_loss_mask too, NULL from single-turn rollouts)
    assert set(TRAINER_READS) <= {*PUT_COLUMNS, *ROLLOUT_COLUMNS, *REWARD_COLUMNS}
    assert SAMPLES_SCHEMA.field("response_loss_mask").type == pa.list_(pa.int8())
    # reference.placement=rollout: no reference task; the trainer waits for the rollout's column
    spec = samples_table_spec("t", group_size=2, reference_worker=False, fsync="never",
                              reference_in_rollout=True)
    assert [t.name for t in spec.tasks] == ["rollout", "reward", "trainer"]
    assert "ref_logprobs" in next(t for t in spec.tasks if t.name == "trainer").needs
