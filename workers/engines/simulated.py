"""The ``simulated`` engine in a real run: each role's compute replaced by cost-model device holds.

Everything else (controller, workers, store, weight publication, reports) is the real run; a hold
of ``s`` simulated seconds sleeps ``s / time_scale``. No torch at import time. Per-role details:
docs/engines.md, "The simulated engine inside a real run".
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import Lease
from workers.config import SimulatedDevice
from workers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    prompt_seeds_of,
)
from workers.engines.sim_cost import CostModel, drawn_lengths, preset
from workers.roles.loop import with_row_ids
from workers.schema import REFERENCE_READS

if TYPE_CHECKING:
    import torch

    from workers.rl.packing import PackGroup

VERSION_TENSOR = "simulated.policy_version"  # the one tensor of a simulated weights file


class Device:
    """One simulated device: holds for cost-model seconds, counts the simulated busy time."""

    def __init__(self, spec: SimulatedDevice) -> None:
        if not spec.time_scale > 0:
            raise ValueError(f"simulated.time_scale must be > 0, got {spec.time_scale}")
        self.spec = spec
        self.cost: CostModel = preset(spec.cost)
        self.busy_s = 0.0  # simulated seconds held so far
        self._until = 0.0  # monotonic end of the hold begun and not yet finished

    def hold(self, seconds: float) -> None:
        self.begin(seconds)
        self.finish()

    def begin(self, seconds: float) -> None:
        """Start a hold that ``finish`` completes (real work in between runs inside the hold)."""
        self.busy_s += seconds
        self._until = time.monotonic() + max(seconds, 0.0) / self.spec.time_scale

    def finish(self) -> None:
        left = self._until - time.monotonic()
        self._until = 0.0
        if left > 0:
            time.sleep(left)


def _prompt_tokens(lengths: Sequence[int]) -> int:
    """The cost model prices a batch by one prompt length: the mean (rounded up)."""
    return math.ceil(sum(lengths) / len(lengths)) if lengths else 0


def data_parallel_s(row_seconds: Sequence[float], devices: int) -> float:
    """A micro-batch's time on ``devices`` data-parallel devices: its rows dealt out whole, the
    costliest first, each to the least-loaded device; the step waits for the most loaded one.
    Never below ``sum / devices`` nor the costliest row (the bound's training terms)."""
    loads = [0.0] * max(devices, 1)
    for seconds in sorted(row_seconds, reverse=True):
        loads[loads.index(min(loads))] += seconds
    return max(loads)


def spread_generate_s(cost: CostModel, prompts: Sequence[int], lengths: Sequence[Sequence[int]],
                      devices: int) -> float:
    """A generate call's time on ``devices`` colocated devices: its prompts (each with its samples'
    ``lengths``) dealt out whole, the costliest first, to the device with the least work so far
    among those with fewer than an equal share (ceil(prompts / devices)); the call waits for the
    slowest device. One device: ``generate_s`` of the whole batch. The share cap keeps every
    device's batch no larger than the call's per-device batch (a larger one decodes cheaper)."""
    bins: list[list[int]] = [[] for _ in range(max(devices, 1))]
    work = [0.0] * len(bins)
    share = -(-len(prompts) // len(bins))
    alone = [cost.generate_s(p, ls) for p, ls in zip(prompts, lengths, strict=True)]
    for i in sorted(range(len(prompts)), key=lambda i: -alone[i]):
        d = min((d for d in range(len(bins)) if len(bins[d]) < share), key=lambda d: work[d])
        bins[d].append(i)
        work[d] += alone[i]
    return max(cost.generate_s(_prompt_tokens([prompts[i] for i in b]),
                               [n for i in b for n in lengths[i]]) for b in bins)


class SimulatedRolloutEngine:
    """A ``RolloutEngine`` that draws responses instead of generating them (docs/engines.md)."""

    def __init__(self, spec: SimulatedDevice, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.device = Device(spec)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.policy_version = 0

    def lengths(self, num_prompts: int, n: int, params: SamplingParams) -> list[int]:
        """Each prompt's ``n`` lengths from its own seed (``prompt_seeds_of``): a group's lengths
        do not depend on the batch it was claimed in (``sim_cost.drawn_lengths``)."""
        spec = self.device.spec
        seeds = prompt_seeds_of(params, num_prompts, n) or [0] * num_prompts
        return [length for seed in seeds for length in drawn_lengths(
            seed, n, spec.median_response_tokens, spec.skew, params.max_new_tokens)]

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        lengths = self.lengths(len(prompts), n, params)
        rng = np.random.default_rng((params.seed or 0) + 1)
        stops = params.stop_token_ids + self.eos_ids
        flat: list[Generation] = []
        for length in lengths:  # prompt i's samples are rows i * n .. i * n + n - 1
            tokens = rng.integers(0, self.vocab_size, size=length).tolist()
            stopped = length < params.max_new_tokens
            if stopped and stops:  # a response that ended early ends with a stop token
                tokens[-1] = stops[0]
            flat.append(Generation(tokens, [-math.log(self.vocab_size)] * length,
                                   FINISH_STOP if stopped else FINISH_LENGTH))
        self.device.hold(spread_generate_s(
            self.device.cost, [len(p) for p in prompts],
            [lengths[i * n : (i + 1) * n] for i in range(len(prompts))], self.device.spec.devices))
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

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
        row = self.device.cost.reward_s(1)
        self.device.hold(data_parallel_s([row] * lease.num_rows, self.device.spec.devices))
        return out

    def close(self) -> None:
        self.inner.close()


def _lengths(batch: pa.RecordBatch, column: str) -> list[int]:
    return pc.list_value_length(batch.column(column)).to_pylist()


class SimulatedReferenceStage:
    """Reference log-probs without a model: placeholders of each response's length."""

    task = "reference"
    columns = REFERENCE_READS
    whole_groups = False

    def __init__(self, spec: SimulatedDevice, max_rows: int) -> None:
        self.device = Device(spec)
        self.max_rows = max_rows
        self.last_tokens = 0

    def process(self, lease: Lease) -> pa.RecordBatch:
        lengths = _lengths(lease.batch, "response_ids")
        prompt = _prompt_tokens(_lengths(lease.batch, "prompt_ids"))
        rows = [self.device.cost.reference_s(prompt, [n]) for n in lengths]
        self.device.hold(data_parallel_s(rows, self.device.spec.devices))
        self.last_tokens = sum(lengths)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
        values = pa.array(np.zeros(self.last_tokens, np.float32))
        return with_row_ids(lease, {"ref_logprobs": pa.ListArray.from_arrays(offsets, values)})


@dataclass
class SimulatedLogprobs:
    """What ``TriModel.forward`` returns, as placeholders: per group, per response ``[L_i]``."""

    policy: list[list[torch.Tensor]]
    ref: list[list[torch.Tensor]] | None


class SimulatedTriModel:
    """``TriModel.forward`` without a model: the hold of ``train_s`` (forward and backward) begins,
    spread over ``devices`` data-parallel devices (``data_parallel_s``), and the log-probs are
    zeros of each response's length (ratio 1, no KL)."""

    def __init__(self, device: Device, *, reference: bool, devices: int = 1) -> None:
        if devices < 1:
            raise ValueError(f"trainer.num_ranks (simulated devices) must be >= 1, got {devices}")
        self.device = device
        self.reference = reference  # the trainer's own reference log-probs (no reference worker)
        self.devices = devices

    def forward(self, groups: Sequence[PackGroup], **_: Any) -> SimulatedLogprobs:
        """``TriModel.forward``'s call; its packing keywords price nothing here."""
        import torch

        lengths = [len(r) for g in groups for r in g.responses]
        prompt = _prompt_tokens([len(g.prompt_ids) for g in groups for _ in g.responses])
        rows = [self.device.cost.train_s(prompt, [n]) for n in lengths]
        # The hold ends in the engine's backward: the trainer's math in between is inside it.
        self.device.begin(data_parallel_s(rows, self.devices))

        def zeros() -> list[list[torch.Tensor]]:
            return [[torch.zeros(len(r)) for r in g.responses] for g in groups]

        return SimulatedLogprobs(policy=zeros(), ref=zeros() if self.reference else None)


class SimulatedTrainingEngine:
    """A ``TrainerEngine`` without parameters: ``backward`` ends the forward's hold, ``step`` holds
    ``cost.step_s(devices)`` (the all-reduce and the sharded optimizer of ``devices`` data-parallel
    devices), and the "weights" are one tensor, the policy version."""

    def __init__(self, device: Device, *, updates_per_batch: int = 1, devices: int = 1) -> None:
        self.device = device
        self.updates_per_batch = updates_per_batch  # optimizer steps per version
        self.devices = devices
        self.steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.device.finish()  # the end of the micro-batch's hold, begun by its forward

    def step(self, grad_scale: float) -> float:
        self.device.hold(self.device.cost.step_s(self.devices))
        self.steps += 1
        return 0.0  # no gradients: the reported norm is 0

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        import torch

        return {VERSION_TENSOR: torch.tensor([self.steps // self.updates_per_batch])}

    def save_state(self, directory: str) -> None:
        raise RuntimeError("a simulated trainer writes no checkpoints")

    def load_state(self, directory: str) -> None:
        raise RuntimeError("a simulated trainer writes no checkpoints: it cannot resume")
