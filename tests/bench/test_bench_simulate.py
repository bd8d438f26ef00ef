"""``streamflow bench simulate --json``: the documented JSON of every case, every efficiency
under its bound (``--small``: every sweep at reduced size), and ``--modes``."""

from __future__ import annotations

import json

import pytest

from streamflow.cli import available_benches, main


@pytest.mark.slow
def test_bench_simulate_modes_filter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "simulate", "--quick", "--json", "--no-plots", "--modes", "sync"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(c["mode"], c["workers"]) for c in result["cases"]] == [("sync", 8)]
    assert "periodic_over_sync" not in result["targets"]  # needs the three equal-sweep modes
    with pytest.raises(SystemExit):
        main(["bench", "simulate", "--modes", "eager"])
    assert "--modes" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_case_of_any_sweep_beats_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """Every case of ``bench simulate`` (every sweep, every mode) at reduced size: the achieved
    time is never below the lower bound, and the reference schedule is reported beside it. A
    high time scale shortens every case (the real overheads then weigh more, which only lowers
    efficiency): the bound must hold all the same. The skew sweep runs its skews in one mode
    (its cases differ from the scaling sweep's by the workload alone), to keep the test short."""
    assert "simulate" in available_benches()
    assert "_simulate_plots" not in available_benches()
    common = ["bench", "simulate", "--small", "--time-scale", "400", "--json", "--no-plots"]
    assert main([*common, "--sweeps", "scaling", "control", "equal", "balance"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*common, "--sweeps", "skew", "--modes", "periodic"]) == 0
    skew = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(c["sweep"], c["mode"]) for c in skew["cases"]] == [("skew", "periodic")] * 2
    cases = result["cases"] + skew["cases"]
    assert {c["sweep"] for c in cases} == {"scaling", "control", "skew", "equal", "balance"}
    assert {c["label"] for c in cases} >= {"sync", "sync-split", "periodic", "async(s=1)",
                                           "async(s=2)"}
    scaling = {(c["mode"], c["staleness"]) for c in cases if c["sweep"] == "scaling"}
    assert scaling == {("sync", 0), ("periodic", 0), ("async", 1), ("async", 2)}
    for c in cases:
        assert 0 < c["efficiency"] <= 1.0, c
        assert c["bound_seconds"] <= c["sim_seconds"]
        assert c["bound_seconds"] <= c["reference_seconds"]  # a schedule: never below the bound
        assert c["reference_ratio"] == pytest.approx(c["reference_seconds"] / c["sim_seconds"])
        # the documented JSON of every case
        assert {"mode", "workers", "throughput", "bound", "efficiency"} <= set(c)
        assert c["throughput"] > 0 and c["bound"] > 0
        assert c["efficiency"] == pytest.approx(c["throughput"] / c["bound"])
        assert c["controller_cpu_ms_per_micro_batch"] >= 0
        assert set(c["utilisation"]) >= {"rollout", "trainer"}
    assert all(c["workers"] == 8 for c in cases if c["sweep"] in ("scaling", "skew"))
    assert result["targets"]["min_efficiency_up_to_64"] == min(
        c["efficiency"] for c in result["cases"] if c["sweep"] != "balance")


def test_bench_simulate_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        main(["bench", "simulate", "--workers", "2"])
    assert exit_info.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_sync_split_is_the_real_periodic_mode_with_whole_iterations(tmp_path) -> None:
    from bench.sim.bound import Layout
    from bench.sim.cluster import SimConfig, run_config
    from bench.simulate import MODE_NAMES, MODES
    from workers.engines.sim_cost import Workload

    assert "sync-split" in MODE_NAMES  # a --modes choice, run in the equal sweep only
    assert "sync-split" not in {m for m, _ in MODES}  # not in the scaling and skew sweeps
    lay, w = Layout(rollout=2, reward=1, reference=1, trainer=2), Workload(iterations=1)
    split = run_config(SimConfig(mode="sync-split", layout=lay, workload=w), tmp_path)
    assert (split.run.mode, split.trainer.whole_iterations) == ("periodic", True)
    periodic = run_config(SimConfig(mode="periodic", layout=lay, workload=w), tmp_path)
    assert (periodic.run.mode, periodic.trainer.whole_iterations) == ("periodic", False)


def _row(label: str, sweep: str, workers: int, eff: float, thr: float, bound: float) -> dict:
    mode = label.split("(")[0]
    return {
        "label": label,
        "mode": mode,
        "sweep": sweep,
        "workers": workers,
        "skew": 1.0,
        "efficiency": eff,
        "throughput": thr,
        "bound": bound,
    }


def test_targets_cover_every_bounded_sweep_and_name_the_worst_case() -> None:
    from bench.simulate import targets

    rows = [
        _row("sync", "scaling", 64, 0.95, 1.0, 1.0),
        _row("sync", "skew", 64, 0.91, 1.0, 1.0),  # outside the scaling sweep: still counted
        # the balance sweep's bound is not meaningful: ignored
        {
            **_row("periodic", "balance", 30, 0.50, 1.0, 1.0),
            "balancer": True,
            "reference_spread": 0.07,
        },
        _row("sync", "scaling", 256, 0.85, 1.0, 1.0),
        {**_row("sync", "equal", 26, 0.93, 60.0, 64.0), "reference_seconds": 10.0},
        {**_row("sync-split", "equal", 26, 0.98, 30.0, 31.0), "reference_seconds": 20.0},
        {**_row("periodic", "equal", 26, 0.99, 57.0, 58.0), "reference_seconds": 8.0},
    ]
    out = targets(rows)
    assert out["min_efficiency_up_to_64"] == 0.91
    assert out["min_efficiency_at_256"] == 0.85
    assert out["min_efficiency_cases"]["up_to_64"] == "sync skew n=64 skew=1"
    assert out["periodic_over_sync"] == pytest.approx(57 / 60)
    assert out["periodic_over_sync_split"] == pytest.approx(57 / 30)
    assert out["periodic_over_sync_bound"] == pytest.approx(58 / 64)
    assert out["periodic_over_sync_split_bound"] == pytest.approx(58 / 31)
    assert out["periodic_over_sync_reference"] == pytest.approx(10 / 8)  # seconds: sync / periodic
    assert out["periodic_over_sync_split_reference"] == pytest.approx(20 / 8)
    assert out["reference_utilisation_spread"] == {True: 0.07}


def test_balance_case_makes_reference_the_bottleneck_at_its_own_time_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The balance case must load the reference stage more than the trainer (else its consumers
    have no backlog to balance: the old 16/2/4/8 layout left the trainer as the bottleneck), and
    it runs at ``BALANCE_TIME_SCALE`` unless ``--time-scale`` says otherwise."""
    import argparse

    from bench import simulate
    from workers.engines.sim_cost import Workload, preset

    seen = []

    class Stop(Exception):
        pass

    def fake_run_sim(cfg):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(simulate, "run_sim", fake_run_sim)
    for time_scale, want in ((None, simulate.BALANCE_TIME_SCALE), (7.0, 7.0)):
        args = argparse.Namespace(time_scale=time_scale, hosts=2)
        with pytest.raises(Stop):
            simulate.balance_case(args, True, Workload(iterations=2))
        assert seen[-1].time_scale == want
    with pytest.raises(Stop):  # the other sweeps keep the automatic scale
        simulate.case("periodic", 0, 64, Workload(), argparse.Namespace(time_scale=None, hosts=2))
    assert seen[-1].time_scale == simulate.auto_time_scale(64)

    cfg = seen[0]
    cost = preset("7b-1acc")
    # Device-seconds per token of each stage's capacity (both scale with the same token count).
    reference = sum(1 / cfg.slowdown.get(f"reference-{i}", 1.0) for i in range(4))
    assert cfg.layout.reference == 4 and cfg.slowdown == {"reference-0": 3.0}
    reference_rate = reference / cost.ref_s_per_token
    trainer_rate = cfg.layout.trainer / cost.train_s_per_token
    assert trainer_rate > 1.5 * reference_rate
