"""A judge served by vLLM (``reward.engine=vllm``): the ``RewardModel`` contract of
``workers.models.reward_text`` over vLLM's offline ``LLM`` API (GPU or CPU build).

It reads the same text as the torch judge (``render``, the same tokenizer and special tokens:
the prompts go to vLLM as token ids, so both engines score the same tokens) and scores it the
same way:
- ``judge="tokens"``: one generated position with ``logprob_token_ids`` = the judge tokens; the
  score is P(judge_tokens[0]) / P(any judge token), from the full-vocabulary log-probs of the
  raw logits (vLLM's ``raw_logprobs``: what the torch judge's softmax computes);
- ``judge="parse"``: a greedy answer of ``judge_max_tokens`` tokens, its first number.
vLLM batches the whole claimed micro-batch itself (continuous batching), so
``rows_per_forward`` does not apply. Only a judge: a classifier runs on torch (``model_kind``
refuses the combination before anything starts). Importing this module never imports vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from workers.engines.vllm_rollout import import_vllm
from workers.models.reward_text import judge_token_ids, model_kind, parse_score, render
from workers.settings import RewardModelSettings
from workers.tasks.verifiers import RewardResult


class VllmJudge:
    """A causal-LM judge on vLLM, in this process (the reward worker owns one engine)."""

    kind = "judge"

    def __init__(self, settings: RewardModelSettings, *, dtype: str) -> None:
        from workers.models.local import load_tokenizer

        model_kind(settings)  # a judge with a template, or the one-line error naming the key
        self.settings = settings
        path = str(settings.model)
        self.tokenizer = load_tokenizer(path)
        self.token_ids = judge_token_ids(settings, self.tokenizer)
        vllm = import_vllm("reward.engine=vllm")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the LLM is built
        args: dict[str, Any] = {
            "model": path, "dtype": dtype, "seed": 0, "enforce_eager": True,
            "distributed_executor_backend": "uni", "logprobs_mode": "raw_logprobs",
            "kv_cache_memory_bytes": int(settings.vllm_kv_cache_gib * 2**30),
        }
        if settings.vllm_max_model_len is not None:
            args["max_model_len"] = int(settings.vllm_max_model_len)
        self.llm = vllm.LLM(**args)
        self._vllm = vllm

    def texts(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str]) -> list[str]:
        return [render(self.settings, self.tokenizer, "judge", p, r, a)
                for p, r, a in zip(prompts, responses, answers, strict=True)]

    def _token_prompts(self, texts: list[str]) -> list[dict[str, list[int]]]:
        # as the torch judge encodes: a chat template already holds the special tokens
        chat = self.settings.chat_template and getattr(self.tokenizer, "chat_template", None)
        return [{"prompt_token_ids": self.tokenizer(t, add_special_tokens=not chat)["input_ids"]}
                for t in texts]

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str]) -> list[RewardResult]:
        requests = self._token_prompts(self.texts(prompts, responses, answers))
        if not requests:
            return []
        if self.settings.judge == "tokens":
            params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0,
                                               logprob_token_ids=self.token_ids)
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            return [RewardResult(self._ratio(o.outputs[0].logprobs[0]), True) for o in outputs]
        params = self._vllm.SamplingParams(max_tokens=self.settings.judge_max_tokens,
                                           temperature=0.0, skip_special_tokens=True)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [parse_score(o.outputs[0].text) for o in outputs]

    def _ratio(self, position: dict[int, Any]) -> float:
        """P(first judge token) / P(any judge token) from one position's log-probs."""
        probs = [math.exp(position[t].logprob) if t in position else 0.0 for t in self.token_ids]
        total = sum(probs)
        return probs[0] / total if total > 0 else 0.0

    def close(self) -> None:
        """Stop vLLM's engine core (the judge is unusable afterwards)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
