"""The cost model of simulated devices: how long a device is held for each piece of RL work.

Owns ``CostModel`` (with the calibrated preset ``7b-1acc``), ``Workload`` and the pure functions
that turn rows into simulated seconds (all finite and >= 0). Formulas: docs/engines.md, "The cost
model of simulated devices".
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from workers.settings import SimulatedDevice

# H100 SXM, NVIDIA's datasheet (dense BF16 FLOP/s, HBM3 bytes/s): docs/engines.md
H100_BF16_FLOPS = 989e12
H100_HBM_BYTES_PER_S = 3.35e12


@dataclass(frozen=True)
class CostModel:
    """Per-device costs, in simulated seconds (formulas: docs/engines.md)."""

    name: str
    params: float  # model parameters N
    prefill_s_per_token: float
    decode_base_s: float  # one decode step with (almost) no live sequences
    decode_per_seq_s: float  # extra per live sequence per decode step
    reward_s_per_sample: float
    ref_s_per_token: float
    train_s_per_token: float
    optimizer_s: float  # AdamW over all parameters on one device (divided by the DP degree)
    allreduce_bandwidth: float  # bytes/s of bus bandwidth per device for the gradient all-reduce
    sync_bandwidth: float  # bytes/s from the trainer to each rollout engine
    sync_latency_s: float  # fixed part of a weight load (engine reload, cache reset)

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    def allreduce_s(self, devices: int) -> float:
        """Ring all-reduce of bf16 gradients: 2 (n-1)/n * bytes / bus bandwidth."""
        if devices <= 1:
            return 0.0
        return 2.0 * (devices - 1) / devices * self.weight_bytes / self.allreduce_bandwidth

    def step_s(self, devices: int) -> float:
        """End of an iteration on ``devices`` data-parallel trainer devices."""
        return self.allreduce_s(devices) + self.optimizer_s / max(devices, 1)

    def sync_s(self) -> float:
        return self.weight_bytes / self.sync_bandwidth + self.sync_latency_s

    def generate_s(self, prompt_tokens: int, lengths: Sequence[int]) -> float:
        if not lengths:
            return 0.0
        return (self.prefill_s_per_token * prompt_tokens * len(lengths)
                + self.decode_base_s * max(lengths) + self.decode_per_seq_s * sum(lengths))

    def step_times(self, prompt_tokens: int, lengths: Sequence[int]) -> list[float]:
        """``t[s - 1]``: the simulated seconds from the start of a ``generate_s`` call to the end of
        its decode step s (1 <= s <= max(lengths)): the prefill, then per step ``decode_base_s +
        decode_per_seq_s * live(s)``, live(s) = rows with length >= s. ``t[-1] ==
        generate_s(prompt_tokens, lengths)``: the call's time when nothing cuts it."""
        import numpy as np

        if not lengths:
            return []
        longest = max(lengths)
        # live(s) for s = 1..longest: rows whose length is at least s (a reverse cumulative count)
        ends = np.bincount(np.asarray(lengths, np.int64), minlength=longest + 1)[1:]
        live = np.cumsum(ends[::-1])[::-1]
        steps = self.decode_base_s + self.decode_per_seq_s * live
        prefill = self.prefill_s_per_token * prompt_tokens * len(lengths)
        return (prefill + np.cumsum(steps)).tolist()

    def reward_s(self, rows: int) -> float:
        return self.reward_s_per_sample * rows

    def reference_s(self, prompt_tokens: int, lengths: Sequence[int]) -> float:
        return self.ref_s_per_token * (prompt_tokens * len(lengths) + sum(lengths))

    def train_s(self, prompt_tokens: int, lengths: Sequence[int]) -> float:
        return self.train_s_per_token * (prompt_tokens * len(lengths) + sum(lengths))


def _preset_7b_1acc() -> CostModel:
    # Qwen2.5-7B on one H100 per device; every constant's derivation and source: docs/engines.md
    # "The cost model of simulated devices" (How the 7b-1acc preset's constants were derived).
    n = 7.6e9
    return CostModel(
        name="7b-1acc",
        params=n,
        prefill_s_per_token=2 * n / (0.5 * H100_BF16_FLOPS),
        decode_base_s=2 * n / (0.75 * H100_HBM_BYTES_PER_S),
        decode_per_seq_s=(256 / 12_500 - 2 * n / (0.75 * H100_HBM_BYTES_PER_S)) / 256,
        reward_s_per_sample=1e-3,
        ref_s_per_token=2 * n / (0.5 * H100_BF16_FLOPS),
        train_s_per_token=6 * n / (0.4 * H100_BF16_FLOPS),
        optimizer_s=n * 36 / (0.7 * H100_HBM_BYTES_PER_S),
        allreduce_bandwidth=50e9,
        sync_bandwidth=50e9,
        sync_latency_s=1.0,
    )


PRESETS: dict[str, CostModel] = {"7b-1acc": _preset_7b_1acc()}


def preset(name: str) -> CostModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost preset {name!r}; presets: {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class Workload:
    """One RL iteration's shape and how its micro-batches are cut."""

    prompts_per_iteration: int = 64
    group_size: int = 8
    prompt_tokens: int = 256  # a math prompt with its chat template
    # the response lengths, distributed as the simulated engine draws them (simulated.*)
    median_response_tokens: int = SimulatedDevice.median_response_tokens
    # sigma of the lognormal; 0 = every response has the median length
    skew: float = SimulatedDevice.skew
    max_response_tokens: int = 4096
    # the long tail: this fraction of responses is median x tail_factor long (``drawn_lengths``)
    tail_fraction: float = SimulatedDevice.tail_fraction
    tail_factor: float = SimulatedDevice.tail_factor
    # Rollout micro-batch = 32 x 8 = 256 sequences: vLLM's default max_num_seqs, the batch the
    # 7b-1acc preset's decode cost was calibrated at (docs/engines.md).
    groups_per_rollout_batch: int = 32
    rows_per_reward_batch: int = 256
    rows_per_reference_batch: int = 256
    rows_per_trainer_batch: int = 128  # whole groups (a multiple of group_size)
    iterations: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        reals = ("skew", "seed", "tail_fraction", "tail_factor")
        for name in [f.name for f in dataclasses.fields(self) if f.name not in reals]:
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.skew <= 4.0:
            raise ValueError(f"Workload.skew must be in [0, 4], got {self.skew}")
        if not 0.0 <= self.tail_fraction <= 1.0:
            raise ValueError(f"Workload.tail_fraction must be in [0, 1], got {self.tail_fraction}")
        if not self.tail_factor >= 1.0:
            raise ValueError(f"Workload.tail_factor must be >= 1, got {self.tail_factor}")
        if self.rows_per_trainer_batch % self.group_size:
            raise ValueError("Workload.rows_per_trainer_batch must be a multiple of group_size "
                             f"({self.rows_per_trainer_batch} % {self.group_size} != 0)")

    @property
    def rows_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.group_size

    def replace(self, **changes: object) -> Workload:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def group_lengths(w: Workload, group_id: int) -> list[int]:
    """The response lengths of the ``group_size`` samples of group ``group_id`` (deterministic)."""
    rng = random.Random(w.seed * 1_000_003 + group_id * 7_919 + 17)
    mu = math.log(w.median_response_tokens)
    body = [max(1, min(w.max_response_tokens, int(round(rng.lognormvariate(mu, w.skew)))))
            for _ in range(w.group_size)]
    if w.tail_fraction <= 0:
        return body
    tails = random.Random(w.seed * 1_000_003 + group_id * 7_919 + 18)  # its own stream
    out = []
    for n in body:
        tail, jitter = tails.random() < w.tail_fraction, tails.lognormvariate(0.0, TAIL_JITTER)
        out.append(_tail_length(w.median_response_tokens, w.tail_factor, jitter,
                                w.max_response_tokens) if tail else n)
    return out


def iteration_lengths(w: Workload, k: int) -> list[int]:
    """Lengths of every row of iteration ``k`` in put order (group ids k*P .. k*P+P-1)."""
    p = w.prompts_per_iteration
    return [n for g in range(k * p, (k + 1) * p) for n in group_lengths(w, g)]


TAIL_JITTER = 0.1  # sigma of a tail length's lognormal jitter around median x tail_factor


def _tail_length(median: int, factor: float, jitter: float, cap: int) -> int:
    return max(1, min(cap, int(round(median * factor * jitter))))


def drawn_lengths(seed: int, n: int, median: int, skew: float, cap: int,
                  tail_fraction: float = SimulatedDevice.tail_fraction,
                  tail_factor: float = SimulatedDevice.tail_factor) -> list[int]:
    """The response lengths the simulated rollout engine draws for one prompt of sampling seed
    ``seed`` (its ``n`` samples): lognormal of median ``median`` and sigma ``skew``, in
    [1, ``cap``]; each one, with probability ``tail_fraction``, replaced by a tail of ``median x
    tail_factor`` (times a lognormal jitter of sigma ``TAIL_JITTER``), capped. A pure function,
    so a bound can recompute a run's lengths (bench.sim). The tails come from a second stream of
    ``seed``, so ``tail_fraction == 0`` draws exactly the plain lognormal, and sample j's length
    is the same for every ``n > j`` (a resumed row redraws its own: workers/engines/simulated)."""
    import numpy as np

    drawn = np.random.default_rng(seed).lognormal(math.log(median), skew, size=n)
    out = np.clip(np.rint(drawn), 1, cap).astype(np.int64).tolist()
    if tail_fraction <= 0:
        return out
    tails = np.random.default_rng([seed, 1])
    draws = tails.random(size=(n, 2))  # per sample: (is it a tail, its jitter's uniform)
    for j in range(n):
        if draws[j, 0] < tail_fraction:
            jitter = math.exp(TAIL_JITTER * _normal(draws[j, 1]))
            out[j] = _tail_length(median, tail_factor, jitter, cap)
    return out


def _normal(u: float) -> float:
    """The standard normal quantile of ``u`` in (0, 1) (a per-sample draw that keeps sample j's
    value independent of n, which a sized ``normal`` draw would not be for two interleaved draws)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
