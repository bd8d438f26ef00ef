"""reward.model in a run config: the --dry-run's one-line errors, the cross-section rules, the
device placement of reward-model workers, and what the plan hands the reward workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.cli import main
from streamflow.config import ConfigValueError, config_warnings, load_config
from streamflow.devices import resolve_devices

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _dry_run(capsys, *overrides: str) -> tuple[int, str]:
    rc = main(["run", TINY, "--dry-run", "run.output_dir=/nonexistent/rm", *overrides])
    return rc, capsys.readouterr().err.strip()


def _fake_model(path: Path, arch: str, **config) -> str:
    path.mkdir()
    import json

    (path / "config.json").write_text(json.dumps({"architectures": [arch], **config}))
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def test_missing_models_and_bad_templates_are_one_line_errors_at_dry_run(capsys, tmp_path):
    # each breaks if the check moved past the dry run (the run would fail after its warm start)
    rc, err = _dry_run(capsys, f"reward.model={tmp_path / 'absent'}")
    assert rc == 2 and err.startswith(f"error: reward.model: {tmp_path / 'absent'} is not a "
                                      "directory (`streamflow model train-reward")
    assert "\n" not in err
    rc, err = _dry_run(capsys, "reward.model=" + _fake_model(tmp_path / "j", "Qwen2ForCausalLM"))
    assert rc == 2 and err.startswith("error: reward.template: a judge (Qwen2ForCausalLM")
    assert "\n" not in err
    rc, err = _dry_run(capsys, "reward.template='{prompt} {reply}'")
    assert rc == 2 and err.startswith("error: reward.template: has unknown field(s) ['reply']")
    two = _fake_model(tmp_path / "c2", "Qwen2ForSequenceClassification", num_labels=2)
    rc, err = _dry_run(capsys, f"reward.model={two}")
    assert rc == 2 and "2 labels; a reward model has one" in err
    ok = _fake_model(tmp_path / "c1", "Qwen2ForSequenceClassification", num_labels=1)
    rc, err = _dry_run(capsys, f"reward.model={ok}", "reward.combine=gate")
    assert rc == 0, err
    rc, err = _dry_run(capsys, f"reward.model={ok}", "reward.engine=vllm")
    assert rc == 2 and err.startswith("error: reward.engine: vllm serves a judge;"), err



def _trained(path: Path, accuracy: float | None) -> str:
    """A classifier directory as train-reward leaves it (a manifest recording ``accuracy``),
    or without a manifest (``None``: a user's own reward model)."""
    import json

    model = _fake_model(path, "Qwen2ForSequenceClassification", num_labels=1)
    if accuracy is not None:
        (path / "reward_manifest.json").write_text(json.dumps(
            {"key": {}, "report": {"heldout_accuracy": accuracy, "cap_hit": False}}))
    return model


def test_a_reward_model_below_min_accuracy_is_refused_unless_asked(capsys, tmp_path):
    weak = _trained(tmp_path / "weak", 0.636)
    rc, err = _dry_run(capsys, f"reward.model={weak}")
    assert rc == 2 and "\n" not in err
    assert err.startswith(f"error: reward.min_accuracy: {weak} records a held-out accuracy of "
                          "0.636 (reward_manifest.json), below 0.85"), err
    assert "reward.allow_weak=true" in err
    # a run is refused the same way before anything is built (the check runs before the warm
    # start; run.output_dir is never created)
    assert main(["run", TINY, "run.output_dir=" + str(tmp_path / "never"),
                 f"reward.model={weak}"]) == 2
    assert capsys.readouterr().err.startswith("error: reward.min_accuracy:")
    assert not (tmp_path / "never").exists()
    # asked: allow_weak (with a note saying so), or no minimum, or a lower one
    rc, err = _dry_run(capsys, f"reward.model={weak}", "reward.allow_weak=true")
    assert rc == 0 and "note: reward.allow_weak: starting from reward.model" in err, err
    assert _dry_run(capsys, f"reward.model={weak}", "reward.min_accuracy=0")[0] == 0
    assert _dry_run(capsys, f"reward.model={weak}", "reward.min_accuracy=0.6")[0] == 0
    good = _trained(tmp_path / "good", 0.95)
    rc, err = _dry_run(capsys, f"reward.model={good}")
    assert rc == 0 and "note:" not in err, err


def test_a_reward_model_without_a_manifest_runs_with_a_note(capsys, tmp_path):
    own = _trained(tmp_path / "own", None)
    rc, err = _dry_run(capsys, f"reward.model={own}")
    assert rc == 0, err
    assert f"note: reward.model {own} records no accuracy" in err
    assert "note:" not in _dry_run(capsys, f"reward.model={own}", "reward.min_accuracy=0")[1]


def test_a_vllm_judge_without_vllm_installed_is_refused_at_dry_run(capsys, tmp_path, monkeypatch):
    import importlib.util

    judge = _fake_model(tmp_path / "j", "Qwen2ForCausalLM")
    ok = [f"reward.model={judge}", "reward.template={response}"]
    assert _dry_run(capsys, *ok, "reward.engine=vllm")[0] == 0
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    rc, err = _dry_run(capsys, *ok, "reward.engine=vllm")
    assert rc == 2 and err.startswith("error: reward.engine: vllm: the vllm package is not "
                                      "installed"), err
    assert _dry_run(capsys, *ok)[0] == 0  # the torch judge needs no vllm


def test_rules_across_sections():
    with pytest.raises(ConfigValueError, match="^reward.model: needs real engines"):
        load_config(str(ROOT / "configs" / "simulated.yaml"), ["reward.model=/m"])
    with pytest.raises(ConfigValueError, match="^reward.model: scores single-turn"):
        load_config(TINY, ["reward.model=/m", "rollout.max_turns=2"])
    with pytest.raises(ConfigValueError, match="^reward.rows_per_claim: 2 is smaller"):
        load_config(TINY, ["reward.model=/m", "reward.normalize=group",
                           "reward.rows_per_claim=2", "data.group_size=4"])
    notes = config_warnings(load_config(TINY, ["reward.combine=sum"]))
    assert any("without reward.model" in n for n in notes)


def test_reward_model_workers_are_placed_by_the_devices_rules():
    base = ["reward.model=/m", "reward.num_workers=2", "run.mode=periodic", "trainer.kl_coef=0"]
    d = resolve_devices(load_config(TINY, base), gpus=8)  # separate: after trainer and rollout
    assert d.reward == ("cuda:2", "cuda:3") and d.rollout == ("cuda:1",)
    assert d.reward_dtype == "bfloat16"
    d = resolve_devices(load_config(TINY, base), gpus=2)  # too few: colocated on GPU 0
    assert d.reward == ("cuda:0", "cuda:0") and d.trainer == "cuda:0"
    with pytest.raises(ConfigValueError, match=r"\+ reward model 2\), 3 visible"):
        resolve_devices(load_config(TINY, [*base, "devices.placement=separate"]), gpus=3)
    d = resolve_devices(load_config(TINY, ["reward.num_workers=2"]), gpus=8)  # a verifier
    assert d.reward == ("cpu", "cpu")
    d = resolve_devices(load_config(TINY, [*base, "reward.device=cpu"]), gpus=8)
    assert d.reward == ("cpu", "cpu") and d.reward_dtype == "float32"


def test_the_plan_hands_the_reward_model_to_every_reward_worker(tmp_path):
    # breaks if a worker lost the model, its device, or the whole-group claims that
    # normalize=group needs (the store refuses a whole-group claim of a task not declared so)
    from testkit import worker_plan

    cfg = load_config(TINY, ["reward.model=/m", "reward.normalize=group", "reward.num_workers=2",
                             "reward.classifier_score=probability"])
    plan = worker_plan(cfg, tmp_path)
    records = [rec for _, role, rec, _ in plan.workers(["tcp://127.0.0.1:1"], None)
               if role == "reward"]
    assert [r.scorer.model for r in records] == ["/m", "/m"]
    assert [r.model_device for r in records] == ["cpu", "cpu"]
    assert records[0].classifier_score == "probability"
    whole = {t.name: t.whole_groups for t in plan.table_spec.tasks}
    assert whole["reward"] is True
    plain = worker_plan(load_config(TINY, ["reward.model=/m"]), tmp_path / "b")
    assert not {t.name: t.whole_groups for t in plain.table_spec.tasks}["reward"]


def test_train_reward_validates_on_training_split_prompts_it_does_not_train_on():
    from streamflow.reward_model import split_validation
    from workers.tasks.problem import Problem

    pool = [Problem(f"{i % 7}+1=", str(i % 7 + 1)) for i in range(20)]  # repeats every 7
    train, val = split_validation(pool, 5, 3)
    assert [p.prompt for p in train] == [f"{i}+1=" for i in range(5)]
    assert [p.prompt for p in val] == ["5+1=", "6+1="]  # the rest repeat training prompts
    # a pool too short for both: validation takes its last fifth
    train, val = split_validation(pool[:5], 5, 3)
    assert (len(train), [p.prompt for p in val]) == (4, ["4+1="])
    assert split_validation(pool[:1], 5, 3)[0] == []  # nothing left to train on
    rc = main(["model", "train-reward", "/nonexistent/rm", "--config", TINY, "--epochs", "0"])
    assert rc == 2
