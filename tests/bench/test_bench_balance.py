"""`streamflow bench balance --quick --json`: a tiny on-vs-off run; the JSON's keys and internal
consistency (not its speed: speed targets live in the benchmark's own output)."""

from __future__ import annotations

import json

import pytest

from bench import balance as bench
from streamflow.cli import available_benches


@pytest.mark.slow
def test_quick_run_json_keys_and_consistency(capsys):
    assert "balance" in available_benches()
    assert bench.main(["--quick", "--json", "--consumers", "2"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1  # only the JSON line on stdout
    assert "speedup (on / off)" in captured.err
    report = json.loads(captured.out)
    assert report["bench"] == "balance"
    for key in ("on_rows_per_second", "off_rows_per_second", "speedup", "on_utilisation",
                "off_utilisation"):
        assert key in report
    assert report["speedup"] == pytest.approx(
        report["on_rows_per_second"] / report["off_rows_per_second"], rel=0.01)
    for variant in ("on", "off"):
        (run,) = report[variant]
        assert run["balance"] is (variant == "on")
        consumers = run["consumers"]
        assert set(consumers) == {"c0-slow", "c1-fast"}
        assert sum(c["rows"] for c in consumers.values()) >= run["rows"]  # every row processed
        assert run["rows_per_second"] == pytest.approx(run["rows"] / run["seconds"], rel=0.01)
        for name, c in consumers.items():
            assert 0 <= c["utilisation"] <= 1.05
            assert report[f"{variant}_utilisation"][name] == c["utilisation"]
    assert all(c["rows_stolen"] == 0 for c in report["off"][0]["consumers"].values())
    assert report["off"][0]["reassignments"] == 0  # static: nothing ever moves
