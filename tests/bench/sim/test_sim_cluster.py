"""The simulated cluster (bench.sim): the reference schedule (hand-computed), the run's config checks,
and tiny simulated runs of every mode through a real store node process and real host processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.sim.bound import Layout, list_schedule, reference_seconds
from bench.sim.cluster import SimConfig, run_sim
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
    with pytest.raises(ValueError, match="turns"):
        SimConfig(mode="async", layout=Layout(1, 1, 0, 1), workload=w, staleness=1, turns=True)


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
    if mode == "periodic":  # generation of k+1 never overlaps training of k
        assert _spans(r.holds, "trainer", 0)[1] <= _spans(r.holds, "rollout", 1)[0] + 1e-6
    if mode == "async":  # rollout runs ahead: generation of 1 starts before training of 0 ends
        assert _spans(r.holds, "rollout", 1)[0] < _spans(r.holds, "trainer", 0)[1]


def test_host_process_imports_no_torch() -> None:
    # A host runs 100+ device threads per process: the loop, the store client and the cost
    # model must stay light.
    code = "import sys, bench.sim.host; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
