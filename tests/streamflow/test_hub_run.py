"""A run whose prompts, tool environment and reward come from a hub environment (env.hub;
workers.agent.hub): its keys and their one-line errors, the --dry-run checks, the plan's prompts,
and a tiny multi-turn `streamflow run` through real processes with the verifiers environment of
tests/fixtures/hub_arith that finishes with its rewards."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from testkit import no_children_left

from streamflow.cli import main
from streamflow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TINY = str(ROOT / "configs" / "tiny.yaml")
HUB_KEYS = ("data.task=hub", "env.hub=verifiers:hub_arith", "env.fn=hub", "reward.fn=hub",
            "rollout.max_turns=2")


@pytest.fixture
def fixtures_on_path(monkeypatch):
    """The fixture environment importable here, in spawned children (this sys.path) and in the
    worker processes a run starts (PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FIXTURES), str(ROOT), path)
                                                     if p))


@pytest.mark.parametrize(("overrides", "key"), [
    (["data.task=hub"], "data.task"),
    (["reward.fn=hub"], "reward.fn"),
    (["env.fn=hub"], "env.fn"),
    (["env.hub=gym:CartPole-v1"], "env.hub"),
    (["env.hub=verifiers:"], "env.hub"),
])
def test_a_hub_key_without_its_hub_is_a_one_line_error_naming_it(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key and "\n" not in str(err.value), err.value


def test_dry_run_finds_the_hub_library_and_the_tasksets_package(fixtures_on_path, capsys):
    assert main(["run", TINY, *HUB_KEYS, "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["run", TINY, *HUB_KEYS, "env.hub=verifiers:no_such_env", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: env.hub: verifiers:no_such_env: module 'no_such_env' is not installed "
                   "in this Python environment (docs/agents.md \"Environments from a hub\")"], err


def test_the_plan_takes_the_tasksets_tasks_and_holds_out_its_eval_prompts(
        fixtures_on_path):
    from hub_arith.taskset import PAIRS

    from streamflow.plan import _problems, reward_fn

    cfg = load_config(TINY, [*HUB_KEYS, "run.eval_prompts=4", "run.eval_every=1"])
    train, task, evals = _problems(cfg)
    rows = {(f"{a}+{b}=", str(a + b)) for a, b in PAIRS}
    assert task is None and len(evals) == 4 and len(train) == len(rows) - 4
    assert {(p.prompt, p.answer) for p in train + evals} == rows
    assert reward_fn(cfg) == "hub:verifiers:hub_arith"


@pytest.mark.slow
def test_a_run_takes_its_prompts_tools_and_rewards_from_the_hub_environment(
        fixtures_on_path, tiny_config):
    from streamflow.controller import run

    # (no held-out evaluation: tests/workers/agent/test_hub.py scores greedy trajectories)
    cfg = tiny_config(*HUB_KEYS, "run.mode=periodic", "run.iterations=2", "run.eval_every=0",
                      "run.stall_timeout_s=60", "rollout.groups_per_claim=1",
                      # (a hot temperature: the untrained model makes a few plain-form calls)
                      "rollout.temperature=4", "rollout.max_new_tokens=12",
                      "data.prompts_per_iteration=16", "data.group_size=4",
                      "trainer.rows_per_claim=16")
    summary = run(cfg)
    no_children_left()
    out = Path(cfg.run.output_dir)
    assert summary.status == "ok", summary
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    rows = cfg.data.prompts_per_iteration * cfg.data.group_size
    spans = [json.loads(x) for x in (out / "timeline.jsonl").read_text().splitlines()]
    answered = 0
    for k, record in enumerate(records):
        # the rows that called a tool went through the hub environment's task
        env_rows = sum(s["rows"] for s in spans
                       if s["stage"] == "environment" and s["iteration"] == k)
        assert env_rows <= rows, (k, env_rows)
        answered += env_rows
        # the task's rewards (1 x correct + 0.1 x brevity) scored each row: in (0, 1.1]
        assert 0.0 < record["reward_mean"] <= 1.1 and math.isfinite(record["reward_std"])
    # the hub environment's tool answered calls (seeded: the same ones every run)
    assert answered > 0 and sum(r["tool_calls_mean"] for r in records) > 0, records
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "Traceback" not in logs, logs[-3000:]
