"""The ``simulated`` engine in a real run: each role's compute replaced by cost-model device holds.

Everything else (controller, workers, store, weight publication, reports) is the real run; a hold
of ``s`` simulated seconds sleeps ``s / time_scale``. No torch at import time. Per-role details:
docs/engines.md, "The simulated engine inside a real run".
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import Lease
from workers.config import SimulatedDevice
from workers.engines.base import (
    FINISH_CUT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    check_generate,
    prompt_seeds_of,
)
from workers.engines.sim_cost import CostModel, drawn_lengths, preset
from workers.runtime.leases import with_row_ids
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
    """A ``RolloutEngine`` (and ``Interruptible``) that draws responses instead of generating them
    (docs/engines.md).

    The tokens are random ids, except the first token of every response: the sample's index j in
    its prompt's call (when ``n <= vocab_size``). A resumed row (``params.done_tokens``) reads it
    back at ``len(prompt) - done`` and redraws its own length, ``drawn_lengths(seed - j, j + 1,
    ...)[j]``: a cut row continues to exactly the length it would have had uncut, whoever resumes
    it, so runs with and without partial rollout face the same workload."""

    def __init__(self, spec: SimulatedDevice, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.device = Device(spec)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.policy_version = 0

    def _drawn(self, seed: int, n: int, cap: int) -> list[int]:
        spec = self.device.spec
        return drawn_lengths(seed, n, spec.median_response_tokens, spec.skew, cap,
                             spec.tail_fraction, spec.tail_factor)

    def lengths(self, num_prompts: int, n: int, params: SamplingParams) -> list[int]:
        """Each prompt's ``n`` lengths from its own seed (``prompt_seeds_of``): a group's lengths
        do not depend on the batch it was claimed in (``sim_cost.drawn_lengths``)."""
        seeds = prompt_seeds_of(params, num_prompts, n) or [0] * num_prompts
        return [length for seed in seeds for length in self._drawn(seed, n, params.max_new_tokens)]

    def _remaining(self, prompts: Sequence[Sequence[int]], n: int,
                   params: SamplingParams) -> list[int]:
        """Each row's tokens to generate in this call: its drawn length, less the tokens a resumed
        row already has (its total is the one drawn for the uncut generation, whose cap was this
        call's ``max_new_tokens + done``), at most ``max_new_tokens``."""
        if not params.done_tokens:
            return self.lengths(len(prompts), n, params)
        if n != 1 or len(params.done_tokens) != len(prompts):
            raise ValueError(f"generate: done_tokens needs n == 1 and one entry per prompt (n={n}, "
                             f"{len(params.done_tokens)} entries for {len(prompts)} prompts)")
        seeds = prompt_seeds_of(params, len(prompts), 1) or [0] * len(prompts)
        out = []
        for prompt, seed, done in zip(prompts, seeds, params.done_tokens, strict=True):
            if done == 0:
                out.append(self._drawn(seed, 1, params.max_new_tokens)[0])
                continue
            if done > len(prompt):
                raise ValueError(f"generate: done_tokens {done} exceeds its prompt ({len(prompt)})")
            j = int(prompt[len(prompt) - done])  # the first response token: the sample index
            total = self._drawn(seed - j, j + 1, params.max_new_tokens + done)[j]
            out.append(min(max(total - done, 1), params.max_new_tokens))
        return out

    def _responses(self, lengths: Sequence[int], n: int,
                   params: SamplingParams) -> list[Generation]:
        rng = np.random.default_rng((params.seed or 0) + 1)
        stops = params.stop_token_ids + self.eos_ids
        flat: list[Generation] = []
        for index, length in enumerate(lengths):  # prompt i's samples: rows i * n .. i * n + n - 1
            tokens = rng.integers(0, self.vocab_size, size=length).tolist()
            fresh = not params.done_tokens or params.done_tokens[index] == 0
            if fresh and n <= self.vocab_size:
                tokens[0] = index % n  # the sample index a resume reads back (class docstring)
            stopped = length < params.max_new_tokens
            if stopped and stops:  # a response that ended early ends with a stop token
                tokens[-1] = stops[0]
            flat.append(Generation(tokens, [-math.log(self.vocab_size)] * length,
                                   FINISH_STOP if stopped else FINISH_LENGTH))
        return flat

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        lengths = self._remaining(prompts, n, params)
        flat = self._responses(lengths, n, params)
        self.device.hold(spread_generate_s(
            self.device.cost, [len(p) for p in prompts],
            [lengths[i * n : (i + 1) * n] for i in range(len(prompts))], self.device.spec.devices))
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def generate_until(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
        cut: threading.Event, on_done: Callable[[int, Generation], None] | None = None,
    ) -> list[list[Generation]]:
        """``generate`` on one device, decode step by decode step in simulated time
        (``CostModel.step_times``): the hold sleeps from one row's end to the next, waking early
        when ``cut`` is set; then it ends the step in progress (at least step 1) and cuts the
        unfinished rows there. ``busy_s`` counts the simulated seconds held."""
        if self.device.spec.devices != 1:
            raise ValueError("generate_until: a simulated rollout cut runs on one device "
                             f"(simulated.devices = {self.device.spec.devices})")
        check_generate(prompts, n)
        if n > self.vocab_size:
            raise ValueError(f"generate_until: n={n} samples exceed the vocabulary "
                             f"({self.vocab_size}): the sample index is a token")
        lengths = self._remaining(prompts, n, params)
        flat = self._responses(lengths, n, params)
        times = self.device.cost.step_times(_prompt_tokens([len(p) for p in prompts]), lengths)
        scale = self.device.spec.time_scale
        by_step: dict[int, list[int]] = {}
        for row, length in enumerate(lengths):
            by_step.setdefault(length, []).append(row)
        start, steps, reported = time.monotonic(), len(times), 0
        for step in sorted(by_step):  # sleep to each row's end, unless cut first
            if cut.wait(max(times[step - 1] / scale - (time.monotonic() - start), 0.0)):
                # the decode step in progress (the first one ending at or after now) ends first
                elapsed = (time.monotonic() - start) * scale
                steps = min(bisect.bisect_left(times, elapsed) + 1, len(times))
                left = times[steps - 1] / scale - (time.monotonic() - start)
                if left > 0:
                    time.sleep(left)  # the device's hold, not a wait for a condition
                break
            reported = step
            for row in by_step[step]:
                if on_done is not None:
                    on_done(row, flat[row])
        self.device.busy_s += times[steps - 1] if times else 0.0
        for step in sorted(by_step):  # rows that ended in the stretch a cut interrupted
            if reported < step <= steps and on_done is not None:
                for row in by_step[step]:
                    on_done(row, flat[row])
        for row, length in enumerate(lengths):
            if length > steps:  # unfinished: cut after the steps done
                g = flat[row]
                flat[row] = Generation(g.token_ids[:steps], g.logprobs[:steps], FINISH_CUT)
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

    def __init__(self, device: Device, *, reference: bool, devices: int) -> None:
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

    def __init__(self, device: Device, *, updates_per_batch: int, devices: int) -> None:
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
