"""``streamflow bench calibrate``: the cost model's figures measured on the device there is.

On this CPU-only machine only ``--tiny`` can run (a smoke test of the code path that the real
H100 measurement in docs/perf/calibrate_h100.json took); without a GPU the full bench refuses."""

from __future__ import annotations

import json

import pytest

from streamflow.cli import main

FIGURES = {
    "ref_s_per_token",
    "train_s_per_token",
    "decode_step_s(B=1)",
    "decode_step_s(B=4)",
    "optimizer_s",
    "device_to_host_bytes_per_s",
}


def test_calibrate_tiny_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "calibrate", "--tiny", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"]["tiny"] is True and out["model"]["params"] > 0
    rows = {r["name"]: r for r in out["rows"]}
    assert set(rows) == FIGURES
    for r in rows.values():
        assert r["measured"] > 0, r
        if r["preset"] is None:
            assert r["ratio"] is None
        else:
            assert r["ratio"] == pytest.approx(r["measured"] / r["preset"])


def test_calibrate_without_a_gpu_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "calibrate"]) == 2
    assert "needs a CUDA device (or --tiny)" in capsys.readouterr().err


def test_the_recorded_h100_run_is_the_full_shape() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "perf" / "calibrate_h100.json"
    out = json.loads(path.read_text())
    assert out["device"].startswith("NVIDIA H100") and not out["model"]["tiny"]
    assert out["model"]["params"] == pytest.approx(7.6e9, rel=0.01)  # Qwen2.5-7B's shape
    for r in out["rows"]:
        if r["ratio"] is not None:  # the preset within 0.5-2x of every measured figure
            assert 0.5 < r["ratio"] < 2.0, r
