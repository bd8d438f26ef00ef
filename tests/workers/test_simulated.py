"""The simulated devices: the cost model, the bound formulas (hand-computed), and tiny simulated
runs of every mode through a real store node process and real host processes."""

from __future__ import annotations

import dataclasses

import pytest

from streamflow.admission import admissible, min_policy_version
from bench.sim.cluster import SimConfig, run_sim
from bench.sim.bound import Layout, bound_seconds, list_schedule
from workers.engines.sim_cost import CostModel, Workload, group_lengths, iteration_lengths, preset

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


def test_cost_formulas_by_hand() -> None:
    c = dataclasses.replace(
        TOY,
        prefill_s_per_token=0.01,
        decode_per_seq_s=0.1,
        optimizer_s=4.0,
        allreduce_bandwidth=1.0,
        ref_s_per_token=0.2,
        reward_s_per_sample=3.0,
    )
    # prefill 0.01 * 10 * 2 + longest 5 * 1.0 + all tokens 8 * 0.1
    assert c.generate_s(10, [3, 5]) == pytest.approx(0.2 + 5.0 + 0.8)
    assert c.train_s(10, [3, 5]) == pytest.approx(0.5 * 28)
    assert c.reference_s(10, [3, 5]) == pytest.approx(0.2 * 28)
    assert c.reward_s(4) == pytest.approx(12.0)
    assert c.allreduce_s(1) == 0.0
    assert c.allreduce_s(4) == pytest.approx(2 * 3 / 4 * 2.0 / 1.0)  # 2 bytes per parameter
    assert c.step_s(4) == pytest.approx(3.0 + 4.0 / 4)
    assert c.sync_s() == pytest.approx(2.0)


def test_preset_7b_matches_its_sources() -> None:
    c = preset("7b-1acc")
    # A full batch of 256 sequences decodes at ~12.5 k tokens/s on one H100 (the cited figure).
    assert 256 / (c.decode_base_s + 256 * c.decode_per_seq_s) == pytest.approx(12_500, rel=1e-6)
    assert c.train_s_per_token == pytest.approx(6 * 7.6e9 / (0.4 * 989e12))
    assert c.sync_s() == pytest.approx(15.2e9 / 50e9 + 1.0)
    with pytest.raises(ValueError, match="unknown cost preset"):
        preset("70b")


def test_lengths_are_bounded_deterministic_and_skewed() -> None:
    w = Workload(median_response_tokens=600, max_response_tokens=4096)
    for skew in (0.5, 1.5, 3.0):
        ws = w.replace(skew=skew)
        lengths = iteration_lengths(ws, 0)
        assert len(lengths) == ws.rows_per_iteration
        assert all(1 <= n <= 4096 and isinstance(n, int) for n in lengths)
        assert lengths == iteration_lengths(ws, 0)  # a pure function of (seed, group, index)
    assert set(group_lengths(w.replace(skew=0.0), 5)) == {600}
    spread = {s: max(iteration_lengths(w.replace(skew=s), 0)) for s in (0.25, 1.5)}
    assert spread[1.5] > spread[0.25]  # a larger skew, a longer tail
    with pytest.raises(ValueError, match="rows_per_trainer_batch"):
        Workload(group_size=8, rows_per_trainer_batch=12)
    with pytest.raises(ValueError, match="skew"):
        Workload(skew=-1)


def test_list_schedule_by_hand() -> None:
    assert list_schedule([3, 3, 2, 2, 2], 2) == 7  # d0: 3+2+2, d1: 3+2
    assert list_schedule([5, 1, 1], 3) == 5
    assert list_schedule([], 4) == 0


def test_bounds_by_hand() -> None:
    split = Layout(rollout=1, reward=1, trainer=1)
    # periodic: it 0 generates at 0-10, 10-20; trains 10-15.5, 20-25.5 -> version 1 at 25.5.
    # it 1 admitted at 25.5, the rollout loads version 1 (2 s): 27.5-37.5, 37.5-47.5; the
    # trainer (free at 25.5 + 2 after sending the version) trains 37.5-43, 47.5-53.
    assert bound_seconds("periodic", 0, split, TOY, TOY_WORK) == pytest.approx(53.0)
    # async s=1: it 1 is admitted at 0, generated 20-30 with version 0, then the device loads
    # version 1 (published 25.5) before its next batch: 32-42; training ends 42 + 5.5.
    assert bound_seconds("async", 1, split, TOY, TOY_WORK) == pytest.approx(47.5)
    # separate pools taking turns: training of k starts once all of k is generated.
    assert bound_seconds("sync-split", 0, split, TOY, TOY_WORK) == pytest.approx(64.0)
    # colocated on 2 devices: gen 0-10 (both), train 10-15.5 (both); load 2, gen 17.5-27.5,
    # train 27.5-33.
    assert bound_seconds("sync", 0, Layout(devices=2), TOY, TOY_WORK) == pytest.approx(33.0)
    with pytest.raises(ValueError, match="mode"):
        bound_seconds("eager", 0, split, TOY, TOY_WORK)


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
    assert 0 < r.efficiency <= 1.05
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


def test_admission_rule() -> None:
    # min_policy_version = k - s (never negative); k is admitted once version >= k - s.
    assert [min_policy_version(k, 0) for k in range(3)] == [0, 1, 2]
    assert [min_policy_version(k, 2) for k in range(4)] == [0, 0, 0, 1]
    assert admissible(3, 0, 3) and not admissible(3, 0, 2)  # periodic: version k exists
    assert admissible(3, 1, 2) and not admissible(3, 1, 1)  # async s=1: one version ahead
    assert admissible(0, 0, 0)
