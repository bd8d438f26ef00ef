"""Where published policy versions live on disk (``<dir>/policy-v000007.safetensors``): file names
and directory listings, shared by ``workers.weights`` and ``workers.weights_net``. No torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAME = re.compile(r"^policy-v(\d{6,})\.safetensors$")


def weights_path(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"policy-v{version:06d}.safetensors"


def version_of(name: str) -> int | None:
    """The version a file name in a weights directory stands for (None: not a weights file)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def published_versions(directory: str | os.PathLike) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(v for n in names if (v := version_of(n)) is not None)


def latest_version(directory: str | os.PathLike) -> int | None:
    versions = published_versions(directory)
    return versions[-1] if versions else None
