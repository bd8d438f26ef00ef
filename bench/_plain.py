"""The plain Hugging Face GRPO loop that ``streamflow bench phases`` measures StreamFlow against.

What a user would write with ``transformers`` alone, in one process: ``generate`` (SDPA attention,
KV cache) -> exact-match reward of the decoded sum -> group-normalised advantages -> reference
log-probs (a frozen copy, no grad) -> policy log-probs, clipped surrogate plus the k3 KL term
(token mean) -> backward, gradient clipping, AdamW step. One update per batch, so the old policy
is the policy itself (ratio 1 on the only pass), as in StreamFlow's trainer.

Each phase is timed on its own (``PlainTimes``); ``total`` is the whole iteration, prompt encoding
and reward included. Settings (learning rate, betas, clip, KL coefficient, gradient-norm clip,
temperature) are the ones the StreamFlow side runs with (``settings_of`` reads them from the run
config the bench gives both sides).

``python -m bench._plain CONFIG --iterations N`` runs the loop alone in a process of its own, as
a user would, over the run config's model and prompts: one warm-up iteration, then N timed ones;
its last line is ``{"seconds_per_iteration": mean of the N, "iterations": [...]}``. The bench
runs it beside the modes' ``streamflow run`` jobs, so the plain loop and the modes are measured
the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.tasks.problem import Problem
from workers.tasks.verifiers import exact_match

if TYPE_CHECKING:
    from streamflow.config import RunConfig


@dataclass
class PlainTimes:
    """Seconds of one iteration of the plain loop, per phase and in all."""

    generation: float
    reward: float
    reference: float
    train_step: float
    total: float
    reward_mean: float


@dataclass(frozen=True)
class PlainSettings:
    group_size: int
    new_tokens: int
    kl_coef: float
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    seed: int = 0


def _load(model_dir: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PlainGRPO:
    """Policy, frozen reference and AdamW over one HF model directory."""

    def __init__(self, model_dir: Path, settings: PlainSettings, *, device: str = "cpu") -> None:
        from transformers import AutoTokenizer

        self.s = settings
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.policy = _load(model_dir, device)
        self.reference = _load(model_dir, device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=0.0
        )
        self.pad_id = int(self.tokenizer.pad_token_id)
        torch.manual_seed(settings.seed)

    def _batch(self, problems: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prompt ``group_size`` times, left-padded: ids and attention mask [B, P]."""
        prompts = [self.tokenizer(p.prompt)["input_ids"] for p in problems]
        rows = [ids for ids in prompts for _ in range(self.s.group_size)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _logprobs(self, model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor,
                  prompt_width: int) -> torch.Tensor:
        """Log-probs [B, N] of the response tokens ``seq[:, prompt_width:]``."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        n = seq.shape[1] - prompt_width
        logits = model(input_ids=seq, attention_mask=mask, position_ids=positions,
                       use_cache=False, logits_to_keep=n + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits / self.s.temperature, dim=-1)
        return logp.gather(-1, seq[:, prompt_width:, None]).squeeze(-1)

    def iteration(self, problems: Sequence[Problem]) -> PlainTimes:
        s, dev = self.s, self.device
        _sync(dev)
        t0 = time.perf_counter()
        ids, prompt_mask = self._batch(problems)
        with torch.no_grad():
            seq = self.policy.eval().generate(
                input_ids=ids, attention_mask=prompt_mask, do_sample=True,
                temperature=s.temperature, top_p=1.0, top_k=0, max_new_tokens=s.new_tokens,
                min_new_tokens=s.new_tokens, pad_token_id=self.pad_id,
            )
        _sync(dev)
        t1 = time.perf_counter()
        width = ids.shape[1]
        texts = self.tokenizer.batch_decode(seq[:, width:].tolist(), skip_special_tokens=True)
        answers = [p.answer for p in problems for _ in range(s.group_size)]
        rewards = torch.tensor([exact_match(t, a) for t, a in zip(texts, answers, strict=True)])
        grouped = rewards.view(-1, s.group_size)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1).to(dev)
        t2 = time.perf_counter()
        mask = torch.cat([prompt_mask, torch.ones_like(seq[:, width:])], dim=1)
        with torch.no_grad():
            ref = self._logprobs(self.reference, seq, mask, width)
        _sync(dev)
        t3 = time.perf_counter()
        logp = self._logprobs(self.policy.train(), seq, mask, width)
        ratio = torch.exp(logp - logp.detach())  # old policy = this policy (one update per batch)
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - s.clip_eps, 1 + s.clip_eps) * adv)
        delta = ref - logp
        kl = delta.exp() - delta - 1  # k3 estimator of KL(policy || reference)
        loss = (-surrogate + s.kl_coef * kl).mean()  # every response has all N tokens (no eos)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(dev)
        t4 = time.perf_counter()
        return PlainTimes(generation=t1 - t0, reward=t2 - t1, reference=t3 - t2,
                          train_step=t4 - t3, total=t4 - t0, reward_mean=float(rewards.mean()))


def settings_of(cfg: RunConfig) -> PlainSettings:
    """The plain loop's settings from the run config StreamFlow's side runs with."""
    t = cfg.trainer
    return PlainSettings(
        group_size=cfg.data.group_size, new_tokens=cfg.rollout.max_new_tokens,
        kl_coef=t.kl_coef, lr=t.lr, betas=(t.betas[0], t.betas[1]), clip_eps=t.clip_eps,
        max_grad_norm=t.max_grad_norm, temperature=cfg.rollout.temperature, seed=cfg.run.seed)


def main(argv: list[str]) -> int:
    """The loop alone in this process (module docstring); prints one JSON line."""
    from streamflow.config import load_config
    from streamflow.plan import build_plan

    parser = argparse.ArgumentParser(prog="python -m bench._plain",
                                     description="the plain GRPO loop alone, timed")
    parser.add_argument("config", help="the run config (model.path, prompts, settings)")
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.threads < 1:
        parser.error("--iterations and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    if cfg.model.path is None:
        parser.error(f"{args.config}: model.path is not set (the plain loop needs a model "
                     "directory)")
    plan = build_plan(cfg, Path(cfg.run.output_dir))  # for the prompts: the same as the modes'
    try:
        loop = PlainGRPO(Path(str(cfg.model.path)), settings_of(cfg), device=args.device)
        seconds = [loop.iteration(plan.problems(k)).total for k in range(args.iterations + 1)]
    finally:
        plan.cleanup()
    timed = seconds[1:]  # iteration 0 is the warm-up
    print(json.dumps({"seconds_per_iteration": round(sum(timed) / len(timed), 6),
                      "iterations": [round(x, 6) for x in timed]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
