"""`streamflow bench pipeline`: a tiny run of the three modes ends with one JSON line per mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# the run's own bound is the subprocess timeout below; the test's outlasts it
@pytest.mark.slow
@pytest.mark.timeout(700)
def test_tiny_pipeline_reports_every_mode():
    cmd = [sys.executable, "-m", "streamflow", "bench", "pipeline", "--json", "--iterations", "2",
           "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--hidden", "32",
           "--layers", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"sync", "periodic", "async"}
    for mode, r in report.items():
        assert r["samples"] == 2 * 2 * 2, mode  # iterations x prompts x group size
        assert r["samples_per_second"] > 0 and r["wall_seconds"] > 0
    assert report["sync"]["speedup"] == 1.0
    assert report["async"]["max_staleness_observed"] <= 1
    assert report["periodic"]["max_staleness_observed"] == 0
