"""Multi-turn tool use wired into a run, below the processes: the rollout.max_turns / env.* keys and
their one declaration, the one-line errors (config, preflight, --dry-run), the plan's table, records
and environment workers, the launch placement, sync's drain order and the turn metrics."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from testkit import worker_plan

from streamflow import preflight
from streamflow.cli import main
from streamflow.config import ConfigError, EnvSection, RolloutSection, config_warnings, load_config
from streamflow.controller import _piece_order
from streamflow.launch import worker_nodes
from streamflow.metrics import ControllerMetrics
from streamflow.rundir import IterationRecord
from workers.agent.sandbox import SandboxLimits
from workers.roles.trainer import turn_counts
from workers.runtime.events import EventSender
from workers.runtime.metrics import MeteredEvents, WorkerMetrics
from workers.settings import AgentSettings, EnvSettings, SandboxSettings, TurnSettings

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
TWO = "rollout.max_turns=2"


def _cfg(*overrides: str):
    return load_config(TINY, list(overrides))


def test_the_keys_embed_the_workers_settings_declared_once() -> None:
    cfg = _cfg("rollout.max_turns=3", "rollout.max_total_tokens=100", "env.fn=python",
               "env.format=hermes", "env.max_observation_tokens=9", "env.timeout_s=2",
               "env.sandbox.wall_s=1.5", "env.sandbox.max_processes=4", "env.num_workers=2")
    assert cfg.rollout.turns == TurnSettings(max_turns=3, max_total_tokens=100)
    assert cfg.env.settings == EnvSettings(
        fn="python", format="hermes", max_observation_tokens=9, timeout_s=2.0,
        sandbox=SandboxSettings(wall_s=1.5, max_processes=4))
    assert cfg.env.num_workers == 2 and cfg.multi_turn
    # the section defaults are the settings classes' (and the sandbox's own limits)
    assert RolloutSection().turns == TurnSettings() and EnvSection().settings == EnvSettings()
    assert SandboxSettings().limits() == SandboxLimits()
    assert not _cfg().multi_turn


@pytest.mark.parametrize("overrides, key, text", [
    (["rollout.max_turns=0"], "rollout.max_turns", "must be >= 1"),
    (["env.fn=1bad"], "env.fn", "must be a built-in name"),
    (["env.format=json"], "env.format", "must be one of 'auto', 'plain', 'hermes'"),
    (["env.sandbox.wall_s=0"], "env.sandbox.wall_s", "must be > 0"),
    (["env.tools=[calculator, calculator]"], "env.tools", "must be distinct non-empty tool names"),
    (["env.num_workers=0"], "env.num_workers", "must be >= 1"),
    ([TWO, "trainer.kl_coef=0.1", "reference.placement=rollout"], "reference.placement",
     "'rollout' cannot score a trajectory of rollout.max_turns=2"),
    ([TWO, "rollout.max_total_tokens=4000"], "trainer.token_budget",
     ">= rollout.max_total_tokens x data.group_size = 8000"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, key, text) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)


def test_simulated_engines_cannot_take_turns() -> None:
    with pytest.raises(ConfigError, match="^rollout.max_turns: 2 needs a real rollout engine"):
        load_config(ROOT / "configs" / "simulated.yaml", [TWO])
    load_config(ROOT / "configs" / "simulated.yaml")  # (the config itself is fine)


def test_the_reference_in_rollout_is_refused_only_with_turns() -> None:
    _cfg("trainer.kl_coef=0.1", "reference.placement=rollout")
    _cfg(TWO, "trainer.kl_coef=0", "reference.placement=rollout")  # no reference runs at all


def test_env_settings_without_turns_are_a_warning() -> None:
    assert any("env.* has no effect" in n for n in config_warnings(_cfg("env.fn=python")))
    assert not config_warnings(_cfg(TWO, "env.fn=python"))
    assert any("env.num_workers is ignored in mode 'sync'" in n
               for n in config_warnings(_cfg(TWO, "run.mode=sync", "env.num_workers=2")))


@pytest.mark.parametrize("overrides, needle", [
    (["env.fn=nope"], "error: env.fn: unknown environment 'nope'; built-in: calculator, python"),
    (["env.fn=no_such_module_xyz:Env"],
     "error: env.fn: cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    (["env.fn=json:NoSuchClass"], "error: env.fn: module 'json' has no attribute 'NoSuchClass'"),
    (["env.tools=[calculator, python]"],
     "error: env.tools: 'python' is not a tool of env.fn=calculator, which serves: calculator"),
    (["reward.fn=json:dumps"], "error: reward.fn: reward 'dumps' must take (completion, answer) "
                               "or (completion, answer, trajectory), not (obj, *, skipkeys"),
    (["rollout.max_total_tokens=256"],
     "error: rollout.max_total_tokens: 256 leaves no room for a prompt in the context of the "
     "built-in model (256 tokens)"),
    (["env.fn=mcp"], "error: env.mcp_command: fn 'mcp' needs its server: mcp_command (a stdio "
                     "server's argv) or mcp_url (a streamable HTTP endpoint), exactly one"),
    (["env.fn=mcp", "env.mcp_command=[python3]", "env.mcp_url=http://127.0.0.1:1/mcp"],
     "error: env.mcp_url: fn 'mcp' needs its server"),
    (["env.mcp_url=http://127.0.0.1:1/mcp"],
     "error: env.mcp_url: only used with fn 'mcp', got fn 'calculator'"),
    (["env.fn=mcp", "env.mcp_url=ftp://127.0.0.1/mcp"],
     "error: env.mcp_url: must be an http:// or https:// URL, got 'ftp://127.0.0.1/mcp'"),
    (["env.fn=mcp", "env.mcp_command=[/nonexistent/python3, -m, server]"],
     "error: env.mcp_command: '/nonexistent/python3' is not an executable file or a command on "
     "PATH"),
])
def test_dry_run_refuses_a_bad_environment_in_one_line(capsys, tmp_path, overrides, needle):
    out = tmp_path / "run"
    assert main(["run", TINY, TWO, *overrides, f"run.output_dir={out}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and err.count("\n") == 1, err
    assert not out.exists()


def test_dry_run_accepts_a_good_environment(capsys, tmp_path):
    for fn in ("calculator", "json:JSONDecoder"):  # a user's class: imported, never made here
        assert main(["run", TINY, TWO, f"env.fn={fn}", f"run.output_dir={tmp_path}",
                     "--dry-run"]) == 0
    # single-turn: env.fn is never used, so it is not checked
    assert main(["run", TINY, "env.fn=nope", f"run.output_dir={tmp_path}", "--dry-run"]) == 0
    capsys.readouterr()


def test_env_tools_are_checked_against_a_users_environment_in_a_child(capsys, tmp_path,
                                                                     monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "workers" / "agent"))  # agent_envs
    ok = ["run", TINY, TWO, "env.fn=agent_envs:Moody", f"run.output_dir={tmp_path}", "--dry-run"]
    assert main([*ok, "env.tools=[say]"]) == 0
    assert main([*ok, "env.tools=[say, shout]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.tools: 'shout' is not a tool of env.fn=agent_envs:Moody, "
                          "which serves: say\n") and err.count("\n") == 1, err
    assert main([*ok[:3], "env.fn=agent_envs:Broken", *ok[4:], "env.tools=[say]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.fn: environment 'agent_envs:Broken' raised when made") and (
        err.count("\n") == 1), err


def test_env_tools_are_checked_against_an_mcp_servers_tools(capsys, tmp_path):
    """The dry run starts the server (tests/workers/agent/mcp_calculator.py) to ask its tools."""
    server = ROOT / "tests" / "workers" / "agent" / "mcp_calculator.py"
    ok = ["run", TINY, TWO, "env.fn=mcp", f"env.mcp_command=[{sys.executable}, {server}]",
          f"run.output_dir={tmp_path}", "--dry-run"]
    assert main(ok) == 0  # (not started: env.tools names none)
    assert main([*ok, "env.tools=[calculator]"]) == 0
    assert main([*ok, "env.tools=[calculator, search]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.tools: 'search' is not a tool of env.fn=mcp, which serves: "
                          "calculator, fail, hang\n") and err.count("\n") == 1, err
    assert main([*ok[:4], f"env.mcp_command=[{sys.executable}, -c, 'import sys']", *ok[5:],
                 "env.tools=[calculator]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.mcp_command: the MCP server did not start: ") and (
        err.count("\n") == 1), err


def test_the_python_tool_needs_a_working_sandbox(monkeypatch, capsys, tmp_path):
    import workers.agent.sandbox as sandbox

    cfg = _cfg(TWO, "env.fn=python")
    monkeypatch.setattr(sandbox, "check_sandbox", lambda: None)
    preflight.check_inputs(cfg)
    monkeypatch.setattr(sandbox, "check_sandbox", lambda: "user namespaces are disabled")
    with pytest.raises(ConfigError, match="^env.fn: 'python' needs the sandbox, which does not "
                                          "work here: user namespaces are disabled$"):
        preflight.check_inputs(cfg)
    assert main(["run", TINY, TWO, "env.fn=python", f"run.output_dir={tmp_path}",
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.fn: 'python' needs the sandbox") and err.count("\n") == 1


def test_the_plan_builds_the_turn_table_and_the_environment_workers(tmp_path) -> None:
    cfg = _cfg("rollout.max_turns=3", "env.num_workers=2", "env.rows_per_claim=5",
               "env.fn=python", "env.sandbox.cpu_s=1")
    plan = worker_plan(cfg, tmp_path)
    want = AgentSettings(turns=cfg.rollout.turns,
                         env=dataclasses.replace(cfg.env.settings, format="plain"))
    assert plan.rollout.agent == want and plan.environment is not None
    assert plan.environment.agent == want and plan.environment.rows_per_claim == 5
    assert plan.reward.agent == want  # it reads the trajectory's columns
    assert [t.name for t in plan.table_spec.tasks] == [
        "rollout", "env.1", "rollout.2", "env.3", "rollout.4", "reward", "reference", "trainer"]
    workers = plan.workers(["tcp://127.0.0.1:1"], None)
    envs = [(name, role, w) for name, role, w, _ in workers if role == "environment"]
    assert [name for name, _, _ in envs] == ["environment-0", "environment-1"]
    assert all(w.common.name == name and w.common.threads == 1 for name, _, w in envs)
    # a model.path speaks the hermes form unless env.format says otherwise
    assert _cfg(TWO, "model.path=/m").tool_format == "hermes"
    assert _cfg(TWO, "model.path=/m", "env.format=plain").tool_format == "plain"


def test_a_single_turn_plan_is_todays(tmp_path) -> None:
    plan = worker_plan(_cfg("env.num_workers=3"), tmp_path)
    assert plan.rollout.agent is None and plan.environment is None and plan.reward.agent is None
    assert "env.0" not in [t.name for t in plan.table_spec.tasks]
    assert all(role != "environment" for _, role, _, _ in plan.workers(["tcp://h:1"], None))


def test_launch_places_the_environment_workers() -> None:
    nodes = ("placement.nodes=[{host: 10.9.0.1, store_nodes: 1, environment: 1}, "
             "{host: 10.9.0.2, rollout: 1, reward: 1, reference: 1, environment: 1, trainer: 1}]")
    cfg = _cfg(TWO, "env.num_workers=2", nodes)
    assert worker_nodes(cfg) == {"rollout-0": 1, "reward-0": 1, "reference-0": 1,
                                 "environment-0": 0, "environment-1": 1, "trainer-0": 1}
    with pytest.raises(ConfigError, match=r"places 2 environment process\(es\) but the run has 1 "
                                          r"\(env.num_workers, when rollout.max_turns > 1\)"):
        _cfg(TWO, nodes)
    with pytest.raises(ConfigError, match="places 2 environment process.* has 0"):
        _cfg(nodes)  # single-turn: no environment worker to place


def test_sync_drains_the_piece_tasks_in_order() -> None:
    class Stage:
        def __init__(self, piece: int) -> None:
            self.piece = piece

    r0, r2, r4, e1, e3 = (Stage(k) for k in (0, 2, 4, 1, 3))
    order = _piece_order([r0, r2, r4], [e1, e3])
    assert order == [("rollout", r0), ("environment", e1), ("rollout", r2),
                     ("environment", e3), ("rollout", r4)]
    assert _piece_order([r0], []) == [("rollout", r0)]


def test_turns_and_tool_calls_are_read_from_the_loss_mask() -> None:
    assert turn_counts([None, [], [1, 1, 1], [1, 1, 0, 0, 1], [1, 0, 1, 0, 0, 1, 1], [1, 0]]) == [
        (1, 0), (1, 0), (1, 0), (2, 1), (3, 2), (1, 1)]


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_the_metrics_carry_turns_tool_calls_latency_and_errors() -> None:
    controller = ControllerMetrics("periodic", 2)
    controller.on_record(IterationRecord(0, 1, reward_mean=0.0, turns_mean=1.75,
                                         tool_calls_mean=0.5))
    assert _value(controller.registry, "streamflow_run_turns_mean") == 1.75
    assert _value(controller.registry, "streamflow_run_tool_calls_mean") == 0.5
    events = MeteredEvents(EventSender(None, trace=False), WorkerMetrics())
    events.metrics.tool_call(0.2, None)
    events.metrics.tool_call(0.4, "timeout")
    events.metrics.tool_call(0.1, "bad_call")
    events.metrics.tool_call(0.1, "bad_call")
    reg = events.metrics.registry
    assert _value(reg, "streamflow_env_tool_duration_seconds_count") == 4
    assert abs(_value(reg, "streamflow_env_tool_duration_seconds_sum") - 0.8) < 1e-9
    assert _value(reg, "streamflow_env_tool_errors_total", kind="timeout") == 1
    assert _value(reg, "streamflow_env_tool_errors_total", kind="bad_call") == 2
