"""Partial rollout's stages (docs/partial.md): the rollout stage writing a cut piece, a
continuation completing it into the uncut response, a row cut past its bound continued at once,
the reference scoring ended rows only, the loop's early writes, and per-token staleness."""

from __future__ import annotations

import dataclasses
import threading

import pyarrow as pa
import pytest
import torch
from testkit import NoNewerFiles, ScriptedWatch, written_cells

from storage.schema import ROW_ID, Lease
from workers.agent.piece_rows import piece_reads
from workers.agent.pieces import Rules
from workers.engines.base import FINISH_CUT, Generation, SamplingParams
from workers.rl.staleness import TokenStaleness, run_lengths
from workers.schema import ROLLOUT_READS, samples_table_spec

R = 3
SPEC = samples_table_spec("t", group_size=2, reference_worker=False, fsync="never",
                          partial_cuts=R)



def _rows(task: str, rows: list[dict], names: tuple[str, ...]) -> Lease:
    arrays = {ROW_ID: pa.array([r[ROW_ID] for r in rows], pa.uint64())}
    arrays.update({k: pa.array([r[k] for r in rows], SPEC.schema.field(k).type) for k in names})
    return Lease(1, "t", task, 0, 0.0, pa.RecordBatch.from_pydict(arrays))


def test_token_staleness_weights_each_run_by_its_tokens():
    # Breaks if staleness is per row instead of per token, or rows without runs are skipped.
    stats = TokenStaleness()
    stats.add(6, [5, 4], [4, 6], [[{"start": 0, "version": 4}, {"start": 2, "version": 5}], None])
    assert run_lengths(None, 4, 6) == [(4, 6)]
    assert stats.rows_resumed == 1 and stats.runs == 3 and stats.tokens == 9
    assert stats.staleness_token_mean == pytest.approx((2 * 2 + 3 * 1 + 4 * 0) / 9)
    assert stats.tokens_per_version_span == pytest.approx(3.0)


@pytest.fixture(scope="module")
def tiny():
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer, encode_prompt

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), tok)
    prompt = encode_prompt(tok, "1+2=")
    batch = pa.RecordBatch.from_pydict({
        "group_id": pa.array([3, 3], pa.int64()), "iteration": pa.array([0, 0], pa.int64()),
        "min_policy_version": pa.array([0, 0], pa.int64()),
        "prompt_ids": pa.array([prompt, prompt], pa.list_(pa.int32())),
        ROW_ID: pa.array([0, 1], pa.uint64())})
    return model, Lease(1, "t", "rollout", 0, 0.0, batch)


def _stage(model, max_cuts: int, watch=None, max_new_tokens: int = 10):
    from workers.engines.torch_rollout import TorchRolloutEngine
    from workers.roles.rollout import RolloutStage

    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    engine = TorchRolloutEngine(model, [], cut_live_fraction=1.0)  # every cut honoured
    rules = Rules(1, max_new_tokens, max_new_tokens, max_cuts=max_cuts) if max_cuts else None
    return RolloutStage(engine, NoNewerFiles(), params, worker="r", group_size=2, groups_per_claim=1,
                        seed=1, weight_wait_s=1.0, rules=rules, watch=watch, tail_cut=False)


def _cut_at(k: int) -> threading.Event:
    from testkit import CutAfter

    return CutAfter(k)


def test_a_cut_piece_and_its_continuation_assemble_the_uncut_response(tiny):
    # A cut at rollout writes piece 0 ("cut"); rollout.1 under the same weights completes it.
    # The assembled response equals the uncut rollout's, with runs [(0, v)] (one version).
    # Breaks if the row's seed or used draws are not carried from piece 0 to its continuation.
    from workers.roles.continuation import rollout_stages
    from workers.runtime.metrics import WorkerMetrics

    model, lease = tiny
    plain = _stage(model, 0).process(lease).to_pydict()
    partial = _stage(model, R, ScriptedWatch(_cut_at(3)))
    metrics = WorkerMetrics()  # what a rollout worker serves: read from its stage per scrape
    metrics.follow_partial(partial)
    served = metrics.registry.get_sample_value
    assert served("streamflow_rollout_cuts_total") == 0
    cells = written_cells(partial.process(lease).batches)
    assert partial.cuts_total == 2 and served("streamflow_rollout_cuts_total") == 2
    for r in (0, 1):
        assert cells[r]["piece0_end"] == FINISH_CUT and cells[r]["piece0_to_model"]
        assert cells[r]["piece0_ids"] == plain["response_ids"][r][:3]
        assert "response_ids" not in cells[r]
    _, one = rollout_stages(partial)[:2]
    assert one.task == "rollout.1" and partial.along == ("rollout.1", "rollout.2", "rollout.3")
    base = {"group_id": 3, "iteration": 0, "min_policy_version": 0,
            "prompt_ids": lease.batch.column("prompt_ids")[0].as_py()}
    rows = _rows("rollout.1", [{**base, **cells[r], ROW_ID: r} for r in (0, 1)],
                 (*ROLLOUT_READS, *piece_reads(1)))
    out = written_cells(one.process(rows).batches)
    resumed_tokens = sum(len(plain["response_ids"][r]) - 3 for r in (0, 1))
    assert served("streamflow_rollout_resumed_tokens_total") == resumed_tokens > 0
    assert served("streamflow_rollout_cuts_total") == 2  # the continuation ended both
    for r in (0, 1):
        assert out[r]["response_ids"] == plain["response_ids"][r]
        assert out[r]["response_version_runs"] == [{"start": 0, "version": 0}]
        assert out[r]["response_logprobs"] == pytest.approx(plain["response_logprobs"][r],
                                                            abs=1e-5)
        assert out[r]["piece1_ids"] == plain["response_ids"][r][3:]
        assert out[r]["piece2_ids"] is None and out[r]["piece1_to_model"] is None


def test_a_row_cut_past_its_bound_goes_on_at_once_uncut(tiny):
    # With one cut allowed, the continuation's call is cut again: its rows are continued in the
    # same process call, uncut, so no piece past the bound ends "cut" and the response is the
    # uncut one. Breaks if the second cut is written (a piece the table has no task for) or the
    # continuation loses the used draws.
    from workers.roles.continuation import rollout_stages

    model, lease = tiny
    plain = _stage(model, 0).process(lease).to_pydict()
    again = _cut_at(2)
    partial = _stage(model, 1, ScriptedWatch(_cut_at(3), again))
    cells = written_cells(partial.process(lease).batches)
    _, one = rollout_stages(partial)
    uncut = []
    generate = partial.engine.generate
    partial.engine.generate = lambda *a: uncut.append(a) or generate(*a)  # type: ignore
    base = {"group_id": 3, "iteration": 0, "min_policy_version": 0,
            "prompt_ids": lease.batch.column("prompt_ids")[0].as_py()}
    rows = _rows("rollout.1", [{**base, **cells[r], ROW_ID: r} for r in (0, 1)],
                 (*ROLLOUT_READS, *piece_reads(1)))
    out = written_cells(one.process(rows).batches)
    assert again.looks >= 2 and len(uncut) == 1  # cut again, then continued in one more call
    assert partial.cuts_total == 2  # the two piece-0 cuts; the second cut never stands
    for r in (0, 1):
        assert out[r]["piece1_end"] != FINISH_CUT
        assert out[r]["response_ids"] == plain["response_ids"][r]


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


class _Finishing(_Scripted):
    """Reports row 1 (sample 1 of the group) finished before the call returns."""

    def generate_until(self, prompts, n, params, cut, on_done=None):
        on_done(1, self.gens[1])
        return [self.gens]


class _Reference:
    def score(self, batch):
        return pa.array([[-1.0] * len(r) for r in batch.column("response_ids").to_pylist()],
                        pa.list_(pa.float32()))


GENS = [Generation([1, 2], [-0.25, -0.5], FINISH_CUT), Generation([3], [-0.75], "stop")]
LEASE = Lease(1, "t", "rollout", 0, 0.0, pa.RecordBatch.from_pydict({
    "group_id": pa.array([3, 3], pa.int64()), "iteration": pa.array([0, 0], pa.int64()),
    "min_policy_version": pa.array([0, 0], pa.int64()),
    "prompt_ids": pa.array([[5, 6], [5, 6]], pa.list_(pa.int32())),
    ROW_ID: pa.array([10, 11], pa.uint64())}))


def _scripted(engine, reference=None):
    from workers.roles.rollout import RolloutStage

    return RolloutStage(engine, NoNewerFiles(), SamplingParams(max_new_tokens=4), worker="r",
                        group_size=2, groups_per_claim=1, seed=1, weight_wait_s=1.0,
                        rules=Rules(1, 4, 4, max_cuts=R), watch=ScriptedWatch(),
                        reference=reference, tail_cut=False)


def test_with_the_reference_in_rollout_only_ended_rows_carry_ref_logprobs_in_their_write():
    # Breaks if a cut row is scored (it has no response yet) or an ended row's ref_logprobs go
    # in a separate write (the trainer could claim the row before them).
    stage = _scripted(_Scripted(GENS), _Reference())
    cells = written_cells(stage.process(LEASE).batches)
    assert "ref_logprobs" not in cells[10] and cells[10]["piece0_ids"] == [1, 2]
    assert cells[11]["ref_logprobs"] == [-1.0] and cells[11]["response_ids"] == [3]
    assert cells[11]["policy_version"] == 7 and stage.cuts_total == 1


class _Client:
    """Records the writes made under a lease."""

    def __init__(self):
        self.writes: list[pa.RecordBatch] = []

    def write(self, table, lease, batch):
        self.writes.append(batch)


def test_the_loops_early_writes_end_finished_rows_and_leave_the_rest_to_its_write():
    # Breaks if an early-written row is written again by the loop (CellAlreadyWritten, "kept"
    # rows), or lost from both, or the early write differs from the loop's write of it.
    from workers.roles.riding import Riding

    alone = written_cells(_scripted(_Scripted(GENS)).process(LEASE).batches)
    client = _Client()
    riding = Riding(client, "t", {}, max_rows=2, early_s=0.0)
    rest = written_cells(riding.process(_scripted(_Finishing(GENS)), LEASE).batches)
    assert set(rest) == {10} and written_cells(client.writes) == {11: alone[11]}
    assert rest[10] == alone[10] and riding.early_rows_total == 1


def test_an_early_write_is_traced_as_a_write_of_its_lease():
    # Breaks if rows written early are missing from the row trace (no write event).
    from workers.roles.riding import Riding
    from workers.runtime.trace import Tracer

    sent: list = []
    riding = Riding(_Client(), "t", {}, max_rows=2, early_s=0.0,
                    tracer=Tracer(sent.append, "r", enabled=True))
    riding.process(_scripted(_Finishing(GENS)), LEASE)
    assert [r.event for r in sent] == ["write"]
    assert sent[0].row_ids == [11] and sent[0].task == "rollout" and sent[0].ends == ["stop"]


def test_a_stage_call_that_raises_hands_the_riders_back_as_failed_deliveries():
    from workers.roles.riding import Riding

    class Boom:
        def process_all(self, leases, early):
            raise RuntimeError("boom")

    class Client:
        def __init__(self):
            self.released: list = []

        def claim(self, table, task, columns, n):
            return dataclasses.replace(LEASE, task=task)

        def release(self, lease, error=None):
            self.released.append((lease.task, error))

    client = Client()
    riding = Riding(client, "t", {"rollout.1": ROLLOUT_READS}, max_rows=2, early_s=None)
    with pytest.raises(RuntimeError, match="boom"):
        riding.process(Boom(), LEASE)
    assert [t for t, _ in client.released] == ["rollout.1"]
    assert "boom" in client.released[0][1]
