"""A tiny W1 benchmark run against a real multi-process store completes, verifies exactly-once
delivery to the trainer, and prints the JSON figures as its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench._w1 import PROMPT_LEN, RESPONSE_LEN, w1_batch, w1_full_batch, w1_spec

REPO = Path(__file__).resolve().parents[2]


def test_w1_rows_have_the_issue_shapes():
    import numpy as np

    batch = w1_batch(100, 64, np.random.default_rng(0))
    assert batch.num_rows == 64
    assert len(batch.column("prompt_ids")[0]) == PROMPT_LEN
    assert len(batch.column("response_logprobs")[3]) == RESPONSE_LEN
    assert batch.column("response_ids")[5][0].as_py() == 105
    assert [t.name for t in w1_spec().tasks] == ["reward", "reference", "trainer"]


def test_full_rows_carry_what_the_consumers_write():
    import numpy as np

    batch = w1_full_batch(7, 3, np.random.default_rng(0))
    assert batch.schema.names == w1_spec().schema.names
    assert batch.column("reward").to_pylist() == [7.0, 8.0, 9.0]
    assert batch.column("ref_logprobs")[1].as_py() == [8.0] * RESPONSE_LEN


def test_tiny_w1_run_is_exactly_once():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store", "--rows", "256", "--resident", "1000",
         "--small-rows", "20000", "--limit-mib", "8", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exactly_once"] is True and result["values_ok"] is True
    assert result["rows"] == 256
    for key in ("rows_per_second", "bytes_per_second", "claim_p50_ms", "claim_p99_ms",
                "limit_bytes_per_second", "ratio_to_limit", "small_rows_per_second",
                "ceiling_bytes_per_second", "ceiling_ratio_to_limit", "clients_cpu_bound_ratio"):
        assert result[key] > 0, key
    # The null node's run is W1 too: its clients verified their rows the same way.
    assert result["ceiling_exactly_once"] is True
    assert set(result["claim_p50_ms_by_resident"]) == {"1000"}
