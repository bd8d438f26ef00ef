"""Warm start (SFT) determinism and learning, greedy evaluation, and the cached builtin directory."""

from __future__ import annotations

import json

import torch

from workers.engines.base import Generation, SamplingParams
from workers.models.local import TinyModelSpec, build_tiny_model, load_model
from workers.models.tokenizer import build_char_tokenizer, encode_answer
from workers.models.warmstart import MANIFEST, BuiltinRecipe, prepare_builtin, warm_start
from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.evaluate import exact_match_scorer, greedy_accuracy, reward_scorer

torch.set_num_threads(1)
SPEC = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
TASK = ArithmeticTask(digits=1, operations=("+",), seed=0)
FP32 = {"dtype": torch.float32, "attn_implementation": "eager"}  # how a saved model is read back


def test_warm_start_is_deterministic_and_learns():
    tok = build_char_tokenizer()
    a, b = build_tiny_model(SPEC, tok), build_tiny_model(SPEC, tok)
    first = warm_start(a, tok, TASK, steps=1, batch_size=16, lr=3e-3, seed=0,
                       tool_fraction=0.0).loss
    a = build_tiny_model(SPEC, tok)
    loss_a = warm_start(a, tok, TASK, steps=40, batch_size=16, lr=3e-3, seed=0,
                        tool_fraction=0.0).loss
    loss_b = warm_start(b, tok, TASK, steps=40, batch_size=16, lr=3e-3, seed=0,
                        tool_fraction=0.0).loss
    assert loss_a == loss_b
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert loss_a < 0.6 * first  # the answer loss falls (from ~ln(21) = 3.0)
    assert not a.training


class _OracleEngine:
    """Answers the prompts of ``wrong`` with a wrong answer, the others right: checks the
    evaluator's plumbing."""

    policy_version = 0

    def __init__(self, tok, problems, wrong) -> None:
        self.answers = {p.prompt: p.answer for p in problems}
        self.tok, self.wrong = tok, wrong

    def generate(self, prompts, n, params: SamplingParams):
        assert params.temperature == 0.0
        out = []
        for ids in prompts:
            prompt = self.tok.decode(ids, skip_special_tokens=True)
            answer = self.answers[prompt] + ("9" if prompt in self.wrong else "")
            ids = encode_answer(self.tok, answer)
            out.append([Generation(ids, [0.0] * len(ids), "stop")] * n)
        return out

    def load_weights(self, weights, version) -> None:
        raise NotImplementedError


def test_greedy_accuracy_scores_exact_match_of_greedy_outputs():
    tok = build_char_tokenizer()
    problems = TASK.eval_problems(5)
    every = {p.prompt for p in problems}

    def accuracy(wrong, **kw) -> float:
        return greedy_accuracy(_OracleEngine(tok, problems, wrong), tok, problems,
                               max_new_tokens=3, **kw)

    assert accuracy(set()) == 1.0
    assert accuracy(every) == 0.0
    assert accuracy({problems[0].prompt, problems[3].prompt}) == 3 / 5
    acc = greedy_accuracy(build_tiny_model(SPEC, tok), tok, problems, max_new_tokens=3)
    assert 0.0 <= acc <= 1.0


def test_the_warm_start_and_the_controller_score_through_the_one_evaluator():
    # The controller's scorer (reward.fn at its threshold) agrees with the warm start's exact
    # match on a 0/1 reward, and a scorer sees every greedy response with its answer, in order.
    tok = build_char_tokenizer()
    problems = TASK.eval_problems(6)
    engine = _OracleEngine(tok, problems, {problems[1].prompt, problems[4].prompt})
    exact = greedy_accuracy(engine, tok, problems, max_new_tokens=3, score=exact_match_scorer)
    controller = reward_scorer("exact_match", success_threshold=1.0, timeout_s=5.0)
    assert greedy_accuracy(engine, tok, problems, max_new_tokens=3, score=controller) == exact
    assert exact == 4 / 6
    seen = []

    def record(completions, answers):
        seen.extend(zip(completions, answers, strict=True))
        return [c.startswith("1") for c in completions]

    acc = greedy_accuracy(engine, tok, problems, max_new_tokens=3, score=record)
    wrong = {problems[1].prompt, problems[4].prompt}
    assert seen == [(p.answer + ("9" if p.prompt in wrong else ""), p.answer) for p in problems]
    assert acc == sum(c.startswith("1") for c, _ in seen) / 6
    lenient = reward_scorer("exact_match", success_threshold=0.0, timeout_s=5.0)
    assert greedy_accuracy(engine, tok, problems, max_new_tokens=3, score=lenient) == 1.0


def test_warm_start_stops_when_asked_and_reports_progress():
    tok = build_char_tokenizer()
    model = build_tiny_model(SPEC, tok)
    asked, seen = [], []

    def stop(step: int) -> bool:
        assert not model.training  # the stop rule evaluates in eval mode
        asked.append(step)
        return step >= 20

    result = warm_start(model, tok, TASK, steps=100, batch_size=4, lr=3e-3, seed=0,
                        tool_fraction=0.0, stop=stop, check_every=5,
                        progress=lambda i, n: seen.append((i, n)))
    assert result.steps == 20 and asked == [5, 10, 15, 20]
    assert seen == [(i, 100) for i in range(1, 21)]


def test_prepare_builtin_stops_at_the_target_on_a_fixed_thread_count(tmp_path):
    # The probe accuracy of an untrained model is 0: a target of 0.01 runs to the cap; the weights
    # must not depend on the caller's thread count (the warm start always runs on recipe.threads).
    recipe = BuiltinRecipe(spec=SPEC, digits=1, operations=("+",), task_seed=0, warmstart_steps=20,
                           batch_size=8, lr=1e-3, seed=0, eval_size=5, target_accuracy=0.01,
                           tool_fraction=0.0,
                           check_every=10, probe_size=8)
    torch.set_num_threads(2)
    try:
        two = prepare_builtin(tmp_path / "two", recipe=recipe)
    finally:
        torch.set_num_threads(1)
    one = prepare_builtin(tmp_path / "one", recipe=recipe)
    assert torch.get_num_threads() == 1  # restored
    a, b = (load_model(p, **FP32).state_dict() for p in (one, two))
    assert all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((one / MANIFEST).read_text())
    assert manifest["torch_threads"] == 1
    assert manifest["warmstart_steps_run"] in (10, 20)
    assert manifest["probe_accuracy"] is not None
    if manifest["probe_accuracy"] < 0.01:
        assert manifest["warmstart_steps_run"] == 20


def test_prepare_builtin_is_reproducible_and_cached(tmp_path):
    recipe = BuiltinRecipe(spec=SPEC, digits=1, operations=("+",), task_seed=0, warmstart_steps=4,
                           batch_size=8, lr=1e-3, seed=0, eval_size=5, target_accuracy=0.0,
                           tool_fraction=0.0)
    path = prepare_builtin(tmp_path / "m", recipe=recipe)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["recipe"]["warmstart_steps"] == 4
    assert 0.0 <= manifest["heldout_greedy_accuracy"] <= 1.0
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert prepare_builtin(tmp_path / "m", recipe=recipe) == path
    assert weights.stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = prepare_builtin(tmp_path / "m2", recipe=recipe)
    a, b = (load_model(p, **FP32).state_dict() for p in (path, other))
    assert all(torch.equal(a[k], b[k]) for k in a)  # same recipe -> same weights
    prepare_builtin(tmp_path / "m", recipe=recipe, warmstart_steps=5)  # recipe changed: rebuilt
    assert json.loads((path / MANIFEST).read_text())["recipe"]["warmstart_steps"] == 5
