"""Workload G1 of ``streamflow bench phases``: the model directory and the run config.

G1 is a 4.2 M-parameter Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, tied
embeddings) over a byte-level BPE vocabulary of 1024 tokens, trained here with the ``tokenizers``
library on generated arithmetic text. Nothing is downloaded: the tokenizer is wrapped in
``PreTrainedTokenizerFast`` and saved with the (randomly initialised, seeded) model through
``workers.models.local.save_model``, giving a plain Hugging Face directory that ``model.path`` takes.

The tokenizer has a pad token and NO end-of-sequence token, on purpose: StreamFlow's rollout stops
only on the tokenizer's eos (``workers.roles.build.build_rollout``), and Hugging Face ``generate`` only on
the model's, so without one every response on both sides runs to exactly ``new_tokens`` tokens and
both sides do the same work whatever the random weights sample. Both sides load the tokenizer
from the directory the same way (``AutoTokenizer``); transformers reads a qwen2 directory's
tokenizer as ``Qwen2Tokenizer`` (vocabulary and merges from the file, Qwen2's own pre-tokenizer,
which splits numbers into single digits), so a prompt like ``12+34=`` is 6 tokens.

``run_config`` is the one description of the workload's run (prompts, group size, response length,
KL coefficient, threads) that both the in-process phase measurement (``build_plan``) and the real
``streamflow run`` jobs read, so the two can never drift apart.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KL_COEF = 0.04
LR = 1e-4  # trainer.lr's default, written out so the plain loop uses the same
# Where each mode's reference forward runs (docs/performance.md): a worker of its own in ``sync``
# (the bench times it as a phase there); in the rollout worker in ``async``, where the rollout
# runs ahead and has the time, so the trainer does only its own pass; fused into the trainer in
# ``periodic``, where the rollout is the iteration's critical path.
REFERENCE_PLACEMENT = {"sync": "worker", "periodic": "trainer", "async": "rollout"}
PAD = "<pad>"


@dataclass(frozen=True)
class G1Shape:
    """Model and batch sizes of the workload (``QUICK`` is a tiny copy for the test)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompts: int  # prompts per iteration
    group_size: int  # responses per prompt (G)
    new_tokens: int  # tokens generated per response (no eos: always all of them)


G1 = G1Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, vocab=1024,
             prompts=16, group_size=8, new_tokens=64)
QUICK = G1Shape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=300,
                prompts=2, group_size=2, new_tokens=6)


def arithmetic_text(lines: int, seed: int = 0) -> list[str]:
    """Equations of 1- to 5-digit operands over + - *: enough distinct digit strings for the BPE
    trainer to reach a 1024-token vocabulary (2-digit sums alone stop far below it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a = rng.randrange(10 ** rng.randint(1, 5))
        b = rng.randrange(10 ** rng.randint(1, 5))
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(f"{a}{op}{b}={value}")
    return out


def build_tokenizer(vocab: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab`` tokens (pad, no eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(arithmetic_text(40_000), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, padding_side="left")
    if len(tok) != vocab:
        raise RuntimeError(f"G1 tokenizer: BPE training gave {len(tok)} tokens, expected {vocab}")
    return tok


def build_model_dir(path: Path, shape: G1Shape, seed: int = 0) -> Path:
    """Write the G1 model directory (config, safetensors, tokenizer) to ``path``; returns it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workers.models.local import save_model

    tok = build_tokenizer(shape.vocab)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=None,
        eos_token_id=None, use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None
    save_model(model, tok, path)
    # transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer, whose defaults add an
    # '<|endoftext|>' eos/unk token (a 1025th token, and a stop token for StreamFlow's rollout);
    # saying there is none keeps the vocabulary at ``shape.vocab`` and the responses eos-free.
    config_path = path / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config.update(eos_token=None, unk_token=None, bos_token=None)
    config_path.write_text(json.dumps(tok_config, indent=2))
    return path


def run_config(
    shape: G1Shape, model_dir: Path, out_dir: Path, *, mode: str, iterations: int, threads: int,
    device: str, shared_threads: bool = True,
) -> dict[str, Any]:
    """The raw config tree of one G1 run (``streamflow.config.config_from_dict`` / YAML).

    ``threads`` is the budget of the whole run, and each mode gets the layout that measures best
    for it on a CPU host (docs/performance.md "Phases against a plain Hugging Face loop"):

    - ``sync``: all threads in its one process, every stage claiming the whole iteration at once
      (the plain loop's batch: a decode step costs about the same for 32 rows as for 128 at
      this size, so fewer, larger claims generate faster);
    - ``periodic``/``async``: the rollout worker and the trainer share the budget by phase
      (``run.host_threads``, workers/runtime/cores.py): a process at work alone gets every thread (in
      ``periodic`` the trainer, once the iteration is generated), the rollout is capped at half.
      The trainer claims 32 rows. In ``periodic`` the rollout claims half an iteration at a
      time, so the trainer starts on an iteration while the rest of it is generated; in
      ``async`` it runs an iteration ahead and claims a whole one (one larger decode batch takes
      less CPU, and the rollout, which scores the reference there too, is busy nearly all the
      iteration);
    - the reference (``REFERENCE_PLACEMENT``): a worker of its own in ``sync``, so ``bench
      phases`` times its forward as a phase of that layout; in ``periodic``/``async`` never a
      third process (two processes share two cores better than three: ``async`` 2.93 against
      3.17 s per iteration, ``periodic`` 3.36 against 3.49 s), but fused into the trainer in
      ``periodic`` and run by the rollout worker in ``async`` (docs/performance.md).

    ``shared_threads=False`` gives the streaming modes fixed threads instead (``run.host_threads
    = 0``): the budget split in halves between the rollout worker and the trainer, the layout
    ``bench phases`` compares the shared default with.
    """
    rows = shape.prompts * shape.group_size
    streaming = mode != "sync"
    tree: dict[str, Any] = {
        "run": {"name": f"g1-{mode}", "mode": mode, "iterations": iterations, "seed": 0,
                "output_dir": str(out_dir / "{name}"), "eval_every": 0, "eval_prompts": 0,
                "progress": False, "log_level": "WARNING",
                "host_threads": threads if streaming and shared_threads else 0},
        "model": {"path": str(model_dir), "warmstart_steps": 0},
        "data": {"task": "arithmetic", "digits": 2, "operations": ["+"],
                 "prompts_per_iteration": shape.prompts, "group_size": shape.group_size},
        "rollout": {"engine": "torch", "max_new_tokens": shape.new_tokens, "temperature": 1.0,
                    "top_p": 1.0, "threads": max(threads // 2, 1) if streaming else threads,
                    "groups_per_claim": max(shape.prompts // 2, 1) if mode == "periodic"
                    else shape.prompts},
        "reward": {"fn": "exact_match", "rows_per_claim": rows},
        "reference": {"placement": REFERENCE_PLACEMENT[mode], "rows_per_claim": rows},
        "trainer": {"engine": "torch", "lr": LR, "kl_coef": KL_COEF,
                    "threads": threads if shared_threads or not streaming
                    else max(threads // 2, 1),
                    "rows_per_claim": 32 if streaming else rows},
        "metrics": {"enabled": False},
    }
    if mode == "sync":  # the reference worker's threads (the other modes have no such process)
        tree["reference"]["threads"] = threads
    _place_on(tree, device)
    return tree


def _place_on(tree: dict[str, Any], device: str) -> None:
    """Put every role on ``device`` (also ``cpu``: a role's ``auto`` would take a GPU that is
    there). A build whose run config has no per-role ``device`` runs everything on the CPU, so
    any other device is refused there rather than measured against a CPU StreamFlow."""
    from streamflow.config import ReferenceSection, RolloutSection, TrainerSection

    sections = (("rollout", RolloutSection), ("reference", ReferenceSection),
                ("trainer", TrainerSection))
    has_knob = all("device" in cls.__dataclass_fields__ for _, cls in sections)
    if not has_knob:
        if device != "cpu":
            raise ValueError(f"--device {device}: this build's run config has no per-role "
                             "device (rollout.device); only cpu can be measured")
        return
    for section, _ in sections:
        if section == "reference" and tree["reference"]["placement"] == "rollout":
            continue  # it runs on the rollout's device
        tree[section]["device"] = device
