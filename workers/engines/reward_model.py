"""Reward models: a local Hugging Face model that scores (prompt, response, answer) in batches.

Two kinds, told apart by the directory's ``config.json`` (``model_kind``, no torch: the preflight
calls it at ``--dry-run``):
- a **classifier** (``*ForSequenceClassification`` with one label): its one logit is the score
  (or its sigmoid, ``classifier_score``), read at the last token of the text (right padding, so
  every row's positions are its own);
- a **judge** (``*ForCausalLM``) reading ``reward.template``: ``judge="tokens"`` scores
  P(judge_tokens[0]) / P(any judge token) at the next position (left padding with explicit
  position ids); ``judge="parse"`` decodes a greedy answer and takes its first number (none: a
  failed sample, handled by ``reward.on_error``).
The text is the template filled with the decoded prompt, response and answer (a classifier
without a template: prompt + response), wrapped in the model's own chat template when it ships
one and ``reward.chat_template`` is on. Rows are scored ``rows_per_forward`` at a time.

``RewardModel`` is the contract the reward role calls (``workers.roles.reward``); the module
imports torch only when a model is loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from workers.checked import ConfigValueError
from workers.settings import RewardModelSettings
from workers.tasks.verifiers import RewardResult

if TYPE_CHECKING:
    import torch

KINDS = {"ForSequenceClassification": "classifier", "ForCausalLM": "judge"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardModel(Protocol):
    """Scores a batch of responses, one ``RewardResult`` per row, in order; never raises for one
    bad sample (a judge answer without a number is ``ok=False``)."""

    kind: str  # "classifier" | "judge"

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str]) -> list[RewardResult]: ...


def model_kind(settings: RewardModelSettings) -> str:
    """"classifier" or "judge" for ``settings.model``; ``ConfigValueError`` naming the key (bare:
    ``model``, ``template``) when the directory or the template cannot work. No torch."""
    path = Path(str(settings.model))
    if not path.is_dir():
        raise ConfigValueError("model", f"{path} is not a directory (`streamflow model "
                               "train-reward DIR --config CONFIG` trains one)")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigValueError("model", f"{path} is not a Hugging Face model directory (no "
                               "config.json)") from None
    except (OSError, ValueError) as err:
        raise ConfigValueError("model", f"{path}/config.json is not readable JSON: {err}") from None
    if not [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]:
        raise ConfigValueError("model", f"{path} has no weights (*.safetensors or "
                               "pytorch_model*.bin)")
    archs = config.get("architectures") or []
    kinds = {kind for arch in archs for suffix, kind in KINDS.items() if arch.endswith(suffix)}
    if len(kinds) != 1:
        raise ConfigValueError("model", f"{path} is a {archs or 'model without architectures'}: "
                               "a reward model is a *ForSequenceClassification (one label) or a "
                               "*ForCausalLM judge")
    kind = kinds.pop()
    if kind == "classifier":
        labels = config.get("num_labels", len(config.get("id2label") or {0: ""}))
        if labels != 1:
            raise ConfigValueError("model", f"{path} classifies into {labels} labels; a reward "
                                   "model has one (its logit is the score)")
        if settings.engine == "vllm":
            raise ConfigValueError("engine", f"vllm serves a judge; {path} is a classifier "
                                   f"({archs[0]}): use engine=torch")
    elif not settings.template:
        raise ConfigValueError("template", f"a judge ({archs[0]} at {path}) needs a template "
                               "with {response} (and {prompt}, {answer} as it likes)")
    return kind


def render(settings: RewardModelSettings, tokenizer: Any, kind: str, prompt: str,
           response: str, answer: str) -> str:
    """The text the model reads for one row (see the module docstring)."""
    chat = settings.chat_template and getattr(tokenizer, "chat_template", None)
    if settings.template:
        text = settings.template.format(prompt=prompt, response=response, answer=answer)
        messages = [{"role": "user", "content": text}]
    else:  # a classifier without a template (model_kind refuses a judge without one)
        text = prompt + response
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": response}]
    if not chat:
        return text
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=kind == "judge")


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def judge_token_ids(settings: RewardModelSettings, tokenizer: Any) -> list[int]:
    """The ids of ``reward.judge_tokens`` (judge ``tokens`` mode; empty otherwise): one token
    each in the judge's tokenizer, or the one-line error naming the token."""
    if settings.judge != "tokens":
        return []
    out = []
    for token in settings.judge_tokens:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"reward.judge_tokens: {token!r} is {len(ids)} tokens of the "
                             f"judge's tokenizer, not one")
        out.append(int(ids[0]))
    return out


class HFRewardModel:
    """A classifier or judge loaded from ``settings.model`` onto ``device`` in ``dtype``."""

    def __init__(self, settings: RewardModelSettings, *, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        from workers.models.local import load_tokenizer
        from workers.runtime.devices import DTYPES, torch_device

        self.settings, self.kind = settings, model_kind(settings)
        path = str(settings.model)
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer.pad_token_id is None:  # batches need a pad id; eos is never scored
            self.tokenizer.pad_token = self.tokenizer.eos_token
        auto = AutoModelForSequenceClassification if self.kind == "classifier" else \
            AutoModelForCausalLM
        self.device = torch_device(device)
        self.model = auto.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype],
                                          attn_implementation="eager").to(self.device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.token_ids = judge_token_ids(settings, self.tokenizer) if self.kind == "judge" else []
        self._torch = torch

    def texts(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str]) -> list[str]:
        return [render(self.settings, self.tokenizer, self.kind, p, r, a)
                for p, r, a in zip(prompts, responses, answers, strict=True)]

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str]) -> list[RewardResult]:
        texts = self.texts(prompts, responses, answers)
        out: list[RewardResult] = []
        with self._torch.no_grad():
            for rows in _chunks(len(texts), self.settings.rows_per_forward):
                batch = [texts[i] for i in rows]
                if self.kind == "classifier":
                    out += [RewardResult(s, True) for s in self._classify(batch)]
                elif self.settings.judge == "tokens":
                    out += [RewardResult(s, True) for s in self._judge_tokens(batch)]
                else:
                    out += self._judge_parse(batch)
        return out

    def _encode(self, texts: list[str], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        # a chat template already holds the special tokens; plain text gets the tokenizer's own
        chat = self.settings.chat_template and getattr(self.tokenizer, "chat_template", None)
        self.tokenizer.padding_side = side
        enc = self.tokenizer(texts, add_special_tokens=not chat, padding=True,
                             return_tensors="pt")
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def _classify(self, texts: list[str]) -> list[float]:
        ids, mask = self._encode(texts, "right")
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        if self.settings.classifier_score == "probability":
            logits = logits.sigmoid()
        return [float(x) for x in logits.cpu()]

    def _positions(self, mask: torch.Tensor) -> torch.Tensor:
        return (mask.long().cumsum(-1) - 1).clamp(min=0)

    def _judge_tokens(self, texts: list[str]) -> list[float]:
        ids, mask = self._encode(texts, "left")
        logits = self.model(input_ids=ids, attention_mask=mask,
                            position_ids=self._positions(mask)).logits[:, -1].float()
        probs = logits.softmax(-1)[:, self.token_ids]
        return [float(p[0] / p.sum()) if float(p.sum()) > 0 else 0.0 for p in probs.cpu()]

    def _judge_parse(self, texts: list[str]) -> list[RewardResult]:
        ids, mask = self._encode(texts, "left")
        gen = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=self.settings.judge_max_tokens,
                                  pad_token_id=self.tokenizer.pad_token_id)
        answers = self.tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
        return [parse_score(a) for a in answers]


def parse_score(answer: str) -> RewardResult:
    """The first number of a judge's answer as its score; none (or not finite): failed."""
    found = _NUMBER.search(answer)
    if found is None or not math.isfinite(float(found.group())):
        return RewardResult(0.0, False, f"judge answer has no number: {answer[:60]!r}")
    return RewardResult(float(found.group()), True)


def load_reward_model(settings: RewardModelSettings, *, device: str, dtype: str) -> RewardModel:
    """The reward model of ``settings.model`` (``ValueError`` naming the key if unusable) on
    ``settings.engine`` (vLLM takes the first GPU it sees: ``device`` cuda:N is made the only
    one this process sees; on its CPU build it runs on the CPU)."""
    if settings.engine == "vllm":
        from workers.engines.reward_vllm import VllmJudge
        from workers.runtime.devices import pin_visible_gpu

        pin_visible_gpu(device)
        return VllmJudge(settings, dtype=dtype)
    return HFRewardModel(settings, device=device, dtype=dtype)
