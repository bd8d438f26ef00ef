"""What a reward model reads and what its answer means, with no torch (the preflight reads a
model's kind at ``--dry-run``): which kind a directory holds (``model_kind``), the text a row
becomes (``render``), the judge's token ids and the score in its answer, and the ``RewardModel``
contract the reward role calls. The models: ``workers.models.reward_model`` (torch) and
``workers.models.reward_vllm`` (a judge on vLLM); docs/rewards.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from workers.checked import ConfigValueError
from workers.settings import RewardModelSettings
from workers.tasks.verifiers import RewardResult

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


def parse_score(answer: str) -> RewardResult:
    """The first number of a judge's answer as its score; none (or not finite): failed."""
    found = _NUMBER.search(answer)
    if found is None or not math.isfinite(float(found.group())):
        return RewardResult(0.0, False, f"judge answer has no number: {answer[:60]!r}")
    return RewardResult(float(found.group()), True)
