"""Held-out evaluation: a prompt file's eval rows are never trained on, its split is checked before
any warm start, accuracy is scored with the run's reward function and success threshold, and
published weights load strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from streamflow.plan import Evaluator, build_plan, resolve_model
from workers.engines.base import SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.models.local import load_model, load_tokenizer
from workers.models.tokenizer import decode_response, encode_prompt
from workers.tasks.verifiers import brevity
from workers.weights.file_sync import WeightPublisher, weights_path

ROWS = 20


def _file(tmp_path: Path, answers: list[str] | None = None) -> Path:
    path = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"{a}+{a + 1}=", "answer": answers[a] if answers else str(2 * a + 1)}
            for a in range(ROWS)]
    rows.append(dict(rows[3]))  # a duplicated prompt: both rows go to the same side
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _plan(tiny_config, tmp_path: Path, *overrides: str):
    cfg = tiny_config("data.task=file", f"data.file={_file(tmp_path)}", "run.eval_every=1",
                      "run.eval_prompts=4", *overrides)
    plan = build_plan(cfg, tmp_path / "run")
    plan.cleanup()
    return plan


def test_held_out_rows_of_a_prompt_file_are_never_trained(tiny_config, tmp_path: Path) -> None:
    plan = _plan(tiny_config, tmp_path)
    held = {p.prompt for p in plan.eval_problems}
    assert len(plan.eval_problems) == len(held) == 4
    train = {p.prompt for p in plan.train_problems}
    assert not held & train, "an eval prompt is also a training prompt"
    assert held | train == {f"{a}+{a + 1}=" for a in range(ROWS)}  # every prompt on one side
    for k in range(12):  # several epochs over the 16-17 training rows
        assert not {p.prompt for p in plan.problems(k)} & held
    # Deterministic (same file: same split, so resume sees the same data), whatever the seed.
    assert plan.eval_problems == _plan(tiny_config, tmp_path).eval_problems
    assert _plan(tiny_config, tmp_path, "data.seed=7").eval_problems == plan.eval_problems
    # Evaluation off: nothing is held out, every row trains.
    assert len(_plan(tiny_config, tmp_path, "run.eval_every=0").train_problems) == ROWS + 1


def test_a_split_holding_out_every_prompt_fails_before_the_warm_start(
    tiny_config, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    cfg = tiny_config("data.task=file", f"data.file={_file(tmp_path)}", "run.eval_every=1",
                      f"run.eval_prompts={ROWS}", f"run.output_dir={runs / 'x'}")
    with pytest.raises(ValueError, match=rf"run.eval_prompts={ROWS} holds out every prompt"):
        build_plan(cfg, runs / "x")
    assert not (runs / ".cache").exists()  # the built-in model was never warm-started


def _greedy(plan) -> dict[str, str]:
    model = load_model(plan.model_path, dtype=torch.float32,  # as the evaluator loads it
                       attn_implementation=plan.cfg.rollout.attn_implementation)
    engine = TorchRolloutEngine(model, plan.tokenizer, max_batch_size=256)
    problems = plan.eval_problems
    gens = engine.generate([encode_prompt(plan.tokenizer, p.prompt) for p in problems], 1,
                           SamplingParams(temperature=0.0,
                                          max_new_tokens=plan.cfg.rollout.max_new_tokens))
    return {p.prompt: decode_response(plan.tokenizer, g[0].token_ids)
            for p, g in zip(problems, gens, strict=True)}


def test_accuracy_scores_greedy_responses_with_the_configured_reward(
    tiny_config, tmp_path: Path
) -> None:
    # Answers: the initial model's own greedy output for even prompts, a wrong one for odd ones.
    cfg = tiny_config()
    model = load_model(resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache"),
                       dtype=torch.float32, attn_implementation=cfg.rollout.attn_implementation)
    tok = load_tokenizer(resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache"))
    engine = TorchRolloutEngine(model, tok, max_batch_size=256)
    gens = engine.generate([encode_prompt(tok, f"{a}+{a + 1}=") for a in range(ROWS)], 1,
                           SamplingParams(temperature=0.0, max_new_tokens=4))
    answers = [decode_response(tok, g[0].token_ids) if a % 2 == 0 else "no such answer"
               for a, g in enumerate(gens)]
    data = _file(tmp_path, answers)

    def evaluate(*overrides: str):  # noqa: ANN202 - (accuracy at version 0, the plan)
        run_cfg = tiny_config("data.task=file", f"data.file={data}", "run.eval_every=1",
                              "run.eval_prompts=8", "rollout.max_new_tokens=4", *overrides)
        plan = build_plan(run_cfg, tmp_path / "run")
        plan.cleanup()
        return Evaluator(plan).accuracy(0), plan

    exact, plan = evaluate("reward.fn=exact_match")
    solved = sum(1 for p in plan.eval_problems if p.answer != "no such answer")
    assert 0 < solved < len(plan.eval_problems)  # the seeded split drew both kinds
    assert exact == solved / len(plan.eval_problems)
    # The same greedy responses, scored by the run's reward function and threshold instead.
    assert evaluate("reward.fn=brevity", "reward.success_threshold=0.0")[0] == 1.0
    short, _ = evaluate("reward.fn=brevity", "reward.success_threshold=0.3")
    responses = _greedy(plan)
    want = sum(1 for p in plan.eval_problems if brevity(responses[p.prompt], p.answer) >= 0.3)
    assert short == want / len(plan.eval_problems)


def test_published_weights_load_strictly(tiny_config, tmp_path: Path) -> None:
    plan = _plan(tiny_config, tmp_path)
    plan.weights_dir = tmp_path / "weights"
    engine = TorchTrainerEngine(load_model(plan.model_path, dtype=torch.float32,
                                           attn_implementation="sdpa"), lr=1e-3,
                                fp64_accumulation=False)
    WeightPublisher(plan.weights_dir).publish(engine.state_dict(), 1)  # tied names included
    assert Evaluator(plan).accuracy(1) is not None
    state = dict(engine.state_dict())
    dropped = "model.norm.weight"
    save_file({k: v.contiguous() for k, v in state.items() if k != dropped},
              str(weights_path(plan.weights_dir, 2)))
    with pytest.raises(ValueError, match=f"missing keys \\['{dropped}'\\]"):
        Evaluator(plan).accuracy(2)
    extra = {k: v.clone().contiguous() for k, v in state.items()}
    extra["value_head.weight"] = torch.zeros(2)
    save_file(extra, str(weights_path(plan.weights_dir, 3)))
    with pytest.raises(ValueError, match=r"unexpected keys \['value_head.weight'\]"):
        Evaluator(plan).accuracy(3)


def test_a_multi_turn_run_is_evaluated_on_trajectories_with_its_environment(
        tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import streamflow.plan as plan_module

    seen: list[object] = []

    def spy(*args, agent=None, **kwargs):  # noqa: ANN001, ANN202
        seen.append(agent)
        return 0.5

    monkeypatch.setattr(plan_module, "greedy_accuracy", spy)
    for turns in (1, 2):
        (tmp_path / str(turns)).mkdir()
        plan = _plan(tiny_config, tmp_path / str(turns), f"rollout.max_turns={turns}",
                     "env.fn=calculator")
        assert Evaluator(plan).accuracy(0) == 0.5
    single, multi = seen
    assert single is None  # single-turn: one generation, as always
    assert (multi.max_turns, multi.fn, multi.format) == (2, "calculator", "plain")
