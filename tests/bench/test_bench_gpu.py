"""`streamflow bench gpu --smoke`: the GPU check's CPU fallback at its smallest sizes, end to end.

Breaks when a step of the check fails or goes missing (a bench it calls changed its signature or
its output, the gpu tests no longer collect), or when the JSON loses a part a reader of it needs.
"""

from __future__ import annotations

import json

import pytest

from bench import gpu

STEPS = ("phases_g1", "overhead_g1", "phases_qwen2_150m", "overhead_qwen2_150m", "warmup_g1",
         "weights_0.5b", "gpu_tests")


@pytest.mark.timeout(300)
def test_smoke_check_runs_every_step_on_the_cpu_and_writes_one_json(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--json", "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == report
    assert report["device"] == "cpu" and report["size"] == "smoke"
    assert set(report["versions"]) == {"torch", "transformers", "pyarrow", "cuda"}
    assert list(report["steps"]) == list(STEPS)
    for name, step in report["steps"].items():  # (gpu_tests ran beside the others: ~0 s left)
        assert step["ok"] is True and step["seconds"] >= 0, (name, step)
    steps = {name: step["result"] for name, step in report["steps"].items()}
    for model in ("g1", "qwen2_150m"):
        phases = steps[f"phases_{model}"]["phases"]
        assert set(phases) == {"generation", "reference", "train_step"}
        assert all(p["streamflow_s"] > 0 and p["baseline_s"] > 0 for p in phases.values())
        breakdown = steps[f"overhead_{model}"]["breakdown"]
        cats = breakdown["categories"]
        assert {"store_round_trips", "serialisation", "tensor_conversion", "host_device_copies",
                "optimizer", "weight_publication", "waits", "other"} <= set(cats)
        # the categories split the attributed time of the iteration, nothing counted twice
        assert sum(c["seconds"] for c in cats.values()) == pytest.approx(
            breakdown["attributed_s"], rel=1e-3, abs=1e-5)
        assert cats["store_round_trips"]["seconds"] > 0 and cats["optimizer"]["seconds"] > 0
    # the cold start, iteration by iteration, each with its profile (no allocator on the CPU)
    warm = steps["warmup_g1"]
    assert [r["k"] for r in warm["iterations"]] == [0, 1, 2]
    for r in warm["iterations"]:
        assert r["generation_s"] > 0 and r["total_s"] >= r["generation_s"]
        assert r["allocator"] is None and r["profile"]["host_self"]
    assert len(warm["first_over_steady"]) == 2 and all(x > 0 for x in warm["first_over_steady"])
    cases = steps["weights_0.5b"]["cases"]
    assert {c["path"] for c in cases} == {"file", "collective"}
    assert all(c["bytes"] > 0 and c["ratio_to_copy"] > 0 for c in cases)
    assert steps["gpu_tests"]["failed"] == 0 and steps["gpu_tests"]["skipped"] > 0  # no CUDA here
    assert set(report["checks"].values()) == {None}  # the targets are a GPU's
