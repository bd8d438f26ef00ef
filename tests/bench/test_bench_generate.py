"""`streamflow bench generate --quick`: every side generates the same tokens; the JSON line has the
fields another benchmark reads (timings are not checked here)."""

from __future__ import annotations

import json

from bench import generate as bench


def test_quick_run_prints_table_then_json(capsys):
    assert bench.main(["--quick", "--repeats", "0", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("generation:")
    report = json.loads(lines[-1])
    w = bench.QUICK
    assert report["bench"] == "generate" and set(report["sides"]) == set(bench.SIDES)
    for side in report["sides"].values():  # no stop token: every row runs the full length
        assert side["tokens"] == w.prompts * w.group_size * w.new_tokens
        assert side["seconds"] > 0 and side["cpu_seconds"] >= 0
    assert report["engine_vs_hf"] > 0 and report["engine_vs_eager_64"] > 0


def test_generate_seconds_is_callable_for_one_side():
    out = bench.generate_seconds(("engine",), workload=bench.QUICK, repeats=0, threads=1)
    assert set(out) == {"engine"} and out["engine"]["tokens"] == 2 * 2 * 4
