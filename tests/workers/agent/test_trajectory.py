"""The pure functions of multi-turn trajectories (workers.agent.trajectory) and the table they
live in (workers.schema with max_turns): context, turn closing, assembly, the NULL fill."""

from __future__ import annotations

import pyarrow as pa
import pytest

from storage.schema import ROW_ID
from workers.agent.trajectory import (
    History,
    Turn,
    assemble,
    close_turn,
    context_ids,
    history,
    later_columns,
    observation_writes,
    turn_end,
    turn_limit,
    turn_reads,
    turn_writes,
)
from workers.engines.base import Generation, SamplingParams
from workers.roles.turns import TurnPolicy
from workers.schema import SAMPLES_SCHEMA, samples_table_spec, turn_columns

T0 = Turn([1, 2, 3], [-0.1, -0.2, -0.3], 5, "tool")
T1 = Turn([4, 5], [-0.4, -0.5], 7, "stop")
OBS0 = (8, 9)


def test_single_turn_table_is_unchanged_and_turn_tables_add_the_turn_tasks():
    one = samples_table_spec("s", group_size=2, reference_worker=True, fsync="never")
    assert one.schema == SAMPLES_SCHEMA
    assert [t.name for t in one.tasks] == ["rollout", "reward", "reference", "trainer"]
    three = samples_table_spec("s", group_size=2, reference_worker=False, fsync="never",
                               max_turns=3)
    tasks = {t.name: t for t in three.tasks}
    assert list(tasks) == ["rollout", "env.0", "rollout.1", "env.1", "rollout.2", "reward",
                           "trainer"]
    assert tasks["env.1"].needs == ("turn1_ids",) and tasks["rollout.2"].needs == ("obs1_ids",)
    assert not tasks["rollout.1"].whole_groups and tasks["rollout"].whole_groups
    names = [f.name for f in turn_columns(3)]
    assert names[:6] == ["turn0_ids", "turn0_logprobs", "turn0_version", "turn0_finish",
                         "obs0_ids", "obs0_error"]
    assert names[-1] == "turn2_finish" and "obs2_ids" not in names
    assert three.schema.names == [*SAMPLES_SCHEMA.names, *names, "env_reward"]


def test_context_interleaves_turns_and_observations():
    assert context_ids([40, 41], History((T0,), (OBS0,))) == [40, 41, 1, 2, 3, 8, 9]
    assert context_ids([40], History((T0, T1), (OBS0,))) == [40, 1, 2, 3, 8, 9, 4, 5]
    assert context_ids([40], History()) == [40]


def test_assemble_masks_observations_and_takes_the_oldest_version():
    a = assemble(History((T0, T1), (OBS0,)), "stop")
    assert a.response_ids == [1, 2, 3, 8, 9, 4, 5]
    assert a.response_logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert a.response_loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert (a.policy_version, a.finish_reason) == (5, "stop")


def test_close_turn_cuts_after_a_multi_token_marker_and_at_the_limit():
    gen = Generation([6, 17, 19, 6, 6], [-1.0, -2.0, -3.0, -4.0, -5.0], "length")
    turn = close_turn(gen, version=2, marker=(17, 19), limit=16, budget_bound=False)
    assert (turn.ids, turn.logprobs, turn.finish, turn.version) == (
        [6, 17, 19], [-1.0, -2.0, -3.0], "tool", 2)
    # a marker past the limit never happened
    assert close_turn(gen, version=2, marker=(17, 19), limit=2, budget_bound=True) == Turn(
        [6, 17], [-1.0, -2.0], 2, "budget")
    assert close_turn(gen, version=2, marker=(17, 19), limit=2, budget_bound=False).finish == \
        "length"
    stopped = Generation([6, 2], [-1.0, -0.5], "stop")
    assert close_turn(stopped, version=0, marker=(17, 19), limit=2,
                      budget_bound=True).finish == "stop"
    assert close_turn(stopped, version=0, marker=(17, 19), limit=1,
                      budget_bound=True).finish == "budget"  # the stop token was cut
    one = Generation([6, 33], [-1.0, -0.5], "stop")  # a one-token marker stops the engine
    assert close_turn(one, version=0, marker=(33,), limit=8, budget_bound=False).finish == "tool"


def test_turn_end_and_limit():
    assert turn_end(T0, 0, 3) is None
    assert turn_end(T0, 2, 3) == "tool"  # out of turns
    assert turn_end(T1, 1, 3) == "stop"
    assert turn_limit(History((T0,), (OBS0,)), 16, 10) == (5, True)
    assert turn_limit(History(), 16, 100) == (16, False)


def test_history_reads_a_row_and_sees_a_null_as_ended():
    row = {"turn0_ids": [1, 2, 3], "turn0_logprobs": [-0.1, -0.2, -0.3], "turn0_version": 5,
           "turn0_finish": "tool", "obs0_ids": [8, 9]}
    assert set(turn_reads(1, 1)) == set(row)
    assert history(row, 1, 1) == History((T0,), (OBS0,))
    assert history({**row, "obs0_ids": None}, 1, 1) is None
    assert history({**row, "turn0_ids": None, "turn0_finish": None}, 1, 0) is None


def test_turn_writes_split_going_and_ending_rows_and_null_fill_the_rest():
    going = (History(), Turn([1, 17, 19], [-1.0, -1.0, -1.0], 3, "tool"))
    ending = (History(), Turn([1, 2], [-1.0, -2.0], 3, "stop"))
    batches = turn_writes([10, 11], 0, 3, [going, ending])
    assert len(batches) == 2
    on, done = batches
    assert on.schema.names == [ROW_ID, "turn0_ids", "turn0_logprobs", "turn0_version",
                               "turn0_finish"]
    assert on.column(ROW_ID).to_pylist() == [10]
    row = done.to_pylist()[0]
    assert row[ROW_ID] == 11 and row["turn0_ids"] == [1, 2]
    assert row["response_ids"] == [1, 2] and row["response_loss_mask"] == [1, 1]
    assert (row["policy_version"], row["finish_reason"]) == (3, "stop")
    later = later_columns(3, 0)
    assert later[0] == "obs0_ids" and later[-1] == "turn2_finish"
    assert all(row[c] is None for c in later) and set(later) <= set(done.schema.names)
    assert done.schema.field("response_loss_mask").type == pa.list_(pa.int8())
    # the last turn ends whatever it did, and has nothing after it
    (last,) = turn_writes([12], 2, 3, [(History((T0, T0), (OBS0, OBS0)), T0)])
    assert later_columns(3, 2) == ()
    assert last.to_pylist()[0]["finish_reason"] == "tool"
    assert last.to_pylist()[0]["env_reward"] is None  # (a claimed column is written on every row)


def test_observation_writes_end_without_appending_and_keep_the_error():
    hist = History((T0,), ())
    batches = observation_writes([5, 6], 0, 2, [(hist, [8, 9], None, None),
                                                (hist, [8], "tool_error", "budget")])
    on, done = batches
    assert on.to_pylist() == [{ROW_ID: 5, "obs0_ids": [8, 9], "obs0_error": None}]
    row = done.to_pylist()[0]
    assert row["obs0_ids"] is None and row["obs0_error"] == "tool_error"
    assert row["response_ids"] == [1, 2, 3] and row["finish_reason"] == "budget"
    assert "turn1_ids" in done.schema.names and row["turn1_ids"] is None
    assert row["env_reward"] is None  # no reward given: NULL, but written


def test_the_environments_final_reward_is_written_with_the_ended_row():
    hist = History((T0,), ())
    on, done = observation_writes([5, 6, 7], 0, 3, [
        (hist, [8], None, None), (hist, [8], None, "done"), (hist, [9], None, "done")],
        [0.25, 0.75, None])
    assert "env_reward" not in on.schema.names  # a row that goes on has no reward yet
    assert [(r[ROW_ID], r["env_reward"]) for r in done.to_pylist()] == [(6, 0.75), (7, None)]
    assert done.schema.field("env_reward").type == pa.float32()


@pytest.mark.parametrize("marker, stops", [((33,), (2, 33)), ((17, 19), (2,))])
def test_turn_policy_stops_on_a_one_token_marker_only(marker, stops):
    policy = TurnPolicy(max_turns=3, max_total_tokens=12, max_new_tokens=8, marker=marker)
    base = SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
    params = policy.params(base, [History((T0,), (OBS0,)), History()])
    assert params.stop_token_ids == stops
    assert params.max_new_tokens == 8  # the roomiest row's limit
    assert policy.params(base, History((T0, T1), (OBS0,))).max_new_tokens == 5
