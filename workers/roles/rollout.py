"""The rollout role: generate G responses per prompt with the policy version the mode requires.

Before generating, loads the newest published version, waiting (bounded) for the rows'
``min_policy_version``; sampling is seeded per group by (run seed, group id, policy version), so
a group's responses do not depend on who claims it (docs/training.md "The rollout role"). With
``reference.placement = rollout`` it also scores what it generated with the frozen reference and
writes ``ref_logprobs`` in the same write, so the trainer does not run the reference forward.
With an agent (``TurnPolicy``), it writes turn 0 of multi-turn trajectories instead
(``workers.roles.turns``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import nullcontext

import pyarrow as pa

from storage.schema import Lease
from workers.agent.trajectory import History
from workers.engines.base import Generation, LoadsWeightsFile, RolloutEngine, SamplingParams
from workers.roles.loop import Parts, with_row_ids
from workers.roles.reference import ReferenceScorer
from workers.roles.turns import TurnPolicy
from workers.runtime.events import WeightSyncReport
from workers.schema import ROLLOUT_READS
from workers.weights.file_sync import WeightSubscriber, weights_path


def sampling_seed(run_seed: int, group_id: int, policy_version: int) -> int:
    return (run_seed * 1_000_003 + group_id * 7_919 + policy_version * 104_729) % (2**31 - 1)


class RolloutStage:
    task = "rollout"
    columns = ROLLOUT_READS
    whole_groups = True

    def __init__(self, engine: RolloutEngine, weights: WeightSubscriber, params: SamplingParams, *,
                 worker: str, group_size: int, groups_per_claim: int, seed: int,
                 weight_wait_s: float,
                 on_sync: Callable[[WeightSyncReport], None] = lambda r: None,
                 reference: ReferenceScorer | None = None,
                 agent: TurnPolicy | None = None) -> None:
        self.engine = engine
        self.weights = weights
        self.params = params
        self.worker = worker
        self.group_size = group_size
        self.max_rows = group_size * groups_per_claim
        self.seed = seed
        self.weight_wait_s = weight_wait_s
        self.on_sync = on_sync
        self.reference = reference  # None: another role writes ref_logprobs (or none does)
        # not None: turn 0 of multi-turn trajectories (workers.roles.turns), same code path as
        # the later turns' rollouts
        self.agent = agent
        if agent is not None and reference is not None:
            raise ValueError("reference.placement=rollout scores single-turn responses only; a "
                             "multi-turn run scores them with a reference worker")
        self.last_tokens = 0
        # collective sync: weights arrive on another thread, never while this stage generates
        self.engine_lock = getattr(weights, "engine_lock", None) or nullcontext()

    def ensure_version(self, required: int) -> None:
        """Load the newest published version if it is newer than the engine's, waiting (bounded)
        until one >= ``required`` exists (broadcast, or as a file)."""
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

    def process(self, lease: Lease) -> pa.RecordBatch | Parts:
        batch = lease.batch
        self.ensure_version(max(batch.column("min_policy_version").to_pylist()))
        with self.engine_lock:  # the version that generates is the version the rows record
            version = self.engine.policy_version
            generations = self._generate(lease, version)
        if self.agent is not None:  # turn 0 of a trajectory: the shared turn path
            return self.agent.close(0, lease.row_ids, [History()] * len(generations),
                                    generations, version)
        columns = single_turn_columns(generations, version)
        if self.reference is not None:  # the frozen model: no lock, weight loads never touch it
            scored = pa.RecordBatch.from_arrays(
                [batch.column("group_id"), batch.column("prompt_ids"), columns["response_ids"]],
                names=["group_id", "prompt_ids", "response_ids"])
            columns["ref_logprobs"] = self.reference.score(scored)
        return with_row_ids(lease, columns)

    def _generate(self, lease: Lease, version: int) -> list[Generation]:
        """One generation per row of the lease (G per group, in one call), in row order."""
        batch = lease.batch
        group_ids = batch.column("group_id").to_pylist()
        prompts = batch.column("prompt_ids").to_pylist()
        # Rows of one group are contiguous only by accident: place results by row, not by order.
        order: list[int] = []  # first row index of each group, in first-seen order
        rows_of: dict[int, list[int]] = {}
        for i, gid in enumerate(group_ids):
            if gid not in rows_of:
                rows_of[gid] = []
                order.append(i)
            rows_of[gid].append(i)
        for gid, rows in rows_of.items():
            if len(rows) != self.group_size:
                raise ValueError(
                    f"group {gid}: claimed {len(rows)} rows, expected {self.group_size}")
        seeds = tuple(sampling_seed(self.seed, group_ids[i], version) for i in order)
        # (``seed``: engines without per-prompt seeds use the first)
        params = dataclasses.replace(self.params, seed=seeds[0], prompt_seeds=seeds)
        if self.agent is not None:
            params = self.agent.params(params, History())
        generations = self.engine.generate([prompts[i] for i in order], self.group_size, params)
        out: list[Generation] = [Generation() for _ in range(batch.num_rows)]
        for first, samples in zip(order, generations, strict=True):
            for row, sample in zip(rows_of[group_ids[first]], samples, strict=True):
                out[row] = sample
        self.last_tokens = sum(len(g.token_ids) for g in out)
        return out


def single_turn_columns(generations: list[Generation], version: int) -> dict[str, pa.Array]:
    """``ROLLOUT_COLUMNS`` of single-turn samples, one generation per row."""
    n = len(generations)
    return {
        "response_ids": pa.array([g.token_ids for g in generations], pa.list_(pa.int32())),
        "response_logprobs": pa.array([g.logprobs for g in generations], pa.list_(pa.float32())),
        "policy_version": pa.array([version] * n, pa.int64()),
        "finish_reason": pa.array([g.finish_reason for g in generations], pa.string()),
        # single-turn: every token is the model's. Written (as NULL) all the same: the
        # trainer claims the column, and the store hands out only written cells
        "response_loss_mask": pa.nulls(n, pa.list_(pa.int8())),
    }
