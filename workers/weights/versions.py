"""Where published policy versions live on disk (``<dir>/policy-v000007.safetensors``): file names
and directory listings, shared by ``workers.weights.file_sync`` and ``workers.weights.net``. No torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAME = re.compile(r"^policy-v(\d{6,})\.safetensors$")


def weights_path(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"policy-v{version:06d}.safetensors"


def published_versions(directory: str | os.PathLike) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))


def latest_version(directory: str | os.PathLike) -> int | None:
    versions = published_versions(directory)
    return versions[-1] if versions else None


def prune(directory: str | os.PathLike, newest: int, keep: int) -> None:
    """Unlink versions older than the newest ``keep`` (a reader that opened one keeps reading)."""
    for old in published_versions(directory):
        if old <= newest - keep:
            weights_path(directory, old).unlink(missing_ok=True)
