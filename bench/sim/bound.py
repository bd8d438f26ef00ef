"""The theoretical bound of a simulated run: its time with a zero-overhead engine, from the cost
model alone.

``bound_seconds(mode, staleness, layout, cost, workload)`` schedules the same work with the same
rules as the engine, but every claim, write, ack, admission and announcement is instantaneous and
every device pulls the next micro-batch the instant it is free. The engine's efficiency is
``bound / achieved`` (= achieved throughput / bound throughput); an ideal engine scores 1.

Notation (costs from ``workers.engines.sim_cost``; micro-batches cut in put order, as the store hands
them out):

    g_k,b     rollout batch b of iteration k (``groups_per_rollout_batch`` groups)  generate_s
    LS(J, D)  greedy list scheduling: jobs J = (release, cost), taken in release order, each by
              the device of D that is free first: start = max(release, free), end = start + cost
              (what a pull queue does; D keeps its free times from one call to the next)
    A(n)      all-reduce + optimizer step on n trainer devices                     step_s
    S         weight sync (one version into one engine, or out of the trainer)     sync_s
    pub[v]    time version v is announced; pub[0] = 0; the run ends at pub[K]

Streaming (``periodic`` = staleness s 0, ``async`` s >= 1), for k = 0 .. K-1:

    a_k       = pub[max(k - s, 0)]                                   admission (streamflow.admission)
    rollout   LS({(a_k, g_k,b)}, R devices); a device adds S before a batch whenever a newer
              version than the one it holds was announced by the batch's start (weight load)
    reward    rows released when their rollout batch ends, cut into micro-batches in release
    reference order (release = the latest row), LS on W resp. F devices
    trainer   rows released at max(reward end, reference end), cut into micro-batches,
              LS on T devices that are all free at pub[k] + S*[k>0] (after sending version k)
    pub[k+1]  = last trainer end + A(T)

``sync-split`` (separate pools taking turns, the Periodic Asynchrony paper's baseline): the same,
but every trainer micro-batch of k is released at the LAST row's release (no streaming).

``sync`` (colocated, D devices doing every stage in turn), for each k:

    rollout   LS({(pub[k], g_k,b)}, D) with the weight load as above
    reward, reference, trainer: each LS on the D devices with every job released at the end of
              the previous stage (the stages take turns);  pub[k+1] = trainer end + A(D)

The trainer's send (S after each step) and the rollout's load of the same version overlap, so a
boundary costs A + S, not A + 2S. Reward devices never bottleneck in our layouts; the bound
assumes identical devices (the balancer's slow-device case is reported without a bound).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.engines.sim_cost import CostModel, Workload, iteration_lengths


@dataclass(frozen=True)
class Layout:
    """How many simulated devices each role has (sync: ``devices`` colocated devices)."""

    rollout: int = 0
    reward: int = 0
    reference: int = 0
    trainer: int = 0
    devices: int = 0  # sync only

    @property
    def workers(self) -> int:
        return self.devices or (self.rollout + self.reward + self.reference + self.trainer)


def list_schedule(jobs: Sequence[float], n: int) -> float:
    """Makespan of greedy list scheduling of ``jobs`` (all released at 0, in order) on ``n``."""
    free = _devices(n, 0.0)
    return max([0.0, *_ls([(0.0, j) for j in jobs], free)])


def _devices(n: int, at: float) -> list[tuple[float, int]]:
    return [(at, i) for i in range(max(n, 1))]


def _ls(jobs: Sequence[tuple[float, float]], free: list[tuple[float, int]]) -> list[float]:
    """LS(J, D) of the module docstring; ``free`` is a heap of (free time, device), updated."""
    ends = []
    for release, job in sorted(jobs, key=lambda j: j[0]):
        t, i = heapq.heappop(free)
        end = max(t, release) + job
        heapq.heappush(free, (end, i))
        ends.append(end)
    return ends


def _stage(
    release: list[float],
    lengths: list[int],
    size: int,
    cost_of: Any,
    devices: list[tuple[float, int]],
) -> list[float]:
    """Rows (by index) through one stage: cut into micro-batches of ``size`` rows in release
    order (a micro-batch is released with its latest row), LS on ``devices``; the end per row."""
    order = sorted(range(len(release)), key=lambda i: release[i])
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    ends = [0.0] * len(release)
    jobs = [(max(release[i] for i in c), cost_of([lengths[i] for i in c])) for c in chunks]
    # _ls sorts by release; chunks are already in release order (stable sort keeps it)
    for c, end in zip(chunks, _ls(jobs, devices), strict=True):
        for i in c:
            ends[i] = end
    return ends


class _Rollout:
    """Rollout devices with the version each holds (the weight-load rule)."""

    def __init__(self, n: int, cost: CostModel, w: Workload) -> None:
        self.free = _devices(n, 0.0)
        self.loaded = [0] * max(n, 1)
        self.cost, self.w = cost, w

    def run(self, k: int, release: float, pub: list[float]) -> tuple[list[float], list[int]]:
        """Generate iteration k; returns the end and the length of every row (put order)."""
        lengths = iteration_lengths(self.w, k)
        size = self.w.groups_per_rollout_batch * self.w.group_size
        ends: list[float] = []
        for i in range(0, len(lengths), size):
            batch = lengths[i : i + size]
            t, d = heapq.heappop(self.free)
            start = max(t, release)
            newest = max(v for v, p in enumerate(pub) if p <= start)
            if newest > self.loaded[d]:
                start += self.cost.sync_s()
                self.loaded[d] = newest
            end = start + self.cost.generate_s(self.w.prompt_tokens, batch)
            heapq.heappush(self.free, (end, d))
            ends += [end] * len(batch)
        return ends, lengths


def bound_seconds(mode: str, staleness: int, layout: Layout, cost: CostModel, w: Workload) -> float:
    """pub[K] of the module docstring. ``mode``: sync | sync-split | periodic | async."""
    if mode not in ("sync", "sync-split", "periodic", "async"):
        raise ValueError(f"mode must be sync, sync-split, periodic or async, got {mode!r}")
    p = w.prompt_tokens
    s = staleness if mode == "async" else 0
    colocated = mode == "sync"
    n = layout.devices if colocated else 0
    rollout = _Rollout(n or layout.rollout, cost, w)
    rew_dev = _devices(n or layout.reward, 0.0)
    ref_dev = _devices(n or layout.reference, 0.0)
    pub = [0.0]
    for k in range(w.iterations):
        gen_end, lengths = rollout.run(k, pub[max(k - s, 0)], pub)
        if colocated:  # each stage starts when the previous one ended on every device
            gen_end = [max(gen_end)] * len(gen_end)
            rew_dev = _devices(n, gen_end[0])
        rew_end = _stage(
            gen_end, lengths, w.rows_per_reward_batch, lambda ls: cost.reward_s(len(ls)), rew_dev
        )
        ready = rew_end
        if n or layout.reference:
            ref_release = gen_end
            if colocated:
                ref_release = [max(rew_end)] * len(rew_end)
                ref_dev = _devices(n, ref_release[0])
            ref_end = _stage(
                ref_release,
                lengths,
                w.rows_per_reference_batch,
                lambda ls: cost.reference_s(p, ls),
                ref_dev,
            )
            ready = [max(a, b) for a, b in zip(rew_end, ref_end, strict=True)]
        if mode in ("sync", "sync-split"):  # no streaming into training
            ready = [max(ready)] * len(ready)
        t = n or layout.trainer
        start = pub[k] + (cost.sync_s() if k else 0.0)
        trained = _stage(
            ready,
            lengths,
            w.rows_per_trainer_batch,
            lambda ls: cost.train_s(p, ls),
            _devices(t, start),
        )
        pub.append(max(trained) + cost.step_s(t))
        if colocated:  # the next rollout starts after the step (and loads the new version)
            rollout.free = _devices(n, pub[-1])
    return pub[-1]


def micro_batches(w: Workload, reference: bool) -> int:
    """Micro-batches of a run (every stage's claims of work, trainer micro-batches included)."""
    rows = w.rows_per_iteration
    sizes = [
        w.groups_per_rollout_batch * w.group_size,
        w.rows_per_reward_batch,
        w.rows_per_trainer_batch,
    ] + ([w.rows_per_reference_batch] if reference else [])
    return w.iterations * sum(-(-rows // size) for size in sizes)
