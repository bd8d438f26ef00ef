"""Typed config: loading, overrides, round trips and the errors a user sees."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from streamflow.config import (
    ConfigError,
    ConfigTypeError,
    ConfigValueError,
    OverrideSyntaxError,
    RunConfig,
    TrainerSection,
    UnknownKeyError,
    config_from_dict,
    config_to_dict,
    config_warnings,
    dump_yaml,
    load_config,
)
from streamflow.config.convert import RENAMED_KEYS

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_with_todays_keys(path):
    assert isinstance(load_config(path), RunConfig)  # (a removed key would raise)


@pytest.mark.parametrize("name", ["quickstart.yaml", "tiny.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / name)
    assert isinstance(cfg, RunConfig)
    assert cfg.run.output_dir == f"runs/{cfg.run.name}"
    assert cfg.model.path is None  # both use the built-in model: no downloads


def test_tiny_is_small():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.run.iterations <= 2
    assert cfg.data.prompts_per_iteration * cfg.data.group_size <= 16


def test_round_trip_dict_and_yaml(tmp_path):
    cfg = load_config(
        None,
        [
            "run.mode=async",
            "run.max_staleness=2",
            "trainer.betas=[0.8, 0.95]",
            "data.operations=[+, '*']",
            "model.path=/models/x",
            "model.builtin.hidden_size=64",
        ],
    )
    assert config_from_dict(config_to_dict(cfg)) == cfg
    again = load_config(_write(tmp_path, dump_yaml(cfg)))
    assert again == cfg
    assert again.trainer.betas == (0.8, 0.95) and isinstance(again.trainer.betas, tuple)
    assert again.data.operations == ("+", "*")
    # The dict form is plain data (lists, not tuples), safe for YAML/JSON.
    assert config_to_dict(cfg)["trainer"]["betas"] == [0.8, 0.95]


def test_overrides_applied_and_typed():
    cfg = load_config(
        None,
        [
            "trainer.lr=1e-4",  # PyYAML alone would read this as a string
            "trainer.clip_eps=1",  # int accepted for float
            "run.progress=false",
            "run.resume=auto",
            "run.resume=null",  # later overrides win
            "run.name=007",  # a string field keeps the text as typed
            "model.builtin.num_layers=3",
        ],
    )
    assert cfg.trainer.lr == pytest.approx(1e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.clip_eps == 1.0 and isinstance(cfg.trainer.clip_eps, float)
    assert cfg.run.progress is False
    assert cfg.run.resume is None
    assert cfg.run.name == "007" and cfg.run.output_dir == "runs/007"
    assert cfg.model.builtin.num_layers == 3


def test_overrides_apply_on_top_of_file(tmp_path):
    path = _write(tmp_path, "trainer:\n  lr: 3.0e-4\n  kl_coef: 0.1\nrun:\n  iterations: 7\n")
    cfg = load_config(path, ["trainer.lr=0.5"])
    assert (cfg.trainer.lr, cfg.trainer.kl_coef, cfg.run.iterations) == (0.5, 0.1, 7)


def test_unknown_key_in_file_names_section_allowed_and_suggestion(tmp_path):
    path = _write(tmp_path, "trainer:\n  lrr: 0.1\n")
    with pytest.raises(UnknownKeyError) as info:
        load_config(path)
    msg = str(info.value)
    assert info.value.key == "trainer.lrr"
    assert "section 'trainer'" in msg and "clip_eps" in msg and "kl_coef" in msg
    assert "did you mean 'lr'" in msg


def test_unknown_top_level_section(tmp_path):
    with pytest.raises(UnknownKeyError, match="did you mean 'rollout'") as info:
        load_config(_write(tmp_path, "rollot:\n  threads: 1\n"))
    assert info.value.key == "rollot"


def test_unknown_key_in_override():
    with pytest.raises(UnknownKeyError, match="did you mean 'temperature'") as info:
        load_config(None, ["rollout.temprature=0.7"])
    assert info.value.key == "rollout.temprature"


def test_override_below_a_value_is_rejected():
    with pytest.raises(UnknownKeyError, match="'run.iterations' is a value, not a section"):
        load_config(None, ["run.iterations.x=1"])


@pytest.mark.parametrize(
    "override,key,expected",
    [
        ("trainer.lr=fast", "trainer.lr", "expected float, got 'fast'"),
        ("run.iterations=2.5", "run.iterations", "expected int, got 2.5"),
        ("run.progress=1", "run.progress", "expected bool, got 1"),
        ("data.operations=+", "data.operations", "expected list of"),
        ("trainer.betas=[0.9]", "trainer.betas", "expected list of 2"),
        ("run.iterations=true", "run.iterations", "expected int, got True"),
    ],
)
def test_wrong_type_names_key_expected_and_value(override, key, expected):
    with pytest.raises(ConfigTypeError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert expected in str(info.value)


def test_strict_bool_in_file(tmp_path):
    with pytest.raises(ConfigTypeError, match="run.progress: expected bool, got 'yes please'"):
        load_config(_write(tmp_path, "run:\n  progress: yes please\n"))


def test_section_must_be_mapping(tmp_path):
    with pytest.raises(ConfigTypeError) as info:
        load_config(_write(tmp_path, "trainer: 3\n"))
    assert info.value.key == "trainer" and "mapping" in str(info.value)


@pytest.mark.parametrize(
    "override,key,choices",
    [
        ("run.mode=fast", "run.mode", "'sync', 'periodic', 'async'"),
        ("rollout.engine=tgi", "rollout.engine", "'torch', 'vllm'"),
        ("data.operations=['/']", "data.operations[0]", "'+', '-', '*'"),
        ("model.dtype=float16", "model.dtype", "'float32', 'bfloat16'"),
    ],
)
def test_bad_enum_lists_choices(override, key, choices):
    with pytest.raises(ConfigValueError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert choices in str(info.value)


@pytest.mark.parametrize(
    "override,key,text",
    [
        ("rollout.top_p=1.5", "rollout.top_p", "must be > 0 and <= 1, got 1.5"),
        ("data.group_size=1", "data.group_size", "GRPO advantages"),
        ("run.max_staleness=-1", "run.max_staleness", "must be >= 0"),
        ("trainer.betas=[0.9, 1.0]", "trainer.betas", "[0, 1)"),
        ("model.builtin.num_heads=3", "model.builtin.num_heads", "must divide hidden_size"),
        ("reward.fn=not a name", "reward.fn", "module.path:function"),
        ("run.eval_prompts=0", "run.eval_prompts", "eval_every=0"),
        ("data.task=file", "data.file", "required when data.task is 'file'"),
    ],
)
def test_invalid_values(override, key, text):
    with pytest.raises(ConfigValueError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert text in str(info.value)


def test_cross_field_packing_budget():
    with pytest.raises(ConfigValueError) as info:
        load_config(
            None,
            ["trainer.packing=true", "trainer.token_budget=10", "rollout.max_new_tokens=8"],
        )
    assert info.value.key == "trainer.token_budget"
    assert "data.group_size" in str(info.value)


@pytest.mark.parametrize(
    "override", ["trainer.lr", "=3", "trainer..lr=1", "trainer.lr 1e-4", "1trainer=2"]
)
def test_bad_override_syntax(override):
    with pytest.raises(OverrideSyntaxError, match="key.sub=value"):
        load_config(None, [override])


def test_yaml_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "run: [unclosed\n"))
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(_write(tmp_path, "run:\n  seed: 1\n  seed: 2\n"))
    with pytest.raises(ConfigTypeError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_fills_values_only(tmp_path):
    # Tags that would construct Python objects are refused by the safe loader.
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "run:\n  name: !!python/object/apply:os.getcwd []\n"))
    assert load_config(_write(tmp_path, "")) == RunConfig()


@pytest.mark.parametrize("placement", ["worker", "trainer", "rollout"])
def test_kl_coef_alone_says_whether_a_reference_runs(placement):
    on = load_config(None, [f"reference.placement={placement}"])
    assert on.kl_active and on.reference_worker == (placement == "worker")
    assert on.reference_in_rollout == (placement == "rollout")
    assert on.reference_in_store == (placement != "trainer")
    off = load_config(None, [f"reference.placement={placement}", "trainer.kl_coef=0"])
    assert not (off.kl_active or off.reference_worker or off.reference_in_rollout
                or off.reference_in_store)
    notes = config_warnings(off)
    assert (placement != "worker") == any("no effect with trainer.kl_coef 0" in n for n in notes)


def test_a_removed_key_fails_in_one_line_pointing_at_the_new_way(tmp_path):
    yaml_file = _write(tmp_path, "reference:\n  enabled: false\n")
    for load in (lambda: load_config(yaml_file), lambda: load_config(None, [
            "reference.enabled=true"])):
        with pytest.raises(UnknownKeyError) as info:
            load()
        assert info.value.key == "reference.enabled" and "\n" not in str(info.value)
        assert "set trainer.kl_coef: 0 to run without a reference" in str(info.value)
    for key, pointer in RENAMED_KEYS.items():  # each entry is reached (no section declares it)
        with pytest.raises(UnknownKeyError, match=f"^{key}: ") as info:
            load_config(None, [f"{key}=1"])
        assert str(info.value) == f"{key}: {pointer}"


def test_max_staleness_by_mode_and_warnings():
    assert load_config(None, ["run.mode=async"]).max_staleness == 1
    assert load_config(None, ["run.mode=async", "run.max_staleness=0"]).max_staleness == 0
    assert config_warnings(load_config(None, ["run.mode=sync"])) == []  # defaults never warn
    periodic = load_config(None, ["run.mode=periodic", "run.max_staleness=3"])
    assert periodic.max_staleness == 0
    assert any("run.max_staleness=3 is ignored" in w for w in config_warnings(periodic))
    assert config_warnings(load_config(None, ["run.mode=async", "run.max_staleness=3"])) == []


def test_warmstart_steps_warns_with_a_model_path_only_when_set_to_run():
    def warned(*overrides: str) -> bool:
        cfg = load_config(None, ["model.path=models/mine", *overrides])
        return any("model.warmstart_steps" in w for w in config_warnings(cfg))

    assert not warned()  # the default (the demo's cap) says nothing about a user's model
    assert not warned("model.warmstart_steps=0")
    assert warned("model.warmstart_steps=5")


def test_sections_are_frozen_and_validate_on_construction():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigValueError) as info:
        TrainerSection(lr=-1.0)
    assert info.value.key == "lr"


def test_dump_yaml_is_plain_yaml():
    text = dump_yaml(load_config(None, ["run.name=demo"]))
    data = yaml.safe_load(text)
    assert data["run"]["name"] == "demo" and data["run"]["output_dir"] == "runs/demo"
    assert set(data) == {f.name for f in dataclasses.fields(RunConfig)}


def test_non_finite_floats_rejected():
    with pytest.raises(ConfigValueError, match="trainer.lr: must be a finite number"):
        load_config(None, ["trainer.lr=.inf"])


@settings(max_examples=40, deadline=None)
@given(
    lr=st.floats(min_value=1e-12, max_value=10.0),
    kl=st.floats(min_value=0.0, max_value=1.0),
    iterations=st.integers(min_value=1, max_value=10**6),
    mode=st.sampled_from(["sync", "periodic", "async"]),
    ops=st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True),
    name=st.text(alphabet="abcxyz019_-: '\"#", min_size=1, max_size=12).filter(str.strip),
)
def test_dump_load_round_trip_property(tmp_path_factory, lr, kl, iterations, mode, ops, name):
    cfg = config_from_dict(
        {
            "run": {"name": name, "mode": mode, "iterations": iterations},
            "trainer": {"lr": lr, "kl_coef": kl},
            "data": {"operations": ops},
        }
    )
    path = tmp_path_factory.mktemp("rt") / "c.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


def test_embedded_worker_settings_are_flat_keys_of_their_section():
    from workers.settings import GrpoSettings, OptimizerSettings, SamplingSettings

    cfg = load_config(None, ["trainer.lr=0.5", "trainer.is_cap=3", "rollout.temperature=0.7"])
    assert cfg.trainer.optim == OptimizerSettings(lr=0.5) and cfg.trainer.lr == 0.5
    assert cfg.trainer.grpo == GrpoSettings(is_cap=3.0)
    assert cfg.rollout.sampling == SamplingSettings(temperature=0.7)
    tree = config_to_dict(cfg)
    assert tree["trainer"]["lr"] == 0.5 and tree["rollout"]["temperature"] == 0.7
    assert not {"optim", "grpo", "pack", "sampling", "vllm", "generate", "verifier"} & {
        key for section in tree.values() if isinstance(section, dict) for key in section}
    # Built or replaced with flat keys too, and checked where the field is declared.
    assert dataclasses.replace(cfg.trainer, kl_coef=0.0).grpo.kl_coef == 0.0
    assert TrainerSection(clip_eps=0.1).grpo.clip_eps == 0.1
    with pytest.raises(ConfigValueError) as info:
        load_config(None, ["rollout.top_p=2"])
    assert info.value.key == "rollout.top_p"
    with pytest.raises(ConfigValueError, match="simulated.skew: must be"):
        load_config(None, ["simulated.skew=9"])


def test_reference_placement_rollout_routes_ref_logprobs_through_the_store():
    cfg = load_config(None, ["reference.placement=rollout"])
    assert cfg.reference_in_rollout and cfg.reference_in_store and not cfg.reference_worker
    fused = load_config(None, ["reference.placement=trainer"])
    assert not fused.reference_in_store and not fused.reference_in_rollout
    off = load_config(None, ["reference.placement=rollout", "trainer.kl_coef=0"])
    assert not off.reference_in_rollout and not off.reference_in_store  # no KL: nobody scores
    assert config_warnings(cfg) == []
    assert any("reference.threads and reference.device apply to a reference worker" in w
               for w in config_warnings(load_config(None, ["reference.placement=rollout",
                                                           "reference.threads=2"])))
    with pytest.raises(ConfigValueError) as info:  # a simulated rollout has no model to score with
        load_config(None, ["reference.placement=rollout", "rollout.engine=simulated",
                           "trainer.engine=simulated", "run.eval_every=0"])
    assert info.value.key == "reference.placement" and "real rollout engine" in str(info.value)
