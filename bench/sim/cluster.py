"""A simulated cluster run: the real controller and workers over the ``simulated`` engine.

``run_sim(SimConfig)`` turns a layout and a workload into a ``RunConfig`` with every engine
``simulated`` (workers/engines/simulated.py, priced by ``workers.engines.sim_cost``) and runs it
with the real ``streamflow.controller.Controller``: its admission rule, its puts, the trainer's
version announcements, the real store node and shard coordinator. Streaming modes run their
workers in ``bench.sim.simcluster.SimCluster`` (threads of a few host processes: many workers on
2 cores); ``sync`` runs the controller's own ``ColocatedLoop`` with ``simulated.devices`` =
``layout.devices`` colocated devices (and as many trainer devices).

It returns a ``SimResult``: achieved throughput in samples per *simulated* second, the lower
bound of ``bench.sim.bound`` computed from the run's own workload (``run_lengths``: the lengths
the simulated rollout draws, the shortest tokenised prompt), efficiency = bound / achieved (<= 1),
the reference schedule's time, utilisation per role and per worker, the spans (for timelines) and
the CPU seconds of the controller, the coordinator, the store node and the host processes during
the loop.

Clock: the controller's loop clock, from the moment every worker is ready (before the first put)
to the end of the last optimizer step (its publication included), in real seconds times
``time_scale``. Everything that is not a device hold (claims, writes, acks, admission, reports,
thread wake-ups, this machine's load) counts against the engine, amplified by ``time_scale``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.sim.bound import Layout, Lengths, bound_seconds, reference_seconds
from bench.sim.simcluster import SimCluster
from streamflow.config import RunConfig, load_config
from workers.engines.sim_cost import Workload, drawn_lengths, preset
from workers.roles.rollout import sampling_seed

ROLES = ("rollout", "reward", "reference", "trainer")


@dataclass
class SimConfig:
    # sync | sync-split | periodic | async; sync-split = periodic whose trainer waits for whole
    # iterations (trainer.whole_iterations): separate pools taking turns
    mode: str
    layout: Layout
    workload: Workload
    staleness: int = 0  # async only (periodic and sync are 0 by definition)
    cost: str = "7b-1acc"
    time_scale: float = 50.0  # simulated seconds per real second
    hosts: int = 2  # stage host processes (streaming modes; the trainer has one more)
    shards: int = 1
    balancer: bool = False  # the shard coordinator (store.balancer; needs >= 2 shards)
    rebalance: bool = True  # with balancer: False = the first shard ownership stays
    slowdown: dict[str, float] = field(default_factory=dict)  # worker name -> cost factor
    timeout_s: float = 300.0  # the run fails when no worker reports for this long
    partial: bool = False  # rollout.partial (async only): cut generations at each publication
    overrides: tuple[str, ...] = ()  # further ``key=value`` config overrides, applied last

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "sync-split", "periodic", "async"):
            raise ValueError("SimConfig.mode must be sync, sync-split, periodic or async, got "
                             f"{self.mode!r}")
        if self.mode != "async":
            self.staleness = 0
        elif self.staleness < 1:
            raise ValueError("SimConfig.staleness must be >= 1 in async mode")
        if self.partial and self.mode != "async":
            raise ValueError("SimConfig.partial needs mode async")
        lay = self.layout
        if self.mode == "sync" and lay.devices < 1:
            raise ValueError("sync needs layout.devices >= 1 (colocated devices)")
        if self.mode != "sync" and min(lay.rollout, lay.reward, lay.trainer) < 1:
            raise ValueError(f"{self.mode} needs >= 1 rollout, reward and trainer device")
        preset(self.cost)


@dataclass
class SimResult:
    mode: str
    staleness: int
    workers: int
    layout: dict[str, int]
    samples: int
    wall_real_s: float
    sim_seconds: float
    throughput: float  # samples per simulated second
    bound_seconds: float  # a lower bound on the time: no schedule beats it (bench.sim.bound)
    bound_throughput: float
    efficiency: float  # bound / achieved time: <= 1
    reference_seconds: float  # the zero-overhead greedy schedule (not a bound: runs can beat it)
    utilisation: dict[str, float]  # role -> mean busy fraction of its workers
    device_utilisation: dict[str, float]  # worker -> busy fraction
    micro_batches: int  # stage micro-batches of the run (spans with rows)
    controller_cpu_s: float
    coordinator_cpu_s: float
    store_cpu_s: float
    hosts_cpu_s: float
    time_scale: float
    # [worker, role, kind ("compute" | "step"), start, end, iteration, rows], sim s from the start
    holds: list[list[Any]] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return f"async(s={self.staleness})" if self.mode == "async" else self.mode


def run_config(cfg: SimConfig, out: Path) -> RunConfig:
    """The ``streamflow run`` config of a simulated case (every engine ``simulated``)."""
    w, lay, sync = cfg.workload, cfg.layout, cfg.mode == "sync"
    # sync: one claim per stage feeds all d colocated devices a micro-batch each
    d = lay.devices if sync else 1
    reference = sync or lay.reference > 0
    return load_config(None, [
        "run.name=sim", f"run.output_dir={out}",
        f"run.mode={'periodic' if cfg.mode == 'sync-split' else cfg.mode}",
        f"trainer.whole_iterations={str(cfg.mode == 'sync-split').lower()}",
        f"run.iterations={w.iterations}", f"run.max_staleness={max(cfg.staleness, 1)}",
        f"run.seed={w.seed}", "run.eval_every=0", "run.progress=false", "run.max_restarts=0",
        "run.plots=false",  # the run directory is deleted once read
        f"run.stall_timeout_s={cfg.timeout_s}", f"run.startup_timeout_s={cfg.timeout_s}",
        "run.log_level=WARNING", "model.warmstart_steps=0",
        f"data.prompts_per_iteration={w.prompts_per_iteration}",
        f"data.group_size={w.group_size}", f"data.seed={w.seed}",
        "rollout.engine=simulated", f"rollout.num_workers={1 if sync else lay.rollout}",
        f"rollout.groups_per_claim={d * w.groups_per_rollout_batch}",
        f"rollout.max_new_tokens={w.max_response_tokens}",
        f"reward.num_workers={1 if sync else lay.reward}",
        f"reward.rows_per_claim={d * w.rows_per_reward_batch}",
        f"trainer.kl_coef={0.01 if reference else 0.0}",
        *([f"reference.num_workers={1 if sync else lay.reference}",
           f"reference.rows_per_claim={d * w.rows_per_reference_batch}"] if reference else []),
        "trainer.engine=simulated", f"trainer.num_ranks={d if sync else lay.trainer}",
        f"trainer.rows_per_claim={d * w.rows_per_trainer_batch}",
        f"simulated.cost={cfg.cost}", f"simulated.time_scale={cfg.time_scale}",
        f"simulated.median_response_tokens={w.median_response_tokens}",
        f"simulated.skew={w.skew}", f"simulated.devices={d}",
        f"simulated.tail_fraction={w.tail_fraction}", f"simulated.tail_factor={w.tail_factor}",
        *(["rollout.partial=true"] if cfg.partial else []),
        f"store.num_shards={cfg.shards}", f"store.balancer={str(cfg.balancer).lower()}",
        "metrics.enabled=false", *cfg.overrides,
    ])


def run_lengths(w: Workload, staleness: int) -> Lengths:
    """Iteration k's response lengths, as short as the run's can be: the simulated rollout draws
    group g's lengths from ``sampling_seed(seed, g, v)`` with the version v it generates with,
    some v in [k - s, k]; each row gets the least of its draws over those versions. Every term
    of the bound only grows with the lengths, so the bound of these holds for the run."""

    def lengths(k: int) -> list[int]:
        p, g = w.prompts_per_iteration, w.group_size
        out: list[int] = []
        for group in range(k * p, (k + 1) * p):
            draws = [drawn_lengths(sampling_seed(w.seed, group, v), g, w.median_response_tokens,
                                   w.skew, w.max_response_tokens, w.tail_fraction, w.tail_factor)
                     for v in range(max(k - staleness, 0), k + 1)]
            out += [min(d[i] for d in draws) for i in range(g)]
        return out

    return lengths


def run_sim(cfg: SimConfig) -> SimResult:
    from streamflow.controller import Controller

    tmp = Path(tempfile.mkdtemp(prefix="sf-sim-"))
    clusters: list[SimCluster] = []

    def make_cluster(run_cfg: RunConfig, plan: Any) -> SimCluster:
        clusters.append(SimCluster(run_cfg, plan, hosts=cfg.hosts, slowdown=cfg.slowdown,
                                   rebalance=cfg.rebalance))
        return clusters[0]

    try:
        controller = Controller(run_config(cfg, tmp / "run"), make_cluster)
        cpu0 = time.thread_time()
        summary = controller.run()
        cpu = time.thread_time() - cpu0
        if summary.status != "ok":
            raise RuntimeError(f"simulated run {summary.status}: {summary.error}")
        plan, st = controller.plan, controller.state
        prompt = min(len(plan.encode(p.prompt)) for k in range(cfg.workload.iterations)
                     for p in plan.problems(k))
        spans = controller.rundir.read_spans()
        end = st.loop_ended or st.loop_started
        usage = clusters[0].usage if clusters else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    w = cfg.workload.replace(prompt_tokens=prompt)
    cpus = (usage.controller_s, usage.coordinator_s, usage.store_s, usage.hosts_s) if usage else (
        cpu, 0.0, 0.0, 0.0)
    return _result(cfg, w, st.loop_started, end, spans, cpus)


def _result(cfg: SimConfig, w: Workload, t0: float, t_end: float, spans: list[Any],
            cpus: tuple[float, float, float, float]) -> SimResult:
    lay, scale = cfg.layout, cfg.time_scale
    wall = max(t_end - t0, 1e-9)
    sim = wall * scale
    samples = w.iterations * w.rows_per_iteration
    cost = preset(cfg.cost)
    lengths = run_lengths(w, cfg.staleness)
    bound = bound_seconds(cfg.mode, cfg.staleness, lay, cost, w, lengths)
    busy: dict[str, float] = {}
    role_of: dict[str, str] = {}
    holds = []
    for s in spans:
        a, b = max(s.start, t0), min(s.end, t_end)
        busy[s.worker] = busy.get(s.worker, 0.0) + max(b - a, 0.0)
        role_of[s.worker] = s.stage
        kind = "step" if s.stage == "trainer" and not s.rows else "compute"
        holds.append([s.worker, s.stage, kind, (s.start - t0) * scale, (s.end - t0) * scale,
                      s.iteration, s.rows])
    util = {r: sum(busy[x] for x in busy if role_of[x] == r) / wall
            / max(sum(1 for x in busy if role_of[x] == r), 1) for r in ROLES
            if r in role_of.values()}
    controller, coordinator, store, hosts = cpus
    return SimResult(
        mode=cfg.mode, staleness=cfg.staleness, workers=lay.workers,
        layout=dataclasses.asdict(lay), samples=samples, wall_real_s=wall, sim_seconds=sim,
        throughput=samples / sim, bound_seconds=bound, bound_throughput=samples / bound,
        efficiency=bound / sim,
        reference_seconds=reference_seconds(cfg.mode, cfg.staleness, lay, cost, w, lengths),
        utilisation=util, device_utilisation={x: b / wall for x, b in sorted(busy.items())},
        micro_batches=max(sum(1 for s in spans if s.rows), 1), controller_cpu_s=controller,
        coordinator_cpu_s=coordinator, store_cpu_s=store, hosts_cpu_s=hosts, time_scale=scale,
        holds=holds,
    )
