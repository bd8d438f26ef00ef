"""Supervised warm start and the reproducible embedded default checkpoint (``prepare_builtin``,
cached by its manifest; its accuracies by ``workers.tasks.evaluate``, the controller's evaluator).
See docs/engines.md, "Warm start".

With a ``tool_fraction`` > 0 that fraction of the examples (drawn per example from the seed) is a
calculator tape in the plain call form, ``12*34=`` -> ``(=12*34=)408 408``: the call, the
calculator's own observation (made by ``workers.agent.environments.execute``, so it reads exactly
as in a run) and the answer. The observation's tokens are masked out of the loss, as RL masks
them, so the model learns the format without learning to predict the tool (docs/learning.md).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from workers.agent.environments import StepContext, execute, load_environment
from workers.agent.toolcall import (
    PLAIN_ARGUMENT,
    PLAIN_TOOL,
    ToolCall,
    format_observation,
    render_tool_call,
)
from workers.models.local import TinyModelSpec, build_tiny_model, save_model
from workers.models.tokenizer import (
    build_char_tokenizer,
    encode_answer,
    encode_prompt,
    encode_text,
)
from workers.rl.tokens import build_token_batch, response_logprobs
from workers.runtime import heap
from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.evaluate import greedy_accuracy
from workers.tasks.problem import Problem

MANIFEST = "streamflow_manifest.json"
MANIFEST_FORMAT = 2


def _lr_at(step: int, lr: float, warmup: int) -> float:
    # Linear warm-up, then constant. The schedule must not depend on the total step count: the
    # warm start stops when the policy reaches its target accuracy, not at a fixed step (a cosine
    # over the total made the result a knife-edge function of the step count).
    return lr * min(1.0, (step + 1) / max(1, warmup))


def tool_tape(tokenizer: PreTrainedTokenizerBase, problem: Problem
              ) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of ``problem`` solved with the calculator in the plain form:
    call (mask 1), observation (mask 0), answer and eos (mask 1)."""
    call_text = render_tool_call(ToolCall(PLAIN_TOOL, {PLAIN_ARGUMENT: problem.prompt.rstrip("=")}),
                                 plain=True)
    obs = execute(load_environment("calculator"), call_text,
                  StepContext(problem.prompt, problem.answer, 0), plain=True)
    if obs.error is not None or obs.text.strip() != problem.answer:
        raise ValueError(f"tool_tape: the calculator answers {problem.prompt!r} with "
                         f"{obs.text!r}, not {problem.answer!r}")
    call = list(tokenizer(call_text, add_special_tokens=False)["input_ids"])
    seen = encode_text(tokenizer, format_observation(obs.text, plain=True))
    answer = encode_answer(tokenizer, problem.answer)
    return call + seen + answer, [1] * len(call) + [0] * len(seen) + [1] * len(answer)


@dataclass(frozen=True)
class WarmStartResult:
    """What ``warm_start`` did: the steps it ran and the mean answer loss of its last 10 %."""

    steps: int
    loss: float


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: ArithmeticTask,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,  # run.seed
    tool_fraction: float,  # model.warmstart_tool_fraction
    warmup: int = 20,
    stop: Callable[[int], bool] | None = None,
    check_every: int = 10,
    progress: Callable[[int, int], None] | None = None,
) -> WarmStartResult:
    """Supervised fine-tuning for at most ``steps`` AdamW steps; ``stop(step)`` is asked every
    ``check_every`` steps (model in eval mode) and ends it on True; ``progress(step, steps)``
    after every step; ``tool_fraction`` of the examples are calculator tapes (``tool_tape``)."""
    if steps < 0 or batch_size < 1 or check_every < 1:
        raise ValueError(f"warm_start: need steps >= 0, batch_size >= 1 and check_every >= 1, "
                         f"got {steps}, {batch_size}, {check_every}")
    stream = task.iterate(seed)
    draw = random.Random(f"warmstart-tool|{seed}")  # which examples are tapes
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # the warm start's own AdamW (no weight decay): trainer.* are the RL trainer's
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0,
                                  betas=(0.9, 0.98), foreach=False)
    losses: list[float] = []
    done = 0
    for step in range(steps):
        model.train()
        pairs, masks = [], []
        for p in (next(stream) for _ in range(batch_size)):
            tape = tool_fraction > 0 and draw.random() < tool_fraction
            response, mask = tool_tape(tokenizer, p) if tape else (
                encode_answer(tokenizer, p.answer), None)
            pairs.append((encode_prompt(tokenizer, p.prompt), response))
            masks.append(mask)
        batch = build_token_batch(pairs, pad_token_id=pad, loss_masks=masks)
        logp = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
        loss = -logp.sum() / batch.response_mask.sum()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, lr, warmup)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        done = step + 1
        if progress is not None:
            progress(done, steps)
        if stop is not None and done % check_every == 0:
            model.eval()
            with torch.no_grad():
                if stop(done):
                    break
    model.eval()
    tail = losses[-max(1, done // 10):]
    return WarmStartResult(steps=done, loss=sum(tail) / len(tail) if tail else float("nan"))


@dataclass
class BuiltinRecipe:
    """How the embedded default checkpoint is made (everything that goes into the manifest): on
    ``threads`` threads, until probe accuracy reaches ``target_accuracy`` (0: all steps), at most
    ``warmstart_steps`` steps; why: docs/engines.md, "Warm start"."""

    # The run's model.* and data.* keys, filled by the plan (streamflow.plan.builtin_recipe): no
    # default of their own.
    spec: TinyModelSpec
    digits: int
    operations: tuple[str, ...]
    task_seed: int
    warmstart_steps: int
    batch_size: int
    lr: float
    seed: int
    eval_size: int
    target_accuracy: float
    tool_fraction: float  # model.warmstart_tool_fraction
    # the recipe's own
    check_every: int = 10
    probe_size: int = 200
    threads: int = 1

    def task(self) -> ArithmeticTask:
        return ArithmeticTask(digits=self.digits, operations=tuple(self.operations),
                              seed=self.task_seed)

    def to_json(self) -> dict:
        d = asdict(self)
        d["operations"] = list(self.operations)
        if not self.tool_fraction:  # the key of a recipe without tapes is what it always was
            del d["tool_fraction"]
        d["format"] = MANIFEST_FORMAT
        return d


def read_manifest(path: str | os.PathLike[str]) -> dict | None:
    """The manifest of a prepared directory, or None if absent/unreadable."""
    f = Path(path) / MANIFEST
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def prepare_builtin(
    output_dir: str | os.PathLike[str],
    spec: TinyModelSpec | BuiltinRecipe | None = None,
    task: ArithmeticTask | None = None,
    warmstart_steps: int | None = None,
    *,
    recipe: BuiltinRecipe | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Build (or reuse) the warm-started embedded model directory; returns its path. ``recipe``
    (or a second positional argument) gives every knob; ``spec``, ``task`` and ``warmstart_steps``
    override its model size, task and step count."""
    if isinstance(spec, BuiltinRecipe):
        recipe, spec = spec, None
    if recipe is None:
        raise ValueError("prepare_builtin: a BuiltinRecipe is needed (streamflow.plan.builtin_recipe)")
    recipe = replace(recipe)
    if spec is not None:
        recipe.spec = spec
    if task is not None:
        recipe.digits, recipe.operations, recipe.task_seed = task.digits, task.operations, task.seed
    if warmstart_steps is not None:
        recipe.warmstart_steps = int(warmstart_steps)
    out = Path(output_dir)
    wanted = recipe.to_json()
    found = read_manifest(out)
    if not force and found is not None and found.get("recipe") == wanted:
        return out
    tokenizer = build_char_tokenizer()
    task = recipe.task()
    held_out = task.eval_problems(recipe.eval_size)
    # Training-split problems from a stream of their own (seed -1); only the stop rule sees them.
    probe = list(itertools.islice(task.iterate(seed=-1), recipe.probe_size))
    max_new = recipe.digits * 2 + 2
    probe_accuracy: list[float] = []

    def reached_target(step: int) -> bool:
        probe_accuracy.append(greedy_accuracy(model, tokenizer, probe, max_new_tokens=max_new))
        return probe_accuracy[-1] >= recipe.target_accuracy

    heap.keep_heap()  # its steps reuse their freed activations (workers/runtime/heap.py)
    run_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        model = build_tiny_model(recipe.spec, tokenizer)
        t0 = time.perf_counter()
        result = warm_start(
            model, tokenizer, task, steps=recipe.warmstart_steps, batch_size=recipe.batch_size,
            lr=recipe.lr, seed=recipe.seed, check_every=recipe.check_every, progress=progress,
            tool_fraction=recipe.tool_fraction,
            stop=reached_target if recipe.target_accuracy > 0 else None)
        seconds = time.perf_counter() - t0
        accuracy = greedy_accuracy(model, tokenizer, held_out, max_new_tokens=max_new)
    finally:
        torch.set_num_threads(run_threads)
    save_model(model, tokenizer, out)
    manifest = {
        "recipe": wanted,
        "warmstart_seconds": round(seconds, 2),
        "warmstart_steps_run": result.steps,
        "warmstart_final_loss": result.loss,
        "probe_accuracy": probe_accuracy[-1] if probe_accuracy else None,
        "heldout_greedy_accuracy": accuracy,
        "torch_threads": recipe.threads,
    }
    # The manifest is written last: a directory without it is never reused.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out
