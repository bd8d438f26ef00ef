"""The agent section (agent.fn: a user's agent through the gateway) as the config and the
dry run check it: bad values are one line naming the key; the cross-section rules; the shipped
configs pass a dry run (the SmolLM2 one with the model converted from its package)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.cli import main
from streamflow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
AGENT = ("rollout.max_turns=2", "agent.fn=examples.calculator_agent:run")


@pytest.mark.parametrize("overrides, key, text", [
    (["agent.fn=not a function"], "agent.fn", "must be 'package.module:function'"),
    (["agent.fn=examples.calculator_agent"], "agent.fn", "must be 'package.module:function'"),
    (["agent.fn=examples.calculator_agent:run"], "rollout.max_turns", "must be >= 2 with agent.fn"),
    ([*AGENT, "run.mode=sync"], "agent.fn", "needs run.mode periodic or async"),
    ([*AGENT, "rollout.partial=true", "run.mode=async"], "rollout.partial", "rollout.partial"),
    ([*AGENT, "agent.episodes_per_worker=0"], "agent.episodes_per_worker", "must be >= 1"),
    ([*AGENT, "agent.port=70000"], "agent.port", "must be >= 0 and <= 65535"),
    ([*AGENT, "agent.timeout_s=0"], "agent.timeout_s", "must be > 0"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, key, text) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fn, needle", [
    ("no_such_module_xyz:run", "error: agent.fn: cannot import 'no_such_module_xyz'"),
    ("examples.calculator_agent:nope", "error: agent.fn: module 'examples.calculator_agent' "
                                       "has no function 'nope'"),
    ("examples.calculator_agent:calculate", "error: agent.fn: 'examples.calculator_agent:"
                                            "calculate' must take (base_url, api_key, prompt, "
                                            "answer)"),
])
def test_dry_run_refuses_an_agent_it_cannot_call_in_one_line(capsys, tmp_path, fn, needle):
    out = tmp_path / "run"
    assert main(["run", TINY, "rollout.max_turns=2", f"agent.fn={fn}",
                 f"run.output_dir={out}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and err.count("\n") == 1, err
    assert not out.exists()


def test_the_agent_demo_config_passes_a_dry_run(capsys, tmp_path):
    assert main(["run", str(ROOT / "configs" / "agent.yaml"), f"run.output_dir={tmp_path}",
                 "--dry-run"]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_the_smollm2_agent_config_passes_a_dry_run(capsys, tmp_path_factory):
    from workers.models.gguf import convert_smollm2

    model = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").is_file():  # a clean clone: convert it from its package
        model = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
        convert_smollm2(model)
    out = tmp_path_factory.mktemp("run")
    assert main(["run", str(ROOT / "configs" / "agent-smollm2.yaml"), f"model.path={model}",
                 f"run.output_dir={out}", "--dry-run"]) == 0
    capsys.readouterr()
