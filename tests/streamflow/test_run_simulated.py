"""``streamflow run`` with ``engine: simulated``: the real controller, worker processes, store and
modes over simulated devices (workers/engines/simulated.py), and the config rules around it."""

from __future__ import annotations

import json

import pytest

from streamflow.config import ConfigError, load_config
from streamflow.controller import run
from tests.streamflow.conftest import ROOT
from workers.engines.sim_cost import preset

ITERATIONS = 3
PROMPTS = 8
GROUP = 4
TIME_SCALE = 400.0


def _config(out, *overrides: str):
    return load_config(ROOT / "configs" / "simulated.yaml", [
        f"run.output_dir={out}", f"run.iterations={ITERATIONS}",
        f"data.prompts_per_iteration={PROMPTS}", f"data.group_size={GROUP}",
        "rollout.groups_per_claim=2", "rollout.max_new_tokens=512", "reward.rows_per_claim=8",
        "reference.rows_per_claim=8", "trainer.rows_per_claim=8",
        f"simulated.time_scale={TIME_SCALE}", "simulated.median_response_tokens=100", *overrides,
    ])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One simulated run per mode (sync in-process; periodic and async with worker processes)."""
    root = tmp_path_factory.mktemp("simulated")
    modes = {"sync": (), "periodic": (), "async": ("run.mode=async", "run.max_staleness=1")}
    out = {}
    for name, overrides in modes.items():
        summary = run(_config(root / name, f"run.mode={name}", *overrides))
        out[name] = (summary, json.loads((root / name / "summary.json").read_text()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "periodic", "async"])
def test_every_mode_runs_to_the_end_on_simulated_devices(runs, mode):
    summary, data = runs[mode]
    assert summary.status == "ok", summary.error
    assert data["samples"] == ITERATIONS * PROMPTS * GROUP
    assert data["final_policy_version"] == ITERATIONS
    assert data["redelivered_rows"] == 0 and data["in_flight_rows"] == 0
    assert data["max_staleness_observed"] <= (1 if mode == "async" else 0)
    # The trainer held its device at least the cost model's training time of what was generated
    # (prompt tokens on top of that only add), in real seconds.
    cost = preset("7b-1acc")
    least = cost.train_s(0, [data["generated_tokens"]]) / TIME_SCALE
    assert data["stage_busy_seconds"]["trainer"] >= least > 0
    # Simulated lengths: a median of 100 tokens, capped at 512.
    per_sample = data["generated_tokens"] / data["samples"]
    assert 50 < per_sample < 512


@pytest.mark.slow
def test_on_policy_modes_draw_the_same_responses(runs):
    """Lengths are drawn from the per-group sampling seed and policy version: sync and periodic
    generate iteration k with version k, so they draw the same tokens."""
    assert runs["sync"][1]["generated_tokens"] == runs["periodic"][1]["generated_tokens"]


def test_simulated_engines_go_together(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine: 'simulated' needs rollout.engine and "
                       "trainer.engine both 'simulated'"):
        _config(tmp_path, "trainer.engine=torch")
    with pytest.raises(ConfigError, match="trainer.engine"):
        _config(tmp_path, "rollout.engine=torch")


def test_simulated_trainer_devices_are_num_ranks_in_one_process(tmp_path):
    cfg = _config(tmp_path, "trainer.num_ranks=4")
    assert cfg.trainer.num_ranks == 4
    nodes = ("placement.nodes=[{host: a, store_nodes: 1, rollout: 2, reward: 1, reference: 1, "
             "trainer: %d}]")
    assert sum(n.trainer for n in _config(tmp_path, "trainer.num_ranks=4",
                                          nodes % 1).placement.nodes) == 1
    with pytest.raises(ConfigError, match="places 4 trainer"):
        _config(tmp_path, "trainer.num_ranks=4", nodes % 4)
    with pytest.raises(ConfigError, match="'deepspeed' or 'simulated'") as err:
        load_config(None, ["trainer.num_ranks=2"])
    assert err.value.key == "trainer.num_ranks"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("run.eval_every=1", "run.eval_every"),
        ("run.resume=auto", "run.resume"),
        ("simulated.cost=70b", "simulated.cost"),
        ("simulated.time_scale=0", "simulated.time_scale"),
        ("simulated.skew=5", "simulated.skew"),
    ],
)
def test_bad_simulated_settings_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, override)
    assert err.value.key == key
