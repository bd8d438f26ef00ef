"""Trainer checkpoints: written atomically, the previous one kept, the latest found for resume.

Layout under the checkpoint directory::

    step-000010/            one complete checkpoint (an HF model directory plus trainer state)
        config.json, model.safetensors, tokenizer files     the policy, loadable by transformers/vLLM
        optimizer.pt                                        the engine's optimizer state
        trainer_state.json                                  step (= policy version), RNG states, format
    .tmp-step-000012-<pid>/  a checkpoint being written: never read, removed on the next save
    .old-step-000010-<pid>/  a complete step-10 being replaced by a new step-10 (see below)

Lifecycle of a save: everything is written into a temporary sibling directory, flushed to disk,
then the directory is renamed to ``step-N`` in one ``rename`` — a reader sees either the whole
checkpoint or none of it, and a failed or killed save leaves the previous checkpoints untouched.
Only after the rename are checkpoints older than the newest ``keep`` removed.

Replacing an existing ``step-N`` (a new run writing into an old run's directory) is two renames:
``step-N`` -> ``.old-step-N-<pid>``, then the new one -> ``step-N``; only then is the old one
deleted. A save killed between the two renames leaves no ``step-N`` but a complete
``.old-step-N-*``, which readers take as step N (so the newest checkpoint never goes missing) and
the next save renames back before writing.

What is not in a checkpoint, and why that is exact: the data position is the iteration index
(prompts of iteration k are a pure function of k), rollout sampling is seeded per (group, policy
version), and rows of unfinished iterations are regenerated identically after a restart. So the
store's contents need not be saved: a resumed run re-puts iteration ``step`` onwards and produces
the same samples, hence the same parameters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_OLD_DIR = re.compile(r"^\.old-step-(\d{6,})-\d+$")


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps taken = policy version of the saved weights = next iteration
    format: int = FORMAT


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def save_checkpoint(
    root: str | os.PathLike, step: int, model: Any, tokenizer: Any, engine: Any, *, keep: int = 2
) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep`` complete ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)  # leftovers of a save that died
    _settle_replaced(root)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        engine.save_state(str(tmp))
        state = {"step": step, "format": FORMAT, "torch_rng": torch.get_rng_state().tolist()}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        _fsync_tree(tmp)
        old = None
        if final.exists():  # replacing a step: keep the old one complete until the new one is in
            old = root / f".old-step-{step:06d}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)  # the renames themselves must reach the disk
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _settle_replaced(root: Path) -> None:
    """Finish replacements a killed save left half done: an ``.old-step-N-*`` goes back to
    ``step-N`` when that is missing, else (the new one is in) it is deleted."""
    for entry in root.glob(".old-step-*"):
        m = _OLD_DIR.match(entry.name)
        final = root / f"step-{m.group(1)}" if m else None
        if final is not None and not final.exists() and (entry / "trainer_state.json").is_file():
            os.rename(entry, final)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first (a directory counts once its trainer state exists).
    Read-only: a step whose replacement was cut between its two renames is found under its
    ``.old-step-N-*`` name."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / "trainer_state.json").is_file():
            found[int(m.group(1))] = entry
    for entry in root.iterdir():
        m = _OLD_DIR.match(entry.name)
        if m and int(m.group(1)) not in found and (entry / "trainer_state.json").is_file():
            found[int(m.group(1))] = entry
    return [found[k] for k in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(checkpoint: str | os.PathLike) -> TrainerState:
    data = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{checkpoint}: checkpoint format {data.get('format')} != {FORMAT}")
    return TrainerState(step=int(data["step"]))


def restore_rng(checkpoint: str | os.PathLike) -> None:
    data = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    torch.set_rng_state(torch.tensor(data["torch_rng"], dtype=torch.uint8))
