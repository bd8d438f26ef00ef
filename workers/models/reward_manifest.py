"""The manifest a trained reward model carries (``reward_manifest.json``, written by
``workers.models.reward_train``), read without torch: the preflight checks a run's
``reward.min_accuracy`` against the accuracy it records (docs/rewards.md "How good a reward model
must be").
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "reward_manifest.json"


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a reward-model directory, or None (absent or unreadable: a directory
    without one was not made by ``streamflow model train-reward``, or was never finished)."""
    try:
        found = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def recorded_accuracy(path: str | Path) -> float | None:
    """The held-out accuracy the manifest records (None: no manifest, or none recorded)."""
    found = read_manifest(path)
    report = found.get("report") if found else None
    value = report.get("heldout_accuracy") if isinstance(report, dict) else None
    return float(value) if isinstance(value, (int, float)) else None
