"""The one trajectory model (workers.agent.pieces), its row (workers.agent.piece_rows) and the
table it lives in (workers.schema): closing a generation into a piece, what follows it, the
assembled response, the reader, the writer with its NULL fill, and the piece tasks."""

from __future__ import annotations

import pytest
from testkit import written_cells

from storage.schema import ROW_ID
from workers.agent.piece_rows import (
    Step,
    piece_reads,
    piece_writes,
    read_history,
    read_trajectory,
)
from workers.agent.pieces import (
    TO_ENV,
    TO_MODEL,
    History,
    Rules,
    assemble,
    context_ids,
    model_piece,
    observation,
    version_runs,
)
from workers.engines.base import FINISH_CUT, Generation, SamplingParams
from workers.schema import SAMPLES_SCHEMA, piece_bound, piece_columns, samples_table_spec

T0 = model_piece([1, 2, 3], [-0.25, -0.5, -0.75], 5, "tool", seed=70)  # exact in float32
OBS0 = observation([8, 9])
T1 = model_piece([4, 5], [-1.25, -1.5], 7, "stop", seed=71)
RULES = Rules(max_turns=3, max_new_tokens=8, max_total_tokens=40, marker=(17, 19), max_cuts=2)



def test_single_turn_uncut_table_is_unchanged_and_the_others_add_pieces_and_tasks():
    # Breaks if a one-piece run grows columns, or a task is missing/extra for some (T, R).
    one = samples_table_spec("s", group_size=2, reference_worker=True, fsync="never")
    assert one.schema == SAMPLES_SCHEMA
    assert [t.name for t in one.tasks] == ["rollout", "reward", "reference", "trainer"]
    three = samples_table_spec("s", group_size=2, reference_worker=False, fsync="never",
                               max_turns=3)
    tasks = {t.name: t for t in three.tasks}
    assert list(tasks) == ["rollout", "env.1", "rollout.2", "env.3", "rollout.4", "reward",
                           "trainer"]
    assert tasks["env.3"].needs == ("piece2_to_env",) == (tasks["env.3"].skip_null,)
    assert tasks["rollout.4"].needs == ("piece3_to_model",)
    assert not tasks["rollout.2"].whole_groups and tasks["rollout"].whole_groups
    assert three.schema.names == [*SAMPLES_SCHEMA.names, "response_version_runs", "env_reward",
                                  *(f.name for f in piece_columns(5))]
    partial = [t.name for t in samples_table_spec(
        "s", group_size=2, reference_worker=False, fsync="never", partial_cuts=2).tasks]
    assert partial == ["rollout", "rollout.1", "rollout.2", "reward", "trainer"]
    both = [t.name for t in samples_table_spec("s", group_size=2, reference_worker=False,
                                               fsync="never", max_turns=2, partial_cuts=1).tasks]
    # pieces: turn 0 (cut once or not), its tool call's observation, turn 1 (cut or not)
    assert both == ["rollout", "rollout.1", "env.1", "rollout.2", "env.2", "rollout.3",
                    "reward", "trainer"] and piece_bound(2, 1) == 4
    gateway = [t.name for t in samples_table_spec("s", group_size=2, reference_worker=False,
                                                  fsync="never", max_turns=2,
                                                  gateway=True).tasks]
    assert gateway == ["agent", "open", "rollout", "env.1", "rollout.2", "env.3", "reward",
                       "trainer"]  # env.3: the wait for the agent's end after the last turn


def test_context_and_assembly_interleave_pieces_mask_observations_and_run_versions():
    hist = History((T0, OBS0, T1))
    assert context_ids([40, 41], hist) == [40, 41, 1, 2, 3, 8, 9, 4, 5]
    a = assemble(hist, "stop")
    assert a.response_ids == [1, 2, 3, 8, 9, 4, 5]
    assert a.response_logprobs == [-0.25, -0.5, -0.75, 0.0, 0.0, -1.25, -1.5]
    assert a.response_loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert (a.policy_version, a.finish_reason) == (5, "stop")
    assert a.runs == [(0, 5), (5, 7)]  # the observation belongs to the run before it
    single = assemble(History((T1,)), "stop")
    assert single.response_loss_mask is None and single.runs == [(0, 7)]  # all model tokens
    # a cut whose continuation has the same version merges into one run; empty pieces add none
    cut = model_piece([1, 2], [-1.0, -1.0], 4, FINISH_CUT, seed=3)
    same = model_piece([3], [-1.0], 4, "stop", seed=3)
    assert version_runs(History((cut, model_piece([], [], 9, FINISH_CUT, 3), same))) == [(0, 4)]


def test_close_cuts_at_the_room_at_a_marker_and_across_a_cut():
    gen = Generation([6, 17, 19, 6, 6], [-1.0, -2.0, -3.0, -4.0, -5.0], "length")
    piece = RULES.close(gen, History(), version=2, seed=9)
    assert (piece.ids, piece.end, piece.version, piece.seed) == ((6, 17, 19), "tool", 2, 9)
    assert piece.logprobs == (-1.0, -2.0, -3.0)  # the dropped tokens' log-probs go too
    budget = Rules(3, 8, 12, (17, 19))
    past = History((model_piece([1] * 9, [-1.0] * 9, 0, "tool"), observation([2])))
    assert budget.room(past) == (2, True)
    assert budget.close(gen, past, version=0, seed=None).end == "budget"
    assert RULES.close(Generation([6, 2], [-1.0, -0.5], "stop"), History(), version=0,
                       seed=None).end == "stop"
    # a cut piece, then its continuation: the room is the turn's, and a marker split by the
    # cut ends the continuation just after it
    first = RULES.close(Generation([6, 17], [-1.0, -2.0], FINISH_CUT), History(), version=2,
                        seed=9)
    assert first.end == FINISH_CUT and RULES.then(first, History()) == TO_MODEL
    hist = History((first,))
    assert RULES.room(hist) == (6, False) and hist.open_turn() == [6, 17]
    rest = RULES.close(Generation([19, 6, 6], [-3.0, -4.0, -5.0], "length"), hist, version=3,
                       seed=9)
    assert (rest.ids, rest.end) == ((19,), "tool")
    assert hist.then(rest).turns()[0].ids == [6, 17, 19]
    # a cut that reached the room is not a cut: the turn is over
    assert RULES.close(Generation([6] * 8, [-1.0] * 8, FINISH_CUT), History(), version=0,
                       seed=None).end == "length"


def test_then_says_who_goes_on():
    assert RULES.then(T0, History()) == TO_ENV
    assert RULES.then(T0, History((T0, OBS0, T0, OBS0))) == "tool"  # out of turns
    assert RULES.then(T1, History((T0, OBS0))) == "stop"
    gateway = Rules(3, 8, 40, (17, 19), agent_driven=True)
    assert gateway.then(T1, History()) == TO_ENV  # only the agent ends an episode
    assert RULES.may_cut(History((model_piece([1], [0.0], 0, FINISH_CUT),)))
    assert not RULES.may_cut(History((model_piece([1], [0.0], 0, FINISH_CUT),) * 2))


@pytest.mark.parametrize("marker, stops", [((33,), (2, 33)), ((17, 19), (2,))])
def test_params_stop_on_a_one_token_marker_and_take_the_roomiest_row(marker, stops):
    rules = Rules(max_turns=3, max_total_tokens=12, max_new_tokens=8, marker=marker)
    base = SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
    params = rules.params(base, [History((T0, OBS0)), History()])
    assert params.stop_token_ids == stops and params.max_new_tokens == 8
    assert rules.params(base, [History((T0, OBS0, T1))]).max_new_tokens == 5


def test_the_reader_reads_pieces_back_and_sees_a_null_as_ended():
    row = written_cells(piece_writes(0, 5, [Step(1, History(), T0, TO_ENV)]))[1]
    row.update(written_cells(piece_writes(1, 5, [Step(1, History((T0,)), OBS0, TO_MODEL)]))[1])
    assert set(piece_reads(2)) <= set(row)
    assert read_history(row, 2) == History((T0, OBS0))
    assert read_history({**row, "piece1_ids": None}, 2) is None


def test_going_rows_write_their_piece_and_both_gates_ending_rows_the_response_and_nulls():
    # Breaks if a going row leaves a gate unwritten (a later task would never be ready), or an
    # ending row leaves a later cell unwritten (the row would never be freed).
    going = Step(10, History(), model_piece([1, 17, 19], [-1.0] * 3, 3, "tool"), TO_ENV)
    ending = Step(11, History(), model_piece([1, 2], [-1.0, -2.0], 3, "stop"), "stop")
    on, done = piece_writes(0, 5, [going, ending])
    assert on.column(ROW_ID).to_pylist() == [10]
    cells = on.to_pylist()[0]
    assert (cells["piece0_to_env"], cells["piece0_to_model"]) == (True, None)
    row = written_cells([done])[11]
    assert row["response_ids"] == [1, 2] and row["response_loss_mask"] is None
    assert (row["policy_version"], row["finish_reason"], row["env_reward"]) == (3, "stop", None)
    assert row["response_version_runs"] == [{"start": 0, "version": 3}]
    assert row["piece0_ids"] == [1, 2] and row["piece0_to_env"] is None
    later = {f.name for f in piece_columns(5)} - {f.name for f in piece_columns(1)}
    assert later <= set(row) and all(row[c] is None for c in later)
    # a one-piece table: the assembled columns alone
    (plain,) = piece_writes(0, 1, [ending])
    assert plain.schema.names == [ROW_ID, "response_ids", "response_logprobs",
                                  "response_loss_mask", "policy_version", "finish_reason"]


def test_an_ending_observation_is_not_appended_but_its_error_and_reward_are_kept():
    hist = History((T0,))
    on, done = piece_writes(1, 5, [
        Step(5, hist, observation([8, 9]), TO_MODEL),
        Step(6, hist, observation([8], "tool_error", "budget"), "budget"),
        Step(7, hist, observation([9], None, "done"), "done", 0.75)])
    assert "env_reward" not in on.schema.names
    assert on.to_pylist()[0]["piece1_to_model"] is True
    rows = written_cells([done])
    assert rows[6]["piece1_ids"] is None and rows[6]["piece1_error"] == "tool_error"
    assert rows[6]["response_ids"] == [1, 2, 3] and rows[6]["finish_reason"] == "budget"
    assert rows[6]["response_loss_mask"] is None
    assert (rows[7]["env_reward"], rows[7]["finish_reason"]) == (0.75, "done")
    full = {**rows[6], **written_cells(piece_writes(0, 5, [Step(6, History(), T0, TO_ENV)]))[6]}
    got, tail = read_trajectory(full, 5)
    assert got == hist and tail is not None and tail.error == "tool_error"


def test_an_agents_end_writes_no_piece_and_the_gateways_last_wait_has_none_to_write():
    hist = History((T0, OBS0, T1))
    (done,) = piece_writes(3, 3, [Step(4, hist, None, "stop", 1.0)])  # env.{K}: k == bound
    row = done.to_pylist()[0]
    assert row["response_ids"] == [1, 2, 3, 8, 9, 4, 5] and row["env_reward"] == 1.0
    assert not any(c.startswith("piece") for c in done.schema.names)
