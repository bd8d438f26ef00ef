"""``streamflow bench simulate --quick --json``: the documented JSON, every efficiency sane."""

from __future__ import annotations

import json

import pytest

from streamflow.cli import available_benches, main


@pytest.mark.slow
def test_bench_simulate_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert "simulate" in available_benches()
    assert "_simulate_plots" not in available_benches()
    assert main(["bench", "simulate", "--quick", "--json", "--no-plots"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cases = result["cases"]
    assert {(c["mode"], c["staleness"]) for c in cases} == {
        ("sync", 0),
        ("periodic", 0),
        ("async", 1),
        ("async", 2),
    }
    for c in cases:
        assert {"mode", "workers", "throughput", "bound", "efficiency"} <= set(c)
        assert c["workers"] == 8
        assert 0 < c["efficiency"] <= 1.05
        assert c["throughput"] > 0 and c["bound"] > 0
        assert c["efficiency"] == pytest.approx(c["throughput"] / c["bound"])
        assert c["controller_cpu_ms_per_micro_batch"] >= 0
        assert set(c["utilisation"]) >= {"rollout", "trainer"}
    assert result["targets"]["min_efficiency_up_to_64"] == min(c["efficiency"] for c in cases)


def test_bench_simulate_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        main(["bench", "simulate", "--workers", "2"])
    assert exit_info.value.code == 2
    assert "--workers" in capsys.readouterr().err
