"""The ``simulated`` engine inside a real run (``streamflow run`` with ``rollout.engine: simulated``
and ``trainer.engine: simulated``): the roles' compute replaced by device holds from the cost model.

Everything else is the real run: the controller and its modes, the worker processes, the store and
its leases, the balancer, the weight publication (files + announcements), the reports. What is
simulated, per role:

- rollout: ``SimulatedRolloutEngine`` behind the real ``RolloutStage`` (``RolloutEngine`` and
  ``LoadsWeightsFile`` protocols). Response lengths are lognormal (median, skew) capped at
  ``max_new_tokens``, drawn from the per-group sampling seed the stage passes (deterministic);
  the tokens are random ids of the real vocabulary (the store moves real-size responses); the
  device is held for ``cost.generate_s`` of the claim, and ``cost.sync_s`` per weight load.
- reward: the real ``RewardStage`` (the verifier runs on the decoded tokens) plus a hold of
  ``cost.reward_s``.
- reference: ``SimulatedReferenceStage``: ``ref_logprobs`` of the right length (placeholders),
  held for ``cost.reference_s``.
- trainer: ``SimulatedTrainer``, the control surface of ``workers.trainer.Trainer`` (claim whole
  groups, park later iterations, one step per iteration, publish, report, ack after the step), with
  ``cost.train_s`` per claim and ``cost.step_s`` per step instead of forward/backward/AdamW. It
  publishes a one-tensor "weights" file per version (the version number): rollout engines pay the
  cost model's sync time, not the copy of a real model.

Time: ``seconds`` of simulated work sleep ``seconds / time_scale`` real seconds. A run's wall
times (summary, timeline) are real seconds: multiply by ``time_scale`` for simulated ones.
What the simulated trainer leaves out (use the torch engine to test them): restarts from a
checkpoint (it writes none), DEAD groups, several ranks.

Imports: no torch at import time (``sim_cost`` and the rollout/reward/reference roles need none);
the trainer imports it when it publishes and computes advantages.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.errors import CellAlreadyWritten, LeaseExpired, Unavailable, UnknownTable
from storage.schema import ROW_ID, Lease
from workers.config import SimulatedDevice
from workers.engines.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from workers.engines.sim_cost import CostModel, preset
from workers.events import Span, StepReport
from workers.loop import LeaseKeeper, with_row_ids

if TYPE_CHECKING:
    import torch

    from workers.weights import WeightPublisher

log = logging.getLogger(__name__)

VERSION_TENSOR = "simulated.policy_version"  # the one tensor of a simulated weights file


class Device:
    """One simulated device: holds for cost-model seconds, counts the simulated busy time."""

    def __init__(self, spec: SimulatedDevice) -> None:
        if not spec.time_scale > 0:
            raise ValueError(f"simulated.time_scale must be > 0, got {spec.time_scale}")
        self.spec = spec
        self.cost: CostModel = preset(spec.cost)
        self.busy_s = 0.0  # simulated seconds held so far

    def hold(self, seconds: float) -> None:
        self.busy_s += seconds
        if seconds > 0:
            time.sleep(seconds / self.spec.time_scale)


def _prompt_tokens(lengths: Sequence[int]) -> int:
    """The cost model prices a batch by one prompt length: the mean (rounded up)."""
    return math.ceil(sum(lengths) / len(lengths)) if lengths else 0


class SimulatedRolloutEngine:
    """A ``RolloutEngine`` that draws responses instead of generating them (module docstring)."""

    def __init__(self, spec: SimulatedDevice, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.device = Device(spec)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.policy_version = 0

    def lengths(self, count: int, params: SamplingParams) -> np.ndarray:
        rng = np.random.default_rng(params.seed)
        spec = self.device.spec
        drawn = rng.lognormal(math.log(spec.median_response_tokens), spec.skew, size=count)
        return np.clip(np.rint(drawn), 1, params.max_new_tokens).astype(np.int64)

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        lengths = self.lengths(len(prompts) * n, params)
        rng = np.random.default_rng((params.seed or 0) + 1)
        stops = params.stop_token_ids + self.eos_ids
        out: list[list[Generation]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                length = int(lengths[i * n + j])
                tokens = rng.integers(0, self.vocab_size, size=length).tolist()
                stopped = length < params.max_new_tokens
                if stopped and stops:  # a response that ended early ends with a stop token
                    tokens[-1] = stops[0]
                group.append(Generation(
                    token_ids=tokens, logprobs=[-math.log(self.vocab_size)] * length,
                    finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
                ))
            out.append(group)
        cost = self.device.cost
        self.device.hold(cost.generate_s(_prompt_tokens([len(p) for p in prompts]),
                                         lengths.tolist()))
        return out

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.device.hold(self.device.cost.sync_s())
        self.policy_version = version

    def load_weights_file(self, path: str | os.PathLike[str], version: int) -> None:
        self.load_weights({}, version)  # the file's content is a version number: not read


class SimulatedRewardStage:
    """The real reward stage, plus the cost model's verifier time."""

    def __init__(self, inner: Any, spec: SimulatedDevice) -> None:
        self.inner = inner
        self.device = Device(spec)
        self.task, self.columns = inner.task, inner.columns
        self.whole_groups, self.max_rows = inner.whole_groups, inner.max_rows

    def process(self, lease: Lease) -> pa.RecordBatch:
        out = self.inner.process(lease)
        self.device.hold(self.device.cost.reward_s(lease.num_rows))
        return out

    def close(self) -> None:
        self.inner.close()


def _lengths(batch: pa.RecordBatch, column: str) -> list[int]:
    return pc.list_value_length(batch.column(column)).to_pylist()


class SimulatedReferenceStage:
    """Reference log-probs without a model: placeholders of each response's length."""

    task = "reference"
    columns = ("group_id", "iteration", "prompt_ids", "response_ids")
    whole_groups = False

    def __init__(self, spec: SimulatedDevice, max_rows: int) -> None:
        self.device = Device(spec)
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> pa.RecordBatch:
        lengths = _lengths(lease.batch, "response_ids")
        prompt = _prompt_tokens(_lengths(lease.batch, "prompt_ids"))
        self.device.hold(self.device.cost.reference_s(prompt, lengths))
        self.last_tokens = sum(lengths)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
        values = pa.array(np.zeros(self.last_tokens, np.float32))
        return with_row_ids(lease, {"ref_logprobs": pa.ListArray.from_arrays(offsets, values)})


class SimulatedTrainer:
    """``workers.trainer.Trainer``'s control surface over a simulated device (module docstring).

    Lifecycle of iteration k's rows: claimed (whole groups) -> held for ``train_s`` (k == step) or
    parked (k > step, lease kept alive by the keeper) -> at ``rows_per_iteration`` trained rows:
    ``step_s`` -> publish version k+1 -> report -> advantages written and leases acked. Rows of an
    iteration below ``step`` (delivered again after a lost lease) are acked without training.
    """

    ranks = None  # one simulated device: no follower ranks

    def __init__(
        self,
        client: Any,
        table: str,
        spec: SimulatedDevice,
        publisher: WeightPublisher,
        *,
        rows_per_iteration: int,
        group_size: int,
        rows_per_claim: int,
        reference_worker: bool,
        std_normalize: bool = True,
        worker: str = "trainer-0",
        send: Callable[[Any], None] = lambda r: None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        self.client, self.table, self.publisher = client, table, publisher
        self.device = Device(spec)
        self.rows_per_iteration, self.group_size = rows_per_iteration, group_size
        self.rows_per_claim, self.std_normalize = rows_per_claim, std_normalize
        self.worker, self.send, self.keeper = worker, send, keeper
        self.columns = (
            "group_id", "iteration", "prompt_ids", "response_ids", "policy_version", "reward",
            "reward_ok",
        ) + (("ref_logprobs",) if reference_worker else ())
        self.step = 0  # = policy version of the current "weights"
        self._parked: dict[int, list[tuple[Lease, pa.RecordBatch]]] = {}
        self._held: dict[int, Lease] = {}  # lease id -> lease, until its rows are all trained
        self._untrained: dict[int, int] = {}  # lease id -> rows of it not yet trained
        self._done: list[tuple[Lease, pa.RecordBatch]] = []  # trained pieces of this iteration
        self._rows_in = self._tokens = 0
        self._first_at: float | None = None
        self._busy_s = 0.0

    def publish_current(self) -> None:
        import torch

        self.publisher.publish({VERSION_TENSOR: torch.tensor([self.step])}, self.step)

    def poll(self, timeout_s: float) -> bool:
        """One claim turn; True when it completed an iteration (a step was taken)."""
        try:
            lease = self.client.claim(self.table, "trainer", list(self.columns),
                                      self.rows_per_claim, whole_groups=True, timeout=timeout_s)
        except (Unavailable, UnknownTable):  # store node down or recovering: its rows come back
            time.sleep(0.5)
            return False
        if lease.num_rows:
            self._accept(lease)
        for lease_, rows in self._parked.pop(self.step, []):
            self._train(lease_, rows)
        if self._rows_in >= self.rows_per_iteration:
            self._finish_iteration()
            return True
        return False

    def _accept(self, lease: Lease) -> None:
        self._held[lease.lease_id] = lease
        self._untrained[lease.lease_id] = lease.num_rows
        if self.keeper is not None:
            self.keeper.hold(lease)
        iterations = lease.batch.column("iteration").to_numpy()
        for it in sorted(set(iterations.tolist())):
            rows = lease.batch.filter(pa.array(iterations == it))
            if it < self.step:  # already in the weights: ack, never train again
                self._trained(lease, rows.num_rows)
            elif it == self.step:
                self._train(lease, rows)
            else:
                self._parked.setdefault(int(it), []).append((lease, rows))

    def _train(self, lease: Lease, rows: pa.RecordBatch) -> None:
        start = time.time()
        self._first_at = self._first_at or start
        lengths = _lengths(rows, "response_ids")
        seconds = self.device.cost.train_s(_prompt_tokens(_lengths(rows, "prompt_ids")), lengths)
        self.device.hold(seconds)
        self._busy_s += time.time() - start
        self._done.append((lease, rows))
        self._rows_in += rows.num_rows
        self._tokens += sum(lengths)
        self.send(Span("trainer", self.worker, start, time.time(), self.step, rows.num_rows,
                       sum(lengths)))

    def _trained(self, lease: Lease, num_rows: int) -> None:
        """Count rows of ``lease`` as trained; ack it once all of them are."""
        self._untrained[lease.lease_id] -= num_rows
        if self._untrained[lease.lease_id] > 0:
            return
        del self._untrained[lease.lease_id], self._held[lease.lease_id]
        if self.keeper is not None:
            self.keeper.drop(lease.lease_id)
        try:
            self.client.ack(lease)
        except (LeaseExpired, Unavailable, UnknownTable) as exc:  # its rows come back: acked then
            log.warning("ack of lease %s refused (%s)", lease.lease_id, exc)

    def _finish_iteration(self) -> None:
        import torch

        from workers.rl import group_advantages

        start = time.time()
        self.device.hold(self.device.cost.step_s(1))
        self.step += 1
        published = self.publisher.publish({VERSION_TENSOR: torch.tensor([self.step])}, self.step)
        end = time.time()
        self._busy_s += end - start
        rows = pa.Table.from_batches([r for _, r in self._done]).combine_chunks()
        rewards = torch.tensor(rows.column("reward").to_pylist(), dtype=torch.float32)
        staleness = [self.step - 1 - v for v in rows.column("policy_version").to_pylist()]
        self.send(Span("trainer", self.worker, start, end, self.step - 1, 0, 0))
        self.send(StepReport(
            iteration=self.step - 1, policy_version=self.step, samples=self._rows_in,
            response_tokens=self._tokens, loss=0.0, kl=0.0, clip_fraction=0.0, grad_norm=0.0,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0,
            reward_failures=sum(1 for ok in rows.column("reward_ok").to_pylist() if not ok),
            staleness_mean=sum(staleness) / max(len(staleness), 1),
            staleness_max=max(staleness, default=0), importance_weight_mean=1.0,
            ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, step_seconds=end - (self._first_at or start),
            publish_seconds=published.seconds, publish_bytes=published.bytes,
            busy_seconds=self._busy_s,
        ))
        for lease, piece in self._done:  # advantages (for inspection), then the ack
            adv = group_advantages(
                torch.tensor(piece.column("reward").to_pylist(), dtype=torch.float32),
                torch.tensor(piece.column("group_id").to_pylist(), dtype=torch.int64),
                group_size=self.group_size, std_normalize=self.std_normalize,
            )
            out = pa.RecordBatch.from_pydict({ROW_ID: piece.column(ROW_ID),
                                              "advantage": pa.array(adv.tolist(), pa.float32())})
            try:
                self.client.write(self.table, lease, out)
            except (LeaseExpired, CellAlreadyWritten, Unavailable, UnknownTable) as exc:
                log.warning("advantages of lease %s not recorded: %s", lease.lease_id, exc)
            self._trained(lease, piece.num_rows)
        self._done, self._rows_in, self._tokens = [], 0, 0
        self._first_at, self._busy_s = None, 0.0

    def follow(self) -> None:
        raise RuntimeError("a simulated trainer has no follower ranks")

    def stop_followers(self) -> None:
        pass

    def release_held(self) -> None:
        """Clean stop: hand every held lease back at once."""
        for lease in self._held.values():
            if self.keeper is not None:
                self.keeper.drop(lease.lease_id)
            self.client.release(lease)
        self._held.clear()
        self._untrained.clear()
