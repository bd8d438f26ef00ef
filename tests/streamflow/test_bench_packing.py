"""`streamflow bench packing --quick`: a tiny run prints a table and a JSON line with the fields."""

from __future__ import annotations

import json

from streamflow.bench import packing as bench

FIELDS = {"P", "L", "G", "token_ratio", "time_ratio", "peak_memory_ratio"}


def test_quick_run_prints_table_then_json(capsys):
    assert bench.main(["--quick", "--repeats", "0", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("shared-prompt packing")
    assert "tokens unp/pk" in lines[1]
    report = json.loads(lines[-1])
    assert [(c["P"], c["L"], c["G"]) for c in report["cases"]] == bench.QUICK_CASES
    for case in report["cases"]:
        assert FIELDS <= set(case)
        P, L, G = case["P"], case["L"], case["G"]
        # tokens really processed: G full rows unpacked, one prompt copy packed
        assert case["tokens_unpacked"] == G * (P + L)
        assert case["tokens_packed"] == P + G * L
        assert case["token_ratio"] == round((G * P + G * L) / (P + G * L), 4)
        assert case["time_ratio"] > 0


def test_json_flag_keeps_stdout_machine_readable(capsys):
    spec = {"kind": "memory", "P": 6, "L": 3, "G": 2, "packed": True}
    spec.update(shape=vars(bench.QUICK_MODEL), threads=1, attention="segments")
    assert bench.main(["--child", json.dumps(spec)]) == 0  # the child process entry point
    child = json.loads(capsys.readouterr().out)
    assert child["tokens"] == 6 + 2 * 3 and child["peak_bytes"] >= 0
    assert bench.main(["--quick", "--json", "--repeats", "0", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1  # only the JSON line on stdout
    assert json.loads(captured.out)["bench"] == "packing"
    assert "tokens unp/pk" in captured.err
