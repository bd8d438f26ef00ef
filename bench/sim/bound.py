"""Two schedules of a simulated run from the cost model alone: a lower bound on its time that
no schedule can beat (``bound_seconds``), and a good zero-overhead schedule to read runs against
(``reference_seconds``).

``bound_seconds(mode, staleness, layout, cost, workload)`` is a true lower bound: every term is
work that must happen in sequence or work conserved over a pool of devices, whatever the
micro-batch cuts, the device each one lands on and the order they run in. The engine's
efficiency is ``bound / achieved`` (<= 1 for every run; tested against random schedules).
Per iteration k, with ``pub[v]`` the time version v is announced (pub[0] = 0; the run ends at
pub[K]), L the response lengths of k, P the prompt tokens:

    a_k      = pub[max(k - s, 0)]       admission; nothing of k is generated before it
    load_k   = S if k - s >= 1          the version k - s is announced at a_k: every device that
                                        generates k loads it after a_k (none holds it before)
    gen_k    = prefill*P*|L| + per_seq*sum(L) + base*sum_j M[j*b], M = the groups' longest
               responses sorted descending, b = groups per rollout batch (the least device-time
               of any cut into batches of <= b whole groups: the j-th largest batch maximum is at
               least the (j*b+1)-th largest group maximum)
    rollout ends  >= a_k + load_k + max(gen_k / R, the costliest group)
    reward / reference end >= a_k + load_k + cheapest group + (their work of k) / (W resp. F)
    each pool's last end of iterations <= k >= its work of iterations 0..k / its devices
    training of k starts >= pub[k] + S*[k>0] (the trainer sends version k first)
    pub[k+1] >= max(rollout end + cheapest row through reward|reference and training,
                    reward / reference end + cheapest row's training,
                    training start + max(train_k / T, costliest row)) + A(T)
    sync-split: training of k starts once every row of k is ready (the max of the ends above)
    sync (D colocated devices, stages taking turns): pub[k+1] >= pub[k] + load_k + the sum over
               stages of max(work / D, costliest indivisible piece) + A(D)

Every term only grows with the ones before it, so lower bounds in give a lower bound out. Slower
devices (the balance case's ``slowdown``) only add time: the bound still holds, loosely.

Why the reference schedule is not a bound: it fixes the micro-batches (rows cut in release order
into full ``rows_per_*_batch`` chunks, each released with its LATEST row) and takes jobs greedily
in release order. A run whose claims return what is ready now starts smaller micro-batches
earlier, and greedy list scheduling is not optimal (Graham's anomalies): runs measured
0.976-1.002 of it (docs/performance.md), and random schedules beat it (tests/bench/sim/).

The reference schedule. Notation (costs from ``workers.engines.sim_cost``; micro-batches cut in put order, as the store hands
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engines.sim_cost import CostModel, Workload, iteration_lengths

MODES = ("sync", "sync-split", "periodic", "async")
# iteration k -> its response lengths in put order; default ``sim_cost.iteration_lengths``. A run's
# own (``bench.sim.cluster.run_lengths``) may give each row a length no longer than its own: every
# term of the bound only grows with the lengths, so the bound still holds.
Lengths = Callable[[int], list[int]]


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

    def __init__(self, n: int, cost: CostModel, w: Workload, lengths: Lengths) -> None:
        self.free = _devices(n, 0.0)
        self.loaded = [0] * max(n, 1)
        self.cost, self.w, self.lengths = cost, w, lengths

    def run(self, k: int, release: float, pub: list[float]) -> tuple[list[float], list[int]]:
        """Generate iteration k; returns the end and the length of every row (put order)."""
        lengths = self.lengths(k)
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


def reference_seconds(
    mode: str, staleness: int, layout: Layout, cost: CostModel, w: Workload,
    lengths_of: Lengths | None = None,
) -> float:
    """pub[K] of the reference schedule (module docstring). ``mode``: sync | sync-split |
    periodic | async. One good schedule, not the best: runs can beat it (``bound_seconds``)."""
    _check_mode(mode)
    p = w.prompt_tokens
    s = staleness if mode == "async" else 0
    colocated = mode == "sync"
    n = layout.devices if colocated else 0
    rollout = _Rollout(n or layout.rollout, cost, w,
                       lengths_of or (lambda k: iteration_lengths(w, k)))
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


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be sync, sync-split, periodic or async, got {mode!r}")


def least_generate_s(cost: CostModel, w: Workload, lengths: Sequence[int]) -> float:
    """The least rollout device-time of ``lengths`` (whole groups of ``group_size`` rows in put
    order) over every cut into batches of at most ``groups_per_rollout_batch`` whole groups
    (``gen_k`` of the module docstring)."""
    g = w.group_size
    longest = sorted((max(lengths[i : i + g]) for i in range(0, len(lengths), g)), reverse=True)
    return (cost.prefill_s_per_token * w.prompt_tokens * len(lengths)
            + cost.decode_per_seq_s * sum(lengths)
            + cost.decode_base_s * sum(longest[:: w.groups_per_rollout_batch]))


def bound_seconds(mode: str, staleness: int, layout: Layout, cost: CostModel, w: Workload,
                  lengths_of: Lengths | None = None) -> float:
    """A lower bound on pub[K] for any schedule (module docstring). ``mode`` as ``MODES``."""
    _check_mode(mode)
    p, g = w.prompt_tokens, w.group_size
    s = staleness if mode == "async" else 0
    pub = [0.0]
    done = dict.fromkeys(("rollout", "reward", "reference", "trainer"), 0.0)
    for k in range(w.iterations):
        lengths = lengths_of(k) if lengths_of else iteration_lengths(w, k)
        groups = [lengths[i : i + g] for i in range(0, len(lengths), g)]
        load = cost.sync_s() if k - s >= 1 else 0.0
        work = {
            "rollout": least_generate_s(cost, w, lengths),
            "reward": cost.reward_s(len(lengths)),
            "reference": cost.reference_s(p, lengths),
            "trainer": cost.train_s(p, lengths),
        }
        piece = {  # the costliest piece no cut can split: a group (rollout), a row (the rest)
            "rollout": max(cost.generate_s(p, x) for x in groups),
            "reward": cost.reward_s(1),
            "reference": cost.reference_s(p, [max(lengths)]),
            "trainer": cost.train_s(p, [max(lengths)]),
        }
        if mode == "sync":
            d = layout.devices
            turns = sum(max(work[r] / d, piece[r]) for r in work)
            pub.append(pub[k] + load + turns + cost.step_s(d))
            continue
        a = pub[max(k - s, 0)] + load
        first = a + min(cost.generate_s(p, x) for x in groups)  # the first rows of k exist
        shortest = min(lengths)
        scored = max(cost.reward_s(1), cost.reference_s(p, [shortest]) if layout.reference else 0)
        for r in work:  # a pool does the work of every iteration so far, from time 0
            done[r] += work[r]
        generated = max(a + max(work["rollout"] / layout.rollout, piece["rollout"]),
                        done["rollout"] / layout.rollout)
        ready = [generated + scored, max(first + work["reward"] / layout.reward,
                                         done["reward"] / layout.reward)]
        if layout.reference:
            ready.append(max(first + work["reference"] / layout.reference,
                             done["reference"] / layout.reference))
        start = pub[k] + (cost.sync_s() if k else 0.0)
        train = max(work["trainer"] / layout.trainer, piece["trainer"])
        if mode == "sync-split":  # no row of k is trained before every row of k is ready
            end = max(start, *ready) + train
        else:
            end = max(start + train, *(t + cost.train_s(p, [shortest]) for t in ready))
        pub.append(end + cost.step_s(layout.trainer))
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
