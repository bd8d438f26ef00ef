"""`streamflow bench longtail`: the simulated cases end in one consistent JSON line (``--quick``),
and the real engine's workload is what the bench says it is.

A smoke test of the report, not of the target (the full bench measures that: docs/benchmarks.md).
The real cases are whole ``streamflow run``s of several processes each (minutes with ``--quick``
too), so here their pieces are checked instead: the tail model and the run overrides.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from streamflow.cli import main

CASES = ("sync", "async", "async_partial")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_longtail_reports_every_simulated_case(capsys: pytest.CaptureFixture[str]):
    """Breaks if a case is missing or trained no samples, if ``partial_speedup`` is not the ratio
    of the printed throughputs, or if the workload has no tail."""
    assert main(["bench", "longtail", "--quick", "--skip-real", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["targets"] == {"sim_partial_speedup": 1.25, "real_partial_speedup_median": 1.0}
    assert "real" not in report and report["command"].startswith("streamflow bench longtail")
    sim = report["sim"]
    for case in CASES:
        r = sim[case]
        assert r["samples"] == sim["workload"]["iterations"] * 8 * sim["workload"][
            "prompts_per_iteration"], case
        assert r["samples_per_s"] > 0 and r["samples_per_s_whole_run"] > 0, case
    for key, rate in (("partial_speedup", "samples_per_s"),
                      ("partial_speedup_whole_run", "samples_per_s_whole_run")):
        assert sim[key] == pytest.approx(sim["async_partial"][rate] / sim["async"][rate])
    assert sim["workload"]["tail_fraction"] > 0 and sim["staleness"] >= 1
    assert "trace" not in report  # the trace block comes from the real cases


def test_the_real_cases_sample_uniformly_and_only_async_partial_cuts(tmp_path: Path):
    """Breaks if the tail model's next token is not uniform (its lengths would not be the
    geometric ones the bench documents) or if a case's run config differs from its name."""
    import torch

    from bench.longtail import real_overrides, tail_model
    from streamflow.config import load_config
    from workers.engines.base import SamplingParams
    from workers.engines.torch_rollout import TorchRolloutEngine
    from workers.models.local import load_model, load_tokenizer

    path = tail_model(tmp_path / "model", max_positions=96)
    tok = load_tokenizer(path)
    model = load_model(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 6, 7, 8]])).logits
    assert torch.equal(logits, torch.zeros_like(logits))  # every next token: 1 / V
    out = TorchRolloutEngine(model, tok).generate([[1, 5, 6]], 16, SamplingParams(
        max_new_tokens=64, seed=0))
    assert all(g.logprobs == pytest.approx([-math.log(len(tok))] * len(g.token_ids))
               for g in out[0])
    args = argparse.Namespace(seed=0, real_iterations=2, real_prompts=4, real_groups_per_claim=2,
                              real_max_new_tokens=64, real_staleness=2)
    root = Path(__file__).resolve().parents[2]
    for case in CASES:
        cfg = load_config(root / "configs" / "tiny.yaml",
                          real_overrides(args, case, path, tmp_path / case))
        assert cfg.run.mode == ("sync" if case == "sync" else "async")
        assert cfg.rollout.partial is (case == "async_partial")
