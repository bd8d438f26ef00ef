"""The simulated cluster (bench.sim): the reference schedule (hand-computed), the run's config checks,
and tiny simulated runs of every mode through the real controller, store node and worker code
(streaming workers as threads of ``SimCluster`` host processes)."""

from __future__ import annotations

import psutil
import pytest

from bench.sim.bound import Layout, list_schedule, reference_seconds
from bench.sim.cluster import SimConfig, run_config, run_lengths, run_sim
from bench.sim.simcluster import SimCluster
from workers.engines.sim_cost import CostModel, Workload

# Round numbers so that the bounds below can be computed by hand.
TOY = CostModel(
    name="toy",
    params=1.0,
    prefill_s_per_token=0.0,
    decode_base_s=1.0,
    decode_per_seq_s=0.0,
    reward_s_per_sample=0.0,
    ref_s_per_token=0.0,
    train_s_per_token=0.5,
    optimizer_s=0.0,
    allreduce_bandwidth=1e30,
    sync_bandwidth=1e30,
    sync_latency_s=2.0,
)
TOY_WORK = Workload(
    prompts_per_iteration=2,
    group_size=1,
    prompt_tokens=1,
    median_response_tokens=10,
    skew=0.0,
    groups_per_rollout_batch=1,
    rows_per_reward_batch=1,
    rows_per_reference_batch=1,
    rows_per_trainer_batch=1,
    iterations=2,
)


def test_list_schedule_by_hand() -> None:
    assert list_schedule([3, 3, 2, 2, 2], 2) == 7  # d0: 3+2+2, d1: 3+2
    assert list_schedule([5, 1, 1], 3) == 5
    assert list_schedule([], 4) == 0


def test_reference_schedules_by_hand() -> None:
    split = Layout(rollout=1, reward=1, trainer=1)
    # periodic: it 0 generates at 0-10, 10-20; trains 10-15.5, 20-25.5 -> version 1 at 25.5.
    # it 1 admitted at 25.5, the rollout loads version 1 (2 s): 27.5-37.5, 37.5-47.5; the
    # trainer (free at 25.5 + 2 after sending the version) trains 37.5-43, 47.5-53.
    assert reference_seconds("periodic", 0, split, TOY, TOY_WORK) == pytest.approx(53.0)
    # async s=1: it 1 is admitted at 0, generated 20-30 with version 0, then the device loads
    # version 1 (published 25.5) before its next batch: 32-42; training ends 42 + 5.5.
    assert reference_seconds("async", 1, split, TOY, TOY_WORK) == pytest.approx(47.5)
    # separate pools taking turns: training of k starts once all of k is generated.
    assert reference_seconds("sync-split", 0, split, TOY, TOY_WORK) == pytest.approx(64.0)
    # colocated on 2 devices: gen 0-10 (both), train 10-15.5 (both); load 2, gen 17.5-27.5,
    # train 27.5-33.
    assert reference_seconds("sync", 0, Layout(devices=2), TOY, TOY_WORK) == pytest.approx(33.0)
    with pytest.raises(ValueError, match="mode"):
        reference_seconds("eager", 0, split, TOY, TOY_WORK)


def test_sim_config_rejects_bad_input() -> None:
    w = Workload()
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="eager", layout=Layout(devices=1), workload=w)
    with pytest.raises(ValueError, match="staleness"):
        SimConfig(mode="async", layout=Layout(1, 1, 0, 1), workload=w, staleness=0)
    with pytest.raises(ValueError, match="sync needs"):
        SimConfig(mode="sync", layout=Layout(1, 1, 0, 1), workload=w)
    with pytest.raises(ValueError, match="7b-2acc"):
        SimConfig(mode="sync", layout=Layout(devices=1), workload=w, cost="7b-2acc")


def test_run_config_maps_the_layout_onto_the_real_keys(tmp_path) -> None:
    w = Workload(prompts_per_iteration=16, group_size=4, groups_per_rollout_batch=2,
                 rows_per_reward_batch=8, rows_per_reference_batch=8, rows_per_trainer_batch=8,
                 median_response_tokens=50, skew=0.5, max_response_tokens=300)
    lay = Layout(rollout=3, reward=2, reference=4, trainer=5)
    cfg = run_config(SimConfig(mode="async", staleness=2, layout=lay, workload=w, shards=4,
                               balancer=True, time_scale=7.0), tmp_path)
    assert (cfg.run.mode, cfg.max_staleness, cfg.run.iterations) == ("async", 2, w.iterations)
    assert (cfg.rollout.engine, cfg.trainer.engine) == ("simulated", "simulated")
    assert (cfg.rollout.num_workers, cfg.reward.num_workers, cfg.reference.num_workers,
            cfg.trainer.num_ranks) == (3, 2, 4, 5)
    assert cfg.reference_worker and cfg.simulated.devices == 1
    assert (cfg.rollout.groups_per_claim, cfg.reward.rows_per_claim,
            cfg.reference.rows_per_claim, cfg.trainer.rows_per_claim) == (2, 8, 8, 8)
    assert (cfg.simulated.median_response_tokens, cfg.simulated.skew,
            cfg.simulated.time_scale, cfg.rollout.max_new_tokens) == (50, 0.5, 7.0, 300)
    assert (cfg.store.num_shards, cfg.store.balancer) == (4, True)
    no_ref = run_config(SimConfig(mode="periodic", layout=Layout(1, 1, 0, 1), workload=w),
                        tmp_path)
    assert not no_ref.kl_active and no_ref.store.balancer is False
    sync = run_config(SimConfig(mode="sync", layout=Layout(devices=6), workload=w), tmp_path)
    assert (sync.simulated.devices, sync.trainer.num_ranks, sync.rollout.num_workers) == (6, 6, 1)
    # one claim per stage feeds every colocated device a micro-batch
    assert (sync.rollout.groups_per_claim, sync.trainer.rows_per_claim) == (12, 48)


def test_run_lengths_are_the_simulated_rollouts_draws() -> None:
    """On-policy, the bound's lengths are exactly what the simulated rollout engine draws for
    each group's seed; with staleness s, never longer than any of the versions it may use."""
    from workers.config import SimulatedDevice
    from workers.engines.base import SamplingParams
    from workers.engines.simulated import SimulatedRolloutEngine
    from workers.roles.rollout import sampling_seed

    w = Workload(prompts_per_iteration=3, group_size=4, median_response_tokens=40,
                 max_response_tokens=100, seed=5)
    engine = SimulatedRolloutEngine(SimulatedDevice(median_response_tokens=40, skew=1.0,
                                                    time_scale=1e9), vocab_size=10)

    def drawn(k: int, version: int) -> list[int]:
        seeds = tuple(sampling_seed(5, g, version) for g in range(3 * k, 3 * k + 3))
        return engine.lengths(3, 4, SamplingParams(max_new_tokens=100, prompt_seeds=seeds))

    assert run_lengths(w, 0)(2) == drawn(2, 2)
    stale = run_lengths(w, 1)(2)
    assert stale == [min(a, b) for a, b in zip(drawn(2, 1), drawn(2, 2), strict=True)]
    assert stale != drawn(2, 2)  # another version's draws do lower some rows


TINY = Workload(
    prompts_per_iteration=16,
    groups_per_rollout_batch=4,
    rows_per_reward_batch=32,
    rows_per_reference_batch=32,
    rows_per_trainer_batch=32,
    iterations=2,
    skew=1.0,
)


def _spans(holds: list, role: str, k: int, kind: str = "compute") -> tuple[float, float, int]:
    sel = [h for h in holds if h[1] == role and h[5] == k and h[2] == kind]
    return min(h[3] for h in sel), max(h[4] for h in sel), sum(h[6] for h in sel)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,staleness,layout",
    [
        ("sync", 0, Layout(devices=4)),
        ("periodic", 0, Layout(rollout=2, reward=1, reference=1, trainer=2)),
        ("sync-split", 0, Layout(rollout=2, reward=1, reference=1, trainer=2)),
        ("async", 1, Layout(rollout=2, reward=1, reference=1, trainer=2)),
    ],
)
def test_tiny_simulated_run_through_real_sockets(mode: str, staleness: int, layout: Layout) -> None:
    r = run_sim(
        SimConfig(
            mode=mode,
            staleness=staleness,
            layout=layout,
            workload=TINY,
            time_scale=200.0,
            timeout_s=60.0,
        )
    )
    rows = TINY.rows_per_iteration
    assert r.samples == 2 * rows
    assert 0 < r.efficiency <= 1.0  # against a true lower bound (bench.sim.bound)
    assert r.throughput == pytest.approx(r.samples / r.sim_seconds)
    for k in range(2):  # every row went through every stage exactly once per iteration
        for role in ("rollout", "reward", "reference", "trainer"):
            assert _spans(r.holds, role, k)[2] == rows, (role, k)
    if mode == "sync":  # stages take turns: no two stages of an iteration overlap
        for k in range(2):
            ends = [
                _spans(r.holds, role, k) for role in ("rollout", "reward", "reference", "trainer")
            ]
            for (_, end, _), (start, _, _) in zip(ends, ends[1:], strict=False):
                assert end <= start + 1e-6
    if mode == "sync-split":  # separate pools taking turns: no row of k trained before all of k
        for k in range(2):  # is ready, and generation of k+1 waits for the step of k
            ready = max(_spans(r.holds, role, k)[1] for role in ("reward", "reference"))
            assert ready <= _spans(r.holds, "trainer", k)[0] + 1e-6
        assert _spans(r.holds, "trainer", 0)[1] <= _spans(r.holds, "rollout", 1)[0] + 1e-6
    if mode in ("periodic", "sync-split"):  # generation of k+1 never overlaps training of k
        assert _spans(r.holds, "trainer", 0)[1] <= _spans(r.holds, "rollout", 1)[0] + 1e-6
    if mode == "async":  # rollout runs ahead: generation of 1 starts before training of 0 ends
        assert _spans(r.holds, "rollout", 1)[0] < _spans(r.holds, "trainer", 0)[1]


@pytest.mark.slow
def test_sim_hosts_run_the_workers_as_threads_of_a_few_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run on a layout of 7 workers: 2 stage hosts and the trainer's own, each worker a thread."""
    import time

    w = TINY.replace(iterations=1)
    lay = Layout(rollout=3, reward=1, reference=2, trainer=2)
    seen: list = []
    real = SimCluster.start_workers

    def spy(self, workers, events_address):  # noqa: ANN001, ANN202
        real(self, workers, events_address)
        seen.append({name: self.host_of[name] for name, *_ in workers})
        seen.append([(c.name, c.popen.pid) for c in self.children.values()])

    monkeypatch.setattr(SimCluster, "start_workers", spy)
    r = run_sim(SimConfig(mode="periodic", layout=lay, workload=w, time_scale=200.0, hosts=2,
                          timeout_s=60.0))
    hosts, children = seen
    assert sorted(set(hosts.values())) == ["sim-host-0", "sim-host-1", "sim-host-2"]
    assert hosts["trainer-0"] == "sim-host-0"
    assert sorted(h for n, h in hosts.items() if n != "trainer-0").count("sim-host-1") == 3
    assert {n.split("-")[0] for n in hosts} == {"rollout", "reward", "reference", "trainer"}
    assert len(hosts) == 7 and r.samples == w.rows_per_iteration
    for _, pid in children:  # every process of the run ended with it
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
            assert time.monotonic() < deadline, pid
            time.sleep(0.05)
