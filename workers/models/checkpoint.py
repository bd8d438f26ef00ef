"""Trainer checkpoints: written atomically (temp dir, then one rename), the newest ``keep`` kept,
the latest found for resume. Layout, replacement and why the store need not be saved:
docs/engines.md, "Trainer checkpoints".
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


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
    _fsync(path)


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
        _fsync(root)  # the renames themselves must reach the disk
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
    """Complete checkpoints (trainer state written), oldest first; read-only: a step whose
    replacement was cut between its two renames is found under its ``.old-step-N-*`` name."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for pattern in (_STEP_DIR, _OLD_DIR):  # a step-N wins over an .old-step-N-*
        for entry in root.iterdir():
            m = pattern.match(entry.name)
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
