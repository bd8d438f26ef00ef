"""`streamflow bench gateway --json` at a small size: the JSON's keys, every call checked with
no token mismatch, and consistent counts (speed targets live in the benchmark's own output)."""

from __future__ import annotations

import json

import pytest

from bench import gateway as bench
from streamflow.cli import available_benches


@pytest.mark.slow
def test_small_run_checks_every_call(capsys):
    assert "gateway" in available_benches()
    assert bench.main(["--calls", "8", "--episodes", "4", "--rounds", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1  # only the JSON line on stdout
    report = json.loads(captured.out)
    assert report["bench"] == "gateway" and report["token_mismatch"] == 0
    assert report["overhead_calls"] >= 4  # the first call of each of the 4 timed episodes
    # 2 warm-up, 4 timed and 4 concurrent episodes, 1 or 2 calls each: every call read back
    assert 10 <= report["calls_checked"] <= 20
    assert report["calls_per_s"] > 0 and report["overhead_ms_p99"] >= report["overhead_ms_p50"]
