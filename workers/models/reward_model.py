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

``RewardModel`` (``workers.models.reward_text``) is the contract the reward role calls
(``workers.roles.reward``); the module imports torch only when a model is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.models.reward_text import (
    RewardModel,
    judge_token_ids,
    model_kind,
    parse_score,
    render,
)
from workers.settings import RewardModelSettings
from workers.tasks.verifiers import RewardResult

if TYPE_CHECKING:
    import torch


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


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


def load_reward_model(settings: RewardModelSettings, *, device: str, dtype: str) -> RewardModel:
    """The reward model of ``settings.model`` (``ValueError`` naming the key if unusable) on
    ``settings.engine`` (vLLM takes the first GPU it sees: ``device`` cuda:N is made the only
    one this process sees; on its CPU build it runs on the CPU)."""
    if settings.engine == "vllm":
        from workers.models.reward_vllm import VllmJudge
        from workers.runtime.devices import pin_visible_gpu

        pin_visible_gpu(device)
        return VllmJudge(settings, dtype=dtype)
    return HFRewardModel(settings, device=device, dtype=dtype)
