"""``streamflow model train-reward``: a reward model trained on this machine from labelled
responses of the run's own policy (docs/rewards.md "A reward model of the demo").

The policy (the run's warm-started built-in model, or ``model.path``) samples ``samples``
responses to each of ``prompts`` training-split prompts at the rollout's temperature; the run's
verifier (``reward.fn`` against ``reward.success_threshold``) labels each one correct or not. A
sequence classifier is the policy's own backbone with a one-logit head
(``AutoModelForSequenceClassification`` over the policy's directory: the head is new), trained
with a class-balanced logistic loss on exactly the text the reward role gives it
(``workers.models.reward_text.render``).

Three sets of responses, on three sets of prompts: training (with edits of the answers), the
**validation** responses to further training-split prompts the classifier does not train on,
and the **held-out** responses to the run's evaluation prompts. Training goes on epoch by epoch
until the validation accuracy (logit > 0 = "correct") reaches ``target_accuracy``, at most
``max_epochs`` epochs (the cap; hitting it is reported), and keeps the epoch of the best
validation accuracy: how many epochs a seed needs differs between machines (float kernels change
the trajectory), so a fixed count made a model that was good on one machine and weak on another.
The held-out accuracy is measured once, on the kept model: neither the classifier nor the choice
of its epoch sees those responses, so it is the figure ``reward.min_accuracy`` is checked
against. Everything is seeded and runs on one torch thread. The directory is saved with
``save_pretrained`` plus a manifest (``reward_manifest.json``, ``workers.models.reward_manifest``);
``train_reward_model`` reuses a directory whose manifest holds the same recipe and policy.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from workers.engines.base import SamplingParams
from workers.models.local import load_model, load_tokenizer, save_model
from workers.models.reward_manifest import MANIFEST, read_manifest
from workers.models.reward_text import render
from workers.models.tokenizer import encode_prompt
from workers.settings import RewardModelSettings
from workers.tasks.problem import Problem
from workers.tasks.verifiers import RewardRunner

log = logging.getLogger("workers.models.reward_train")


@dataclass(frozen=True)
class RewardRecipe:
    """How a reward model is made (all of it goes into the manifest)."""

    # the run's (streamflow.reward_model): run.seed (sampling, head initialisation, batch
    # order), rollout.temperature and rollout.max_new_tokens
    seed: int
    temperature: float
    max_new_tokens: int
    # reward.train_target_accuracy and reward.train_max_epochs (streamflow.reward_model fills
    # them): no default of their own
    target_accuracy: float  # stop once the validation accuracy reaches this (0: no target)
    max_epochs: int  # the cap: passes over the labelled responses at most
    # the recipe's own
    prompts: int = 512  # training-split prompts whose responses are labelled
    samples: int = 4  # responses per prompt
    # edits of the reference answer per prompt (a character added, dropped or replaced), plus
    # the answer itself, labelled by the verifier beside the policy's responses (0: none)
    edits: int = 2
    validation_prompts: int = 128  # further training-split prompts: the stop rule's responses
    batch_size: int = 64
    # AdamW, constant after a 20-step warm-up: nothing may depend on the total step count, which
    # the target decides. Not halved on a plateau: a seed's validation accuracy often dips for
    # epochs (towards "always correct") before the classifier learns to compare the response with
    # the answer, and a smaller step there only stretches the dip (docs/rewards.md)
    lr: float = 3e-4
    threads: int = 1  # torch threads while training (same weights on any thread count)


@dataclass
class RewardReport:
    """What ``train_reward_model`` made and how well it judges."""

    out_dir: str
    train_responses: int
    train_positive_fraction: float
    train_accuracy: float
    heldout_responses: int
    heldout_positive_fraction: float
    heldout_accuracy: float  # logit > 0 agrees with the verifier on held-out prompts' responses
    seconds: float
    validation_responses: int = 0
    validation_accuracy: float = 0.0  # of the kept epoch (the best one)
    target_accuracy: float = 0.0
    epochs: int = 0  # epochs trained
    best_epoch: int = 0  # the kept one (1-based)
    cap_hit: bool = False  # the target was not reached within max_epochs
    reused: bool = False


def edit(answer: str, draw: random.Random) -> str:
    """The answer with one character appended, dropped or replaced by a digit: the near misses
    a policy searching a reward model tries, rare among a warm-started policy's own samples."""
    at = draw.randrange(len(answer) + 1)
    digit = str(draw.randrange(10))
    kind = draw.choice(("add", "drop", "swap")) if answer else "add"
    if kind == "add":
        return answer[:at] + digit + answer[at:]
    at = min(at, len(answer) - 1)
    return answer[:at] + (digit if kind == "swap" else "") + answer[at + 1:]


def sample_labelled(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    problems: Sequence[Problem], *, samples: int, temperature: float,
                    max_new_tokens: int, seed: int, verifier: str, threshold: float,
                    timeout_s: float, edits: int = 0
                    ) -> tuple[list[str], list[str], list[str], list[int]]:
    """(prompts, responses, answers, labels): ``samples`` responses per problem, then (``edits``
    > 0) that many edits of its reference answer and the answer itself, each labelled 1 when the
    verifier scores it ``>= threshold``."""
    from workers.engines.torch_rollout import TorchRolloutEngine

    engine = TorchRolloutEngine(model, tokenizer, max_batch_size=256)
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_token_ids=stops, seed=seed)
    gens = engine.generate([encode_prompt(tokenizer, p.prompt) for p in problems], samples, params)
    prompts, responses, answers = [], [], []
    draw = random.Random(f"reward-edits|{seed}")
    for p, group in zip(problems, gens, strict=True):
        texts = [tokenizer.decode(list(g.token_ids), skip_special_tokens=True) for g in group]
        texts += [edit(p.answer, draw) for _ in range(edits)] + [p.answer] * bool(edits)
        prompts += [p.prompt] * len(texts)
        responses += texts
        answers += [p.answer] * len(texts)
    with RewardRunner(verifier, timeout_s=timeout_s) as runner:
        scores = runner.score(responses, answers)
    return prompts, responses, answers, [int(r.ok and r.score >= threshold) for r in scores]


def _encode(tokenizer: PreTrainedTokenizerBase, settings: RewardModelSettings, rows: tuple[list[str], ...]
            ) -> dict[str, torch.Tensor]:
    """The rows (prompts, responses, answers, ...) as the reward role will encode them."""
    texts = [render(settings, tokenizer, "classifier", p, r, a) for p, r, a in
             zip(rows[0], rows[1], rows[2], strict=True)]
    chat = settings.chat_template and getattr(tokenizer, "chat_template", None)
    tokenizer.padding_side = "right"
    return tokenizer(texts, add_special_tokens=not chat, padding=True, return_tensors="pt")


def _logits(model: torch.nn.Module, enc: dict[str, torch.Tensor], rows: Sequence[int]
            ) -> torch.Tensor:
    idx = torch.as_tensor(list(rows))
    return model(input_ids=enc["input_ids"][idx],
                 attention_mask=enc["attention_mask"][idx]).logits[:, 0]


def _accuracy(model: torch.nn.Module, enc: dict[str, torch.Tensor], labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        logits = torch.cat([_logits(model, enc, range(i, min(i + 256, len(labels))))
                            for i in range(0, len(labels), 256)])
    return float(((logits > 0).long() == labels).float().mean())


def train_reward_model(out_dir: str | Path, policy_dir: str | Path,
                       train_problems: Sequence[Problem], heldout_problems: Sequence[Problem], *,
                       recipe: RewardRecipe, settings: RewardModelSettings,
                       validation_problems: Sequence[Problem] = (),
                       verifier: str, threshold: float, timeout_s: float,
                       force: bool = False) -> RewardReport:
    """Label the policy's responses, train the classifier to ``recipe.target_accuracy`` on the
    responses to ``validation_problems`` (none: on the training responses themselves), save it
    to ``out_dir``."""
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    key = {"recipe": asdict(recipe), "policy": str(Path(policy_dir).resolve()),
           "verifier": verifier, "threshold": threshold, "template": settings.template,
           "chat_template": settings.chat_template,
           "train_prompts": [p.prompt for p in train_problems[:8]],
           "validation_prompts": [p.prompt for p in validation_problems[:8]],
           "heldout_prompts": len(heldout_problems)}
    found = read_manifest(out)
    if not force and found is not None and found.get("key") == key:
        return RewardReport(**found["report"], reused=True)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(policy_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        # the labels' sampler: float32 and the eager attention, fixed here (not the run's
        # rollout.*), so that one recipe (the manifest's key) gives the same labels
        policy = load_model(policy_dir, dtype=torch.float32, attn_implementation="eager")
        sample = dict(samples=recipe.samples, temperature=recipe.temperature,
                      max_new_tokens=recipe.max_new_tokens, verifier=verifier,
                      threshold=threshold, timeout_s=timeout_s)
        train = sample_labelled(policy, tokenizer, train_problems, seed=recipe.seed,
                                edits=recipe.edits, **sample)
        # validation and held out: the policy's own responses only (what the reward model will
        # be asked)
        held = sample_labelled(policy, tokenizer, heldout_problems, seed=recipe.seed + 1,
                               **sample)
        val = sample_labelled(policy, tokenizer, validation_problems, seed=recipe.seed + 2,
                              **sample) if validation_problems else train
        del policy
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            model = AutoModelForSequenceClassification.from_pretrained(
                str(policy_dir), num_labels=1, local_files_only=True,
                attn_implementation="eager")
            model.config.pad_token_id = tokenizer.pad_token_id
            enc, labels = _encode(tokenizer, settings, train), torch.tensor(train[3])
            val_enc, val_labels = _encode(tokenizer, settings, val), torch.tensor(val[3])
            held_enc, held_labels = _encode(tokenizer, settings, held), torch.tensor(held[3])
            fit = _fit(model, enc, labels, recipe,
                       validate=lambda: _accuracy(model, val_enc, val_labels))
        report = RewardReport(
            out_dir=str(out), train_responses=len(labels),
            train_positive_fraction=float(labels.float().mean()),
            train_accuracy=_accuracy(model, enc, labels), heldout_responses=len(held_labels),
            heldout_positive_fraction=float(held_labels.float().mean()),
            heldout_accuracy=_accuracy(model, held_enc, held_labels),
            seconds=round(time.perf_counter() - t0, 1), validation_responses=len(val_labels),
            validation_accuracy=fit.best, target_accuracy=recipe.target_accuracy,
            epochs=len(fit.history), best_epoch=fit.best_epoch, cap_hit=fit.cap_hit)
    finally:
        torch.set_num_threads(threads)
    if report.cap_hit:
        log.warning("reward model: cap hit: validation accuracy %.3f after %d epochs (the cap, "
                    "reward.train_max_epochs), below the target %.3f "
                    "(reward.train_target_accuracy); kept epoch %d", report.validation_accuracy,
                    report.epochs, recipe.target_accuracy, report.best_epoch)
    save_model(model, tokenizer, out)
    saved = asdict(report)
    saved.pop("reused")
    # written last: a directory without it is never reused
    (out / MANIFEST).write_text(json.dumps({"key": key, "report": saved, "validation_history":
                                            fit.history}, indent=2) + "\n")
    return report


@dataclass
class FitResult:
    """What ``_fit`` did: the validation accuracy after each epoch, and the kept epoch's."""

    history: list[float]
    best: float
    best_epoch: int  # 1-based
    cap_hit: bool


def _fit(model: torch.nn.Module, enc: dict[str, torch.Tensor], labels: torch.Tensor,
         recipe: RewardRecipe, validate: Callable[[], float]) -> FitResult:
    """Class-balanced logistic loss on the logit (positives weighted by negatives / positives:
    a policy right a third of the time must not teach "always wrong"), epoch by epoch until
    ``validate()`` reaches the target or ``max_epochs`` ran; the model ends with the weights of
    its best epoch (the first of equals)."""
    positives = float(labels.sum())
    weight = torch.tensor((len(labels) - positives) / max(positives, 1.0))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(recipe.seed)
    steps = itertools.count()
    history: list[float] = []
    best, best_epoch, best_state = -1.0, 0, None
    for epoch in range(1, recipe.max_epochs + 1):
        model.train()
        perm = torch.randperm(len(labels), generator=order).tolist()
        for i in range(0, len(perm), recipe.batch_size):
            rows = perm[i:i + recipe.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = recipe.lr * min(1.0, (next(steps) + 1) / 20)
            loss = loss_fn(_logits(model, enc, rows), labels[rows].float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        history.append(round(validate(), 4))  # (_accuracy leaves the model in eval mode)
        log.info("reward model: epoch %d/%d, validation accuracy %.3f", epoch,
                 recipe.max_epochs, history[-1])
        if history[-1] > best:
            best, best_epoch = history[-1], epoch
            best_state = copy.deepcopy(model.state_dict())
        if 0 < recipe.target_accuracy <= history[-1]:
            break
    if best_state is not None and best_epoch != len(history):
        model.load_state_dict(best_state)
    model.eval()
    return FitResult(history, best, best_epoch,
                     cap_hit=0 < recipe.target_accuracy and best < recipe.target_accuracy)
