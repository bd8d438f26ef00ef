"""End to end: collective weight sync (gloo on the CPU) trains exactly what the file path trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from streamflow.controller import run


def _final(cfg) -> dict:
    out = Path(cfg.run.output_dir)
    return load_file(str(out / "checkpoints" / "step-000002" / "model.safetensors"))


@pytest.mark.slow
def test_periodic_collective_equals_file(tiny_config, periodic_run) -> None:
    by_file = periodic_run.cfg  # the same run with weights.sync=file (shared with test_controller)
    collective = tiny_config(*periodic_run.overrides, "weights.sync=collective", "run.name=collective",
                             f"run.output_dir={Path(by_file.run.output_dir).parent / 'coll'}")
    summary = run(collective)
    assert summary.status == "ok"
    a, b = _final(by_file), _final(collective)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst == 0.0, worst
    logs = Path(collective.run.output_dir) / "logs"
    trainer = (logs / "trainer-0.log").read_text()
    for version in (1, 2):  # every new version went over the group, to both rollout workers
        assert f"broadcast policy version {version}:" in trainer, trainer[-2000:]
    assert "failed" not in trainer
    for worker in ("rollout-0", "rollout-1"):
        text = (logs / f"{worker}.log").read_text()
        assert "received policy version 1 by broadcast" in text, text[-2000:]
    initial = load_file(str(next(Path(collective.run.output_dir).parent.glob(".cache/builtin-*"))
                            / "model.safetensors"))
    assert max(float((b[k] - initial[k]).abs().max()) for k in b) > 1e-4, "no update"


@pytest.mark.slow
def test_async_collective_stays_within_max_staleness(tiny_config) -> None:
    cfg = tiny_config("run.mode=async", "run.max_staleness=1", "run.iterations=3",
                      "run.eval_every=0", "weights.sync=collective", "weights.timeout_s=60")
    summary = run(cfg)
    assert summary.status == "ok"
    assert summary.max_staleness_observed <= 1
    for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines():
        assert json.loads(line)["staleness_max"] <= 1
    trainer = (Path(cfg.run.output_dir) / "logs" / "trainer-0.log").read_text()
    assert "broadcast policy version 3:" in trainer and "failed" not in trainer
