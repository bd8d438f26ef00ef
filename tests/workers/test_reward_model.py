"""Reward models (workers/models/reward_model.py) and the reward role's use of them: a tiny
classifier and a tiny judge built here from transformers config classes (no download) score
batches as a direct transformers call on each row alone does; combine and normalise rules."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from storage.schema import Lease
from workers.checked import ConfigValueError
from workers.models.reward_model import HFRewardModel
from workers.models.reward_text import model_kind, parse_score, render
from workers.models.tokenizer import build_char_tokenizer
from workers.roles.reward import RewardStage, RunningStats, group_normalized
from workers.settings import RewardModelSettings
from workers.tasks.verifiers import RewardResult

PROMPTS = ["12+34=", "7+8=", "99+1=", "3+4=", "50+50="]
RESPONSES = ["46", "15", "1000", "8", "100"]
ANSWERS = ["46", "15", "100", "7", "100"]
CPU = {"device": "cpu", "dtype": "float32"}  # where and how the reward model runs here


def _tiny(tmp_path_factory, cls_name: str, **extra) -> str:
    import transformers

    tok = build_char_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    out = tmp_path_factory.mktemp(cls_name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "Qwen2ForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "Qwen2ForCausalLM")


def test_a_classifier_scores_a_batch_as_each_row_alone(classifier):
    # rows of different lengths, 2 per forward: padding and chunking must not change a score
    # (breaks if the score were read at a pad position or rows were reordered)
    rm = HFRewardModel(RewardModelSettings(model=classifier, rows_per_forward=2), **CPU)
    got = rm.score(PROMPTS, RESPONSES, ANSWERS)
    tok = build_char_tokenizer()
    with torch.no_grad():
        want = [float(rm.model(**tok(p + r, return_tensors="pt")).logits[0, 0])
                for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert all(r.ok for r in got)
    assert [r.score for r in got] == pytest.approx(want, abs=1e-5)
    assert len(set(want)) > 1  # the rows differ: a constant score would pass nothing
    rm.settings = RewardModelSettings(model=classifier, classifier_score="probability")
    probs = [r.score for r in rm.score(PROMPTS, RESPONSES, ANSWERS)]
    assert probs == pytest.approx([1 / (1 + math.exp(-w)) for w in want], abs=1e-5)


def test_a_judge_reads_the_probability_of_its_tokens(judge):
    s = RewardModelSettings(model=judge, template="{prompt}{response}={answer}=",
                            judge_tokens=("1", "0"), rows_per_forward=3)
    rm = HFRewardModel(s, **CPU)
    got = rm.score(PROMPTS, RESPONSES, ANSWERS)
    tok = build_char_tokenizer()
    one, zero = (tok(t, add_special_tokens=False)["input_ids"][0] for t in ("1", "0"))
    want = []
    with torch.no_grad():
        for p, r, a in zip(PROMPTS, RESPONSES, ANSWERS, strict=True):
            probs = rm.model(**tok(f"{p}{r}={a}=", return_tensors="pt")).logits[0, -1].softmax(-1)
            want.append(float(probs[one] / (probs[one] + probs[zero])))
    assert [r.score for r in got] == pytest.approx(want, abs=1e-5)
    assert all(0 < r.score < 1 for r in got)


def test_a_parsing_judge_takes_the_first_number_of_its_greedy_answer(judge):
    s = RewardModelSettings(model=judge, template="{prompt}{response}=", judge="parse",
                            judge_max_tokens=4, rows_per_forward=2)
    rm = HFRewardModel(s, **CPU)
    got = rm.score(PROMPTS, RESPONSES, ANSWERS)
    tok = build_char_tokenizer()
    with torch.no_grad():
        for (p, r), res in zip(zip(PROMPTS, RESPONSES, strict=True), got, strict=True):
            enc = tok(f"{p}{r}=", return_tensors="pt")
            gen = rm.model.generate(**enc, do_sample=False, max_new_tokens=4,
                                    pad_token_id=tok.pad_token_id)
            text = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            assert res == parse_score(text)
    assert parse_score("score: 7 of 10") == RewardResult(7.0, True)
    assert not parse_score("yes").ok


def test_the_chat_template_the_model_ships_wraps_the_text(classifier):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}({{ m['content'] }}){% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    s = RewardModelSettings(model=classifier)
    assert render(s, tok, "classifier", "1+2=", "3", "3") == "(1+2=)(3)"
    judge = RewardModelSettings(model=classifier, template="{prompt}{response} {answer}")
    assert render(judge, tok, "judge", "1+2=", "3", "3") == "(1+2=3 3)="
    off = RewardModelSettings(model=classifier, chat_template=False)
    assert render(off, tok, "classifier", "1+2=", "3", "3") == "1+2=3"


def test_bad_directories_and_templates_name_their_key(tmp_path, classifier, judge):
    with pytest.raises(ConfigValueError, match="^model: .* is not a directory"):
        model_kind(RewardModelSettings(model=str(tmp_path / "none")))
    with pytest.raises(ConfigValueError, match="^model: .*no config.json"):
        model_kind(RewardModelSettings(model=str(tmp_path)))
    with pytest.raises(ConfigValueError, match="^template: a judge"):
        model_kind(RewardModelSettings(model=judge))
    assert model_kind(RewardModelSettings(model=classifier)) == "classifier"
    with pytest.raises(ConfigValueError, match="^engine: vllm serves a judge; .* classifier"):
        model_kind(RewardModelSettings(model=classifier, engine="vllm"))
    with pytest.raises(ConfigValueError, match=r"^template: has unknown field\(s\) \['question'\]"):
        RewardModelSettings(template="{question}{response}")
    with pytest.raises(ConfigValueError, match="^template: must contain {response}"):
        RewardModelSettings(template="{prompt}")
    with pytest.raises(ConfigValueError, match="^template: is not a valid template"):
        RewardModelSettings(template="{response")


class _Fixed:
    """A reward model that returns preset scores (and records what it was asked)."""

    kind = "classifier"

    def __init__(self, scores: list[float]) -> None:
        self.scores, self.seen = scores, []

    def score(self, prompts, responses, answers):
        self.seen.append((list(prompts), list(responses), list(answers)))
        return [RewardResult(s, True) for s in self.scores]


def _stage(scores: list[float], **settings) -> tuple[RewardStage, _Fixed]:
    fixed = _Fixed(scores)
    stage = RewardStage(build_char_tokenizer(), "exact_match", timeout_s=2.0, max_rows=8,
                        on_error="retry", env_reward="replace", scorer=fixed,
                        scoring=RewardModelSettings(model="m", **settings))
    return stage, fixed


def _lease(stage: RewardStage, groups: list[int]) -> Lease:
    tok = build_char_tokenizer()
    n = len(groups)
    batch = pa.RecordBatch.from_pydict({
        "row_id": list(range(n)),
        "response_ids": [tok(r, add_special_tokens=False)["input_ids"] for r in RESPONSES[:n]],
        "answer": ANSWERS[:n], "iteration": [0] * n, "group_id": groups,
        "prompt_ids": [tok(p)["input_ids"] for p in PROMPTS[:n]]})
    return Lease(1, "t", "reward", 0, 0.0, batch)


def test_the_stage_combines_the_model_with_the_verifier():
    # exact_match on the rows: 1, 1, 0, 0 (rows 2 and 3 are wrong)
    scores = [0.5, -1.0, 2.0, 0.25]
    for combine, want in (("model", scores), ("sum", [2 * s + 0.5 * v for s, v in
                                                      zip(scores, [1, 1, 0, 0], strict=True)]),
                          ("gate", [0.5, -1.0, 0.0, 0.0])):
        stage, fixed = _stage(scores, combine=combine, model_weight=2.0, verifier_weight=0.5)
        assert "prompt_ids" in stage.columns and not stage.whole_groups
        out = stage.process(_lease(stage, [0, 0, 1, 1]))
        assert out.column("reward").to_pylist() == pytest.approx(want), combine
        assert fixed.seen[0][0] == PROMPTS[:4]  # the decoded prompt, without special tokens


def test_group_and_running_normalisation():
    stage, _ = _stage([1.0, 3.0, 5.0, 5.0], normalize="group")
    assert stage.whole_groups  # a group is normalised whole
    out = stage.process(_lease(stage, [0, 0, 1, 1])).column("reward").to_pylist()
    assert out == pytest.approx([-1.0, 1.0, 0.0, 0.0], abs=1e-5)  # group 1 has no spread
    assert group_normalized([1.0, 9.0, 3.0], [True, False, True], [0, 0, 0]) == \
        pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)  # a failed row neither counts nor scores
    stats = RunningStats()
    stats.update([1.0, 2.0, 3.0, 4.0])
    assert (stats.mean, stats.std) == pytest.approx((2.5, math.sqrt(1.25)))
    stage, _ = _stage([2.0, 4.0], normalize="running")
    first = stage.process(_lease(stage, [0, 0])).column("reward").to_pylist()
    assert first == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert stage.running.count == 2


def test_train_reward_labels_the_policys_responses_and_saves_a_classifier(tmp_path_factory,
                                                                          tmp_path):
    # a random tiny policy, 6 prompts x 2 responses, two epochs and no target: what is checked
    # is the pipeline (labels from the verifier, a directory the reward role loads, the
    # manifest's reuse), not the accuracy (docs/rewards.md measures that)
    from workers.models.reward_train import RewardRecipe, read_manifest, train_reward_model
    from workers.tasks.arithmetic import ArithmeticTask

    policy = _tiny(tmp_path_factory, "Qwen2ForCausalLM")
    task = ArithmeticTask(digits=1, operations=("+",), seed=0)
    train, held = task.train_problems(6), task.eval_problems(3)
    val = [p for p in task.train_problems(12) if p not in train][:2]
    recipe = RewardRecipe(seed=0, temperature=1.0, max_new_tokens=3, target_accuracy=0.0,
                          max_epochs=2, prompts=6, samples=2, batch_size=4, edits=1)
    settings = RewardModelSettings(template="{prompt}{response}={answer}")
    # "brevity" scores every response above 0: all positive, whatever the random policy says
    report = train_reward_model(tmp_path / "rm", policy, train, held, recipe=recipe,
                                validation_problems=val, settings=settings, verifier="brevity",
                                threshold=0.0, timeout_s=2.0)
    # per training prompt: 2 responses, 1 edit of the answer, the answer; held out and
    # validation: responses
    assert (report.train_responses, report.heldout_responses) == (6 * 4, 3 * 2)
    assert report.validation_responses == 2 * 2
    assert report.train_positive_fraction == 1.0 and not report.reused
    # no target: both epochs ran, the better one kept, no cap "hit"
    assert (report.epochs, report.cap_hit) == (2, False) and report.best_epoch in (1, 2)
    history = read_manifest(tmp_path / "rm")["validation_history"]
    assert len(history) == 2 and report.validation_accuracy == max(history)
    rm = HFRewardModel(RewardModelSettings(model=str(tmp_path / "rm"),
                                           template=settings.template), **CPU)
    assert rm.kind == "classifier" and len(rm.score(PROMPTS, RESPONSES, ANSWERS)) == 5
    assert read_manifest(tmp_path / "rm")["report"]["heldout_accuracy"] == report.heldout_accuracy
    again = train_reward_model(tmp_path / "rm", policy, train, held, recipe=recipe,
                               validation_problems=val, settings=settings, verifier="brevity",
                               threshold=0.0, timeout_s=2.0)
    assert again.reused and again.heldout_accuracy == report.heldout_accuracy


def test_an_edit_of_the_answer_is_one_character_away_from_it():
    import random

    from workers.models.reward_train import edit

    draw = random.Random(0)
    edits = [edit("46", draw) for _ in range(60)]
    for e in edits:  # breaks if an edit changed the length by more than one character
        assert abs(len(e) - 2) <= 1 and all(c.isdigit() for c in e)
        # (a digit replaced by itself gives the answer back: the verifier labels it correct)
    assert {len(e) for e in edits} == {1, 2, 3}  # added, dropped and replaced all drawn
    assert edit("", random.Random(1)) != ""  # an empty answer can only grow


class _Scorer(torch.nn.Module):
    """A stand-in classifier for ``_fit``: one logit per row from a learnt weight per token."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, input_ids, attention_mask):
        from types import SimpleNamespace

        return SimpleNamespace(logits=(self.w[input_ids] * attention_mask).sum(1, keepdim=True))


def _fit_run(scores: list[float], **recipe):
    """``_fit`` with a scripted validation accuracy per epoch; the weights after each epoch."""
    from workers.models.reward_train import RewardRecipe, _fit

    model, seen = _Scorer(), []
    enc = {"input_ids": torch.tensor([[1, 2], [3, 0]] * 4),
           "attention_mask": torch.ones(8, 2, dtype=torch.long)}
    labels = torch.tensor([1, 0] * 4)

    def validate() -> float:
        seen.append(model.w.detach().clone())
        return scores[len(seen) - 1]

    r = RewardRecipe(**{"seed": 0, "temperature": 1.0, "max_new_tokens": 3, "batch_size": 4,
                        "lr": 0.1, **recipe})
    return _fit(model, enc, labels, r, validate), model, seen


def test_reward_training_stops_at_its_target_and_keeps_the_best_epoch():
    fit, model, seen = _fit_run([0.5, 0.8, 0.7, 0.94, 0.99], target_accuracy=0.93, max_epochs=10)
    assert fit.history == [0.5, 0.8, 0.7, 0.94] and not fit.cap_hit  # stopped at the target
    assert (fit.best, fit.best_epoch) == (0.94, 4) and torch.equal(model.w, seen[3])


def test_reward_training_reports_the_cap_and_keeps_its_best_epoch():
    fit, model, seen = _fit_run([0.5, 0.8, 0.7, 0.75], target_accuracy=0.93, max_epochs=4)
    assert fit.history == [0.5, 0.8, 0.7, 0.75] and fit.cap_hit
    # the weights are epoch 2's (the best), not the last epoch's
    assert fit.best_epoch == 2 and torch.equal(model.w, seen[1])
    assert not torch.equal(model.w, seen[3])
    # no target: every epoch of the cap runs, and nothing is "hit"
    fit, _, _ = _fit_run([0.5, 0.99, 0.7], target_accuracy=0.0, max_epochs=3)
    assert (len(fit.history), fit.best_epoch, fit.cap_hit) == (3, 2, False)


def test_train_reward_records_and_logs_a_cap_hit(tmp_path_factory, tmp_path, monkeypatch,
                                                caplog):
    # a validation accuracy that never reaches the target (scripted: the model's own on a random
    # policy's responses could reach it by luck): the manifest and the log say "cap hit"
    from workers.models import reward_train
    from workers.tasks.arithmetic import ArithmeticTask

    policy = _tiny(tmp_path_factory, "Qwen2ForCausalLM")
    task = ArithmeticTask(digits=1, operations=("+",), seed=0)
    monkeypatch.setattr(reward_train, "_accuracy", lambda *a: 0.5)
    recipe = reward_train.RewardRecipe(seed=0, temperature=1.0, max_new_tokens=2,
                                       target_accuracy=0.9, max_epochs=2, prompts=4, samples=1,
                                       batch_size=4, edits=0)
    report = reward_train.train_reward_model(
        tmp_path / "rm", policy, task.train_problems(4), task.eval_problems(2), recipe=recipe,
        settings=RewardModelSettings(), verifier="brevity", threshold=0.0, timeout_s=2.0)
    assert (report.cap_hit, report.epochs, report.best_epoch) == (True, 2, 1)
    saved = reward_train.read_manifest(tmp_path / "rm")["report"]
    assert saved["cap_hit"] is True and saved["validation_accuracy"] == 0.5
    assert saved["heldout_accuracy"] == 0.5 and saved["target_accuracy"] == 0.9
    assert any("cap hit" in r.getMessage() for r in caplog.records)
