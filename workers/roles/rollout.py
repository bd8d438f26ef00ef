"""The rollout role: the model pieces of every trajectory, generated with the policy version the
mode requires (docs/training.md "The rollout role", "Trajectories").

Task ``rollout`` writes piece 0 of each row (whole groups: the G samples of a prompt in one call,
seeded per group by (run seed, group id, policy version), sample j with the group's seed + j);
``rollout.{k}`` (``workers.roles.continuation``) writes the model pieces that continue a row after
an observation (a new turn, seeded by (run seed, group id, turn, policy version, row id)) or after
a cut (the same turn, drawing on from its seed with its tokens so far as used draws). Both go
through ``RolloutStage.process_all``, the one call path: read the rows' pieces, load the newest
version (at least each row's ``min_policy_version`` and its last piece's: versions never decrease
along a trajectory), generate one piece per row in ONE engine call (several leases may share it:
the loop's ride-along rows, ``workers.roles.riding``), close each generation into a piece
(``workers.agent.pieces.Rules``) and map it to the row's writes (``piece_rows.piece_writes``).

With partial rollout (``Rules.max_cuts`` > 0, a ``VersionWatch``), a newer published version
cuts the call: cut rows write a "cut" piece and go on in ``rollout.{k+1}``; a row cut past its
bound of cuts is continued at once in this version, uncut, so its piece never ends "cut". With
``reference.placement = rollout`` (single-turn) the frozen reference scores each ended response,
written in the same write as it. A table of one piece (single-turn, uncut) gets one plain batch of
every row, carried with the ack.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import pyarrow as pa

from storage.schema import ROW_ID, Lease
from workers.agent.piece_rows import Step, piece_writes, read_history
from workers.agent.pieces import History, Piece, Rules, context_ids
from workers.engines.base import (
    FINISH_CUT,
    Generation,
    Interruptible,
    LoadsWeightsFile,
    RolloutEngine,
    SamplingParams,
)
from workers.rl.reference import ReferenceScorer
from workers.runtime.events import WeightSyncReport
from workers.runtime.leases import Parts
from workers.schema import ROLLOUT_READS, piece_bound, piece_of
from workers.weights.file_sync import WeightSubscriber, weights_path
from workers.weights.watch import VersionWatch

# (lease position in the call, the Parts of rows it finished): the loop's early writes
EarlySink = Callable[[int, Parts], None]


def sampling_seed(run_seed: int, group_id: int, policy_version: int) -> int:
    return (run_seed * 1_000_003 + group_id * 7_919 + policy_version * 104_729) % (2**31 - 1)


def turn_seed(run_seed: int, group_id: int, turn: int, policy_version: int, row_id: int) -> int:
    return (run_seed * 1_000_003 + group_id * 7_919 + policy_version * 104_729
            + turn * 15_485_863 + row_id * 32_452_843) % (2**31 - 1)


@dataclass(frozen=True)
class Job:
    """One row a call continues with a model piece."""

    lease: int  # its lease's position in the call
    row_id: int
    group_id: int
    prompt: list[int]
    hist: History  # its pieces so far
    required: int  # the version it needs at least
    seed: int | None  # its turn's stream (a cut turn goes on); None: a new turn
    nth: int | None  # piece 0 of a whole group: the sample's index in its group

    def context(self) -> list[int]:
        return context_ids(self.prompt, self.hist)


class RolloutStage:
    task = "rollout"
    columns = ROLLOUT_READS
    piece = 0
    # set by ``workers.roles.continuation.rollout_stages`` in a partial run: the tasks whose rows
    # the loop may claim to ride along this stage's calls, and how often it writes rows early
    along: tuple[str, ...] = ()
    early_s: float | None = None

    def __init__(self, engine: RolloutEngine, weights: WeightSubscriber, params: SamplingParams, *,
                 worker: str, group_size: int, groups_per_claim: int, seed: int,
                 weight_wait_s: float, tail_cut: bool, rules: Rules | None = None,
                 on_sync: Callable[[WeightSyncReport], None] = lambda r: None,
                 reference: ReferenceScorer | None = None,
                 watch: VersionWatch | None = None) -> None:
        self.engine, self.weights, self.params = engine, weights, params
        self.worker, self.group_size, self.seed = worker, group_size, seed
        self.max_rows = group_size * groups_per_claim
        self.weight_wait_s, self.on_sync = weight_wait_s, on_sync
        # None: single-turn and uncut, each row one piece
        self.rules = rules or Rules(1, params.max_new_tokens, params.max_new_tokens)
        self.bound = piece_bound(self.rules.max_turns, self.rules.max_cuts)
        self.whole_groups = not self.rules.agent_driven  # a gateway run: episodes open apart
        self.reference = reference  # None: another role writes ref_logprobs (or none does)
        if reference is not None and self.rules.max_turns > 1:
            raise ValueError("reference.placement=rollout scores single-turn responses only; a "
                             "multi-turn run scores them with a reference worker")
        self.watch = watch  # partial rollout: what tells a generation a newer version is out
        if self.rules.max_cuts and watch is None:
            raise ValueError("partial rollout needs a VersionWatch")
        # cut at the tail too, newer version or not, where the engine gates a cut by its live
        # rows (rollout.partial_tail_cut): the tail then rides the next call
        gate = getattr(engine, "cut_live_fraction", 1.0)
        self.tail_cut = bool(tail_cut and self.rules.max_cuts and gate < 1.0)
        self.cuts_total = 0  # pieces ended "cut" (worker metrics)
        self.resumed_tokens_total = 0  # tokens of pieces continuing a cut
        self.last_tokens = 0
        # collective sync: weights arrive on another thread, never while this stage generates
        self.engine_lock = getattr(weights, "engine_lock", None) or nullcontext()

    @property
    def max_cuts(self) -> int:
        return self.rules.max_cuts

    # -- weights -----------------------------------------------------------------------------
    def ensure_version(self, required: int) -> None:
        """Load the newest published version if it is newer than the engine's, waiting (bounded)
        until one >= ``required`` exists (broadcast, or as a file). Partial rollout: at least the
        newest its watch knows of, so a generation does not start with weights a broadcast
        still being applied would cut at its first token."""
        if self.max_cuts and self.watch is not None:
            required = max(required, getattr(self.watch, "seen", -1))
        wait_engine = getattr(self.weights, "wait_engine", None)
        if wait_engine is not None and wait_engine(self.engine, required, self.weight_wait_s):
            return
        with self.engine_lock:
            self._ensure_file_version(required)

    def _ensure_file_version(self, required: int) -> None:
        if self.engine.policy_version >= required:
            newest = self.weights.newest()
            if newest is None or newest <= self.engine.policy_version:
                return
        else:
            newest = self.weights.wait_for(required, self.weight_wait_s)
        start = time.perf_counter()
        if isinstance(self.engine, LoadsWeightsFile):  # e.g. vLLM reads the file in its worker
            path = weights_path(self.weights.directory, newest)
            nbytes = path.stat().st_size
            self.engine.load_weights_file(path, newest)
        else:
            tensors, nbytes = self.weights.load(newest)
            self.engine.load_weights(tensors, newest)
        self.on_sync(WeightSyncReport(self.worker, newest, time.perf_counter() - start, nbytes))

    # -- the call ----------------------------------------------------------------------------
    def process(self, lease: Lease) -> pa.RecordBatch | Parts:
        return self.process_all([lease])[0]

    def process_all(self, leases: Sequence[Lease], early: EarlySink | None = None
                    ) -> list[pa.RecordBatch | Parts]:
        """The writes of each lease (``rollout`` or ``rollout.{k}`` rows), generated in one
        call; ``early(i, parts)``: the writes of rows of lease i as they finish, before the call
        returns (the final result holds them too)."""
        jobs = [job for i, lease in enumerate(leases) for job in self._jobs(i, lease)]
        self.last_tokens = 0
        if not jobs:  # every row ended earlier: ack, nothing to write
            return [Parts() for _ in leases]
        self.ensure_version(max(j.required for j in jobs))
        with self.engine_lock:  # the version that generates is the version the pieces record
            version = self.engine.policy_version
            seeds = [self._seed(j, version) for j in jobs]
            report = None
            if early is not None:
                def report(i: int, gen: Generation) -> None:
                    job = jobs[i]
                    piece = self.rules.close(gen, job.hist, version=version, seed=seeds[i])
                    early(job.lease, self._writes(leases[job.lease], [(job, piece)]))
            pieces = self._pieces(len(leases), jobs, seeds, version, report)
        self.last_tokens = sum(len(p.ids) for p in pieces)
        self.cuts_total += sum(p.end == FINISH_CUT for p in pieces)
        self.resumed_tokens_total += sum(len(p.ids) for j, p in zip(jobs, pieces, strict=True)
                                         if j.seed is not None)
        return [self._writes(lease, [(j, p) for j, p in zip(jobs, pieces, strict=True)
                                     if j.lease == i]) for i, lease in enumerate(leases)]

    def _jobs(self, position: int, lease: Lease) -> list[Job]:
        k = piece_of(lease.task)
        nth: dict[int, int] = {}
        out = []
        for row in lease.batch.to_pylist():
            hist = History() if k == 0 else read_history(row, k)
            if hist is None:  # ended before piece k (its gate was written NULL): nothing to do
                continue
            last = hist.pieces[-1] if hist.pieces else None
            gid, n = row["group_id"], None
            if k == 0 and self.whole_groups:
                n = nth[gid] = nth.get(gid, -1) + 1
            out.append(Job(position, row[ROW_ID], gid, row["prompt_ids"], hist,
                           max(row["min_policy_version"], hist.last_version()),
                           last.seed if last is not None and last.end == FINISH_CUT else None,
                           n))
        return out

    def _seed(self, job: Job, version: int) -> int:
        if job.seed is not None:
            return job.seed
        if job.nth is not None:
            return sampling_seed(self.seed, job.group_id, version) + job.nth
        return turn_seed(self.seed, job.group_id, job.hist.turn, version, job.row_id)

    def _pieces(self, leases: int, jobs: list[Job], seeds: list[int], version: int,
                report: Callable[[int, Generation], None] | None) -> list[Piece]:
        """One piece per job; a row cut past its bound goes on at once, uncut, in this
        version (its piece is then the two generations joined)."""
        params = self.rules.params(self.params, [j.hist for j in jobs])
        cut = self.cut_event(version)
        if leases == 1 and all(j.nth is not None for j in jobs):
            gens = self._generate_groups(jobs, seeds, params, cut, report)
        else:
            gens = self._generate_rows(jobs, seeds, params, cut, report)
        pieces = [self.rules.close(g, j.hist, version=version, seed=s)
                  for j, g, s in zip(jobs, gens, seeds, strict=True)]
        over = [i for i, (j, p) in enumerate(zip(jobs, pieces, strict=True))
                if p.end == FINISH_CUT and not self.rules.may_cut(j.hist)]
        if over:
            more = [dataclasses.replace(jobs[i], hist=jobs[i].hist.then(pieces[i]))
                    for i in over]

            def joined(m: int, gen: Generation) -> Generation:
                first = pieces[over[m]]
                return Generation([*first.ids, *gen.token_ids],
                                  [*first.logprobs, *gen.logprobs], gen.finish_reason)

            rest = self._generate_rows(
                more, [seeds[i] for i in over], self.rules.params(self.params,
                                                                  [m.hist for m in more]),
                None, None if report is None else (lambda m, g: report(over[m], joined(m, g))))
            for m, (i, gen) in enumerate(zip(over, rest, strict=True)):
                pieces[i] = self.rules.close(joined(m, gen), jobs[i].hist, version=version,
                                             seed=seeds[i])
        return pieces

    def _generate_rows(self, jobs: list[Job], seeds: list[int], params: SamplingParams,
                       cut: threading.Event | None,
                       report: Callable[[int, Generation], None] | None) -> list[Generation]:
        """One prompt per job, with its own seed and used draws."""
        done = tuple(len(j.hist.open_turn()) for j in jobs)
        params = dataclasses.replace(params, seed=seeds[0], prompt_seeds=tuple(seeds),
                                     done_tokens=done if any(done) else ())
        return [g[0] for g in self.generate([j.context() for j in jobs], 1, params, cut,
                                            report)]

    def _generate_groups(self, jobs: list[Job], seeds: list[int], params: SamplingParams,
                         cut: threading.Event | None,
                         report: Callable[[int, Generation], None] | None) -> list[Generation]:
        """Piece 0 of whole groups: G samples per prompt in one call, sample j of a group the
        job with ``nth`` j (seeded with the group's seed + j)."""
        rows_of: dict[int, list[int]] = {}  # rows of one group are contiguous only by accident
        for i, job in enumerate(jobs):
            rows_of.setdefault(job.group_id, []).append(i)
        for gid, rows in rows_of.items():
            if len(rows) != self.group_size:
                raise ValueError(
                    f"group {gid}: claimed {len(rows)} rows, expected {self.group_size}")
        groups = list(rows_of.values())
        params = dataclasses.replace(params, seed=seeds[groups[0][0]],
                                     prompt_seeds=tuple(seeds[rows[0]] for rows in groups))
        flat = [i for rows in groups for i in rows]  # engine index g * G + j -> job
        on_done = None if report is None else (lambda n, gen: report(flat[n], gen))
        out: list[Generation] = [Generation() for _ in jobs]
        samples = self.generate([jobs[rows[0]].prompt for rows in groups], self.group_size,
                                params, cut, on_done)
        for rows, group in zip(groups, samples, strict=True):
            for i, sample in zip(rows, group, strict=True):
                out[i] = sample
        return out

    def cut_event(self, version: int) -> threading.Event | None:
        """The event that cuts a generation with ``version`` (None: never cut)."""
        if not (self.max_cuts and self.watch is not None):
            return None
        event = self.watch.arm(version)
        if self.tail_cut:  # the engine's gate holds it until the tail (rollout.partial_tail_cut)
            event.set()
        return event

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 cut: threading.Event | None,
                 on_done: Callable[[int, Generation], None] | None = None
                 ) -> list[list[Generation]]:
        """``engine.generate``, cut by ``cut`` when the engine can be (``Interruptible``), each
        row reported to ``on_done`` as it finishes."""
        if cut is not None and isinstance(self.engine, Interruptible):
            return self.engine.generate_until(prompts, n, params, cut, on_done)
        return self.engine.generate(prompts, n, params)

    # -- the writes --------------------------------------------------------------------------
    def _writes(self, lease: Lease, items: list[tuple[Job, Piece]]) -> pa.RecordBatch | Parts:
        if not items:
            return Parts()
        steps = [Step(j.row_id, j.hist, p, self.rules.then(p, j.hist)) for j, p in items]
        batches = piece_writes(piece_of(lease.task), self.bound, steps)
        if self.reference is not None:
            batches = [self._scored(b, {j.row_id: j for j, _ in items}) for b in batches]
        if self.bound == 1:  # single-turn, uncut: every row ends here, in one batch
            return batches[0]
        return Parts(tuple(batches))

    def _scored(self, batch: pa.RecordBatch, jobs: dict[int, Job]) -> pa.RecordBatch:
        """``batch`` with the ``ref_logprobs`` of the rows it ends (the same write: the trainer
        never sees the response without them). The frozen model: no lock, weight loads never
        touch it."""
        if "response_ids" not in batch.schema.names:
            return batch
        assert self.reference is not None
        rows = [jobs[r] for r in batch.column(ROW_ID).to_pylist()]
        scored = pa.RecordBatch.from_arrays(
            [pa.array([j.group_id for j in rows], pa.int64()),
             pa.array([j.prompt for j in rows], pa.list_(pa.int32())),
             batch.column("response_ids")], names=["group_id", "prompt_ids", "response_ids"])
        return batch.append_column("ref_logprobs", self.reference.score(scored))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
