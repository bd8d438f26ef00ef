"""End to end: `streamflow run` with rollout.partial through real processes (docs/partial.md).

async with max_staleness 0 never has an update in flight while rollout generates (iteration
k + 1 is admitted only once version k + 1 is out, after every row of k was generated), so nothing
is ever cut: partial on must train exactly what partial off trains. The cut and resume path
itself, with real processes: tests/streamflow/test_partial_kill.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from testkit import no_children_left

from streamflow.controller import run

COMMON = ("run.mode=async", "run.max_staleness=0", "run.iterations=2", "run.eval_every=0",
          "rollout.groups_per_claim=1", "rollout.max_new_tokens=8", "trainer.kl_coef=0")


def _params(cfg) -> dict:
    return load_file(str(Path(cfg.run.output_dir) / "checkpoints"
                         / f"step-{cfg.run.iterations:06d}" / "model.safetensors"))


@pytest.mark.slow
def test_partial_with_nothing_to_cut_trains_what_a_run_without_it_trains(tiny_config) -> None:
    # Breaks if partial mode changes an uncut sample (seeds, tokens, log-probs, versions), the
    # trainer's claim, or cuts with no newer version published.
    off = tiny_config(*COMMON, "run.name=off")
    on = tiny_config(*COMMON, "run.name=on", "rollout.partial=true",
                     f"run.output_dir={off.run.output_dir}-partial")
    run(off)
    run(on)
    no_children_left()
    records = [[json.loads(x) for x in (Path(c.run.output_dir) / "metrics.jsonl").read_text()
                .splitlines()] for c in (off, on)]
    assert [r["iteration"] for r in records[1]] == [0, 1]
    assert all(r["partial_resumes"] == 0 and r["staleness_token_mean"] == 0 for r in records[1])
    # one run of one version per response: the mean run is the mean response length
    assert [r["tokens_per_version_span"] for r in records[0]] == \
        [r["tokens_per_version_span"] for r in records[1]]
    assert [r["reward_mean"] for r in records[0]] == [r["reward_mean"] for r in records[1]]
    a, b = _params(off), _params(on)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
