"""workers.agent.segments: the part chain's pure functions, and RolloutStage/ResumeStage
writing a cut trajectory's segments and assembling it (docs/partial.md)."""

from __future__ import annotations

import dataclasses
import threading

import pyarrow as pa
import pytest
import torch

from storage.schema import ROW_ID, Lease
from workers.agent.segments import (
    Segment,
    assemble_segments,
    continuation_ids,
    part_reads,
    part_writes,
    segments,
    version_runs,
)
from workers.engines.base import FINISH_CUT, FINISH_LENGTH, SamplingParams
from workers.rl.staleness import TokenStaleness, run_lengths
from workers.schema import partial_schema

R = 3
A, B, C = Segment([1, 2], [-0.1, -0.2], 4), Segment([3], [-0.3], 5), Segment([4, 5], [-.4, -.5], 5)


def _cells(batches):
    """row id -> {column: value} over the write batches (a cell written twice is an error)."""
    out: dict[int, dict] = {}
    for b in batches:
        for row in b.to_pylist():
            cells = out.setdefault(row.pop(ROW_ID), {})
            assert not set(cells) & set(row), "a cell written twice"
            cells.update(row)
    return out


def test_version_runs_merge_equal_versions_and_count_from_zero():
    # Breaks if runs are off by one or equal adjacent versions are not merged.
    assert version_runs([A, B, C]) == [(0, 4), (2, 5)]
    assert version_runs([A]) == [(0, 4)]
    assert version_runs([A, Segment([], [], 6), B]) == [(0, 4), (2, 5)]
    a = assemble_segments([A, B, C], "stop")
    assert (a.response_ids, a.policy_version, a.finish_reason) == ([1, 2, 3, 4, 5], 4, "stop")
    assert a.response_logprobs == [-0.1, -0.2, -0.3, -.4, -.5]
    assert continuation_ids([9, 9], [A, B]) == [9, 9, 1, 2, 3]


def test_segment_zero_writes_cut_rows_parts_and_ended_rows_the_response_with_null_fill():
    # Breaks if a cut row also writes response_ids, or an ended row leaves a later part unwritten
    # (its resume.j would never be ready) or part_seed unwritten.
    writes = part_writes([10, 11], 0, R, [((), A, FINISH_CUT), ((), B, "stop")], seeds=[70, 71])
    cells = _cells(writes)
    assert set(cells[10]) == {"part0_ids", "part0_logprobs", "part0_version", "part_seed"}
    assert cells[10]["part_seed"] == 70 and cells[10]["part0_ids"] == [1, 2]
    ended = cells[11]
    parts = {f.name for f in partial_schema(R) if f.name.startswith("part")}
    assert parts <= set(ended) and all(ended[p] is None for p in parts)
    assert ended["response_ids"] == [3] and ended["response_version_runs"] == [
        {"start": 0, "version": 5}]
    assert ended["policy_version"] == 5 and ended["response_loss_mask"] is None


def test_a_resume_reads_the_segments_back_and_ends_or_cuts_again():
    # The row after segment 0 was cut: what resume.1 claims, and its two outcomes.
    row = {"part_seed": 70, "part0_ids": [1, 2], "part0_logprobs": [-0.1, -0.2],
           "part0_version": 4}
    assert set(part_reads(1)) == set(row)
    segs = segments(row, 1)
    assert segs == (A,)
    assert segments({**row, "part0_ids": None}, 1) is None  # ended before: ack untouched
    cut_again = _cells(part_writes([10], 1, R, [(segs, B, FINISH_CUT)]))[10]
    assert set(cut_again) == {"part1_ids", "part1_logprobs", "part1_version"}
    ended = _cells(part_writes([10], 1, R, [(segs, B, FINISH_LENGTH)]))[10]
    assert ended["response_ids"] == [1, 2, 3]
    assert ended["response_version_runs"] == [{"start": 0, "version": 4},
                                              {"start": 2, "version": 5}]
    assert "part0_ids" not in ended and ended["part1_ids"] is None and ended["part2_ids"] is None
    with pytest.raises(ValueError, match="at most 3 cuts"):
        part_writes([10], R, R, [((A, B, C), B, FINISH_CUT)])


def test_token_staleness_weights_each_run_by_its_tokens():
    # Breaks if staleness is per row instead of per token, or rows without runs are skipped.
    stats = TokenStaleness()
    stats.add(6, [5, 4], [4, 6], [[{"start": 0, "version": 4}, {"start": 2, "version": 5}], None])
    assert run_lengths(None, 4, 6) == [(4, 6)]
    assert stats.rows_resumed == 1 and stats.runs == 3 and stats.tokens == 9
    assert stats.staleness_token_mean == pytest.approx((2 * 2 + 3 * 1 + 4 * 0) / 9)
    assert stats.tokens_per_version_span == pytest.approx(3.0)


class _Files:
    """A WeightSubscriber with no newer version ever."""

    directory = "/nonexistent"

    def newest(self):
        return None


def test_rollout_and_resume_stages_cut_then_assemble_the_uncut_response(tmp_path):
    # A cut at rollout writes segment 0; resume.1 under the same weights completes it. The
    # assembled response equals the uncut rollout's, with runs [(0, v)] (one version).
    # Breaks if the row's seed or done tokens are not carried from segment 0 to the resume.
    from workers.engines.torch_rollout import TorchRolloutEngine
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer, encode_prompt
    from workers.roles.resume import ResumeStage
    from workers.roles.rollout import RolloutStage
    from workers.runtime.metrics import WorkerMetrics
    from workers.weights.watch import VersionWatch

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    prompt = encode_prompt(tok, "1+2=")
    batch = pa.RecordBatch.from_pydict({
        "group_id": pa.array([3, 3], pa.int64()), "iteration": pa.array([0, 0], pa.int64()),
        "min_policy_version": pa.array([0, 0], pa.int64()),
        "prompt_ids": pa.array([prompt, prompt], pa.list_(pa.int32())),
        ROW_ID: pa.array([0, 1], pa.uint64())})
    lease = Lease(1, "t", "rollout", 0, 0.0, batch)

    def stage(max_cuts, watch=None):
        engine = TorchRolloutEngine(model, [], cut_live_fraction=1.0)  # every cut honoured
        return RolloutStage(engine, _Files(), params, worker="r",
                            group_size=2, groups_per_claim=1, seed=1, weight_wait_s=1.0,
                            max_cuts=max_cuts, watch=watch, tail_cut=False)

    plain = stage(0).process(lease).to_pydict()
    watch = VersionWatch(tmp_path, poll_s=0.01)
    try:
        partial = stage(R, watch)
        metrics = WorkerMetrics()  # what a rollout worker serves: read from its stage per scrape
        metrics.follow_partial(partial)
        served = metrics.registry.get_sample_value
        assert served("streamflow_rollout_cuts_total") == 0
        watch.arm = lambda version: _cut_at(3)  # type: ignore[method-assign]
        cells = _cells(partial.process(lease).batches)
        assert partial.cuts_total == 2 and served("streamflow_rollout_cuts_total") == 2
        row = {"group_id": 3, "iteration": 0, "min_policy_version": 0, "prompt_ids": prompt}
        resumed = ResumeStage(partial, 1, max_rows=4)
        watch.arm = lambda version: threading.Event()  # type: ignore[method-assign]
        rows = pa.RecordBatch.from_pylist(
            [{**row, **{k: cells[r][k] for k in part_reads(1)}, ROW_ID: r} for r in (0, 1)],
            schema=pa.schema([*(batch.schema.field(c) for c in row), *(
                partial_schema(R).field(c) for c in part_reads(1)),
                pa.field(ROW_ID, pa.uint64())]))
        out = _cells(resumed.process(dataclasses.replace(lease, batch=rows)).batches)
    finally:
        watch.close()
    # the resume's tokens: each row's response past its 3-token segment 0 (the cut at step 3)
    resumed_tokens = sum(len(plain["response_ids"][r]) - 3 for r in (0, 1))
    assert served("streamflow_rollout_resumed_tokens_total") == resumed_tokens > 0
    assert served("streamflow_rollout_cuts_total") == 2  # the resume ended both: no new cut
    for r in (0, 1):
        assert cells[r]["part0_ids"] == plain["response_ids"][r][:3]
        assert out[r]["response_ids"] == plain["response_ids"][r]
        assert out[r]["response_version_runs"] == [{"start": 0, "version": 0}]
        assert out[r]["response_logprobs"] == pytest.approx(plain["response_logprobs"][r],
                                                            abs=1e-5)


def _cut_at(k: int) -> threading.Event:
    class Cut(threading.Event):
        looks = 0

        def is_set(self) -> bool:
            Cut.looks += 1
            return Cut.looks >= k
    return Cut()


class _Scripted:
    """An Interruptible engine returning scripted generations (one group of two rows)."""

    policy_version = 7

    def __init__(self, gens):
        self.gens = gens

    def generate(self, prompts, n, params):
        raise AssertionError("a partial stage calls generate_until")

    def generate_until(self, prompts, n, params, cut, on_done=None):
        return [self.gens]

    def load_weights(self, weights, version):
        pass


class _Reference:
    def score(self, batch):
        return pa.array([[-1.0] * len(r) for r in batch.column("response_ids").to_pylist()],
                        pa.list_(pa.float32()))


def test_with_the_reference_in_rollout_only_ended_rows_carry_ref_logprobs_in_their_write():
    # Breaks if a cut row is scored (it has no response yet) or an ended row's ref_logprobs go
    # in a separate write (the trainer could claim the row before them).
    from workers.engines.base import Generation
    from workers.roles.rollout import RolloutStage

    gens = [Generation([1, 2], [-0.1, -0.2], FINISH_CUT), Generation([3], [-0.3], "stop")]
    stage = RolloutStage(_Scripted(gens), _Files(), SamplingParams(max_new_tokens=4),
                         worker="r", group_size=2, groups_per_claim=1, seed=1,
                         weight_wait_s=1.0, reference=_Reference(),  # type: ignore[arg-type]
                         max_cuts=R, tail_cut=False,
                         watch=type("W", (), {"arm": lambda s, v: threading.Event(),
                                              "close": lambda s: None})())
    batch = pa.RecordBatch.from_pydict({
        "group_id": pa.array([3, 3], pa.int64()), "iteration": pa.array([0, 0], pa.int64()),
        "min_policy_version": pa.array([0, 0], pa.int64()),
        "prompt_ids": pa.array([[5, 6], [5, 6]], pa.list_(pa.int32())),
        ROW_ID: pa.array([0, 1], pa.uint64())})
    cells = _cells(stage.process(Lease(1, "t", "rollout", 0, 0.0, batch)).batches)
    assert "ref_logprobs" not in cells[0] and cells[0]["part0_ids"] == [1, 2]
    assert cells[1]["ref_logprobs"] == [-1.0] and cells[1]["response_ids"] == [3]
    assert cells[1]["policy_version"] == 7 and stage.cuts_total == 1


class _Client:
    """Records the writes made under a lease."""

    def __init__(self):
        self.writes: list[pa.RecordBatch] = []

    def write(self, table, lease, batch):
        self.writes.append(batch)


class _Finishing(_Scripted):
    """Reports row 1 (sample 1 of the group) finished before the call returns."""

    def generate_until(self, prompts, n, params, cut, on_done=None):
        on_done(1, self.gens[1])
        return [self.gens]


def test_early_writes_end_finished_rows_under_the_lease_and_leave_the_rest_to_the_loop():
    # Breaks if an early-written row is written again by the loop (CellAlreadyWritten, "kept"
    # rows), or lost from both, or the early write differs from the loop's write of it.
    from workers.engines.base import Generation
    from workers.roles.early import EarlyWrites
    from workers.roles.rollout import RolloutStage

    gens = [Generation([1, 2], [-0.1, -0.2], FINISH_CUT), Generation([3], [-0.3], "stop")]
    watch = type("W", (), {"arm": lambda s, v: threading.Event(), "close": lambda s: None})()
    batch = pa.RecordBatch.from_pydict({
        "group_id": pa.array([3, 3], pa.int64()), "iteration": pa.array([0, 0], pa.int64()),
        "min_policy_version": pa.array([0, 0], pa.int64()),
        "prompt_ids": pa.array([[5, 6], [5, 6]], pa.list_(pa.int32())),
        ROW_ID: pa.array([10, 11], pa.uint64())})
    lease = Lease(1, "t", "rollout", 0, 0.0, batch)

    def stage(engine):
        return RolloutStage(engine, _Files(), SamplingParams(max_new_tokens=4), worker="r",
                            group_size=2, groups_per_claim=1, seed=1, weight_wait_s=1.0,
                            max_cuts=R, watch=watch, tail_cut=False)

    alone = _cells(stage(_Scripted(gens)).process(lease).batches)
    early = stage(_Finishing(gens))
    client = _Client()
    early.early = EarlyWrites(client, "t", every_s=0.0)
    rest = _cells(early.process(lease).batches)
    assert set(rest) == {10} and _cells(client.writes) == {11: alone[11]}
    assert rest[10] == alone[10]


def test_an_early_write_is_traced_as_a_write_of_its_lease():
    # Breaks if rows written early are missing from the row trace (no write event).
    from workers.engines.base import Generation
    from workers.roles.early import EarlyWrites
    from workers.runtime.trace import Tracer

    sent: list = []
    batch = pa.RecordBatch.from_pydict({"group_id": pa.array([3], pa.int64()),
                                        "iteration": pa.array([0], pa.int64()),
                                        ROW_ID: pa.array([11], pa.uint64())})
    lease = Lease(1, "t", "rollout", 0, 0.0, batch)
    early = EarlyWrites(_Client(), "t", every_s=0.0, tracer=Tracer(sent.append, "r", enabled=True))
    ended = part_writes([11], 0, R, [((), Segment([3], [-0.3], 2), "stop")], seeds=[5])
    call = early.call(lease, lambda got: __import__("workers.roles.loop").roles.loop.Parts(
        tuple(ended)))
    call.on_done(0, Generation([3], [-0.3], "stop"))
    assert call.written == {0} and [r.event for r in sent] == ["write"]
    assert sent[0].row_ids == [11] and sent[0].task == "rollout"
