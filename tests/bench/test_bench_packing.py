"""`streamflow bench packing --quick`: a tiny run prints a table and a JSON line with the fields."""

from __future__ import annotations

import json

import pytest

from bench import packing as bench

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


def test_report_carries_the_auto_rule_decision(capsys):
    from workers.rl.packing import should_pack, token_saving

    assert bench.main(["--quick", "--json", "--repeats", "0", "--threads", "1",
                       "--cases", "16,8,2;2,8,4", "--min-saving", "0.3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["min_saving"] == 0.3 and isinstance(report["auto_never_over_3pct_slower"], bool)
    assert [(c["P"], c["L"], c["G"]) for c in report["cases"]] == [(16, 8, 2), (2, 8, 4)]
    for c in report["cases"]:
        group = bench._group(c["P"], c["L"], c["G"])
        assert c["token_saving"] == round(token_saving([group]), 4)
        assert c["auto_packs"] is should_pack([group], 0.3)
        chosen = c["seconds_packed"] if c["auto_packs"] else c["seconds_unpacked"]
        # (the report's seconds carry 6 significant digits, its ratio 4 decimals of the unrounded)
        assert c["auto_vs_unpacked"] == pytest.approx(chosen / c["seconds_unpacked"], abs=2e-4)
        assert c["auto_within_3pct"] is (c["auto_vs_unpacked"] <= 1.03)
    # 1 - 32/48 = 33 % saved: packed; 1 - 34/40 = 15 %: unpacked rows
    assert [c["auto_packs"] for c in report["cases"]] == [True, False]
    assert report["auto_never_over_3pct_slower"] is all(c["auto_within_3pct"] for c in report["cases"])
