"""A worker's device and dtype, checked with torch where the model is placed.

The controller resolves every process's device on its own probe (``streamflow/devices.py``, no
torch); this is the authoritative check in the process that uses it: a CUDA device this process
cannot see is a one-line error naming the device, before any model is loaded onto it. torch is
imported where it is used, so the controller's probe shares ``visible_entries`` without it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16")


def visible_entries(listed: str) -> list[str]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value lists, in order (indices or UUIDs); none for
    ``""`` or a value starting with ``-`` ("-1": CUDA hides every device)."""
    entries = [e for e in listed.replace(" ", "").split(",") if e]
    return [] if entries and entries[0].startswith("-") else entries


def torch_device(spec: str, offset: int = 0) -> torch.device:
    """``spec`` ('cpu' | 'cuda' | 'cuda:N') as a checked ``torch.device``; ``offset`` is added to a
    CUDA index (DeepSpeed rank r of a trainer placed at cuda:N runs on cuda:N+r)."""
    import torch

    dev = torch.device(spec)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} asked for but this process sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    index = (dev.index or 0) + offset
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(f"device cuda:{index} does not exist ({count} GPU(s) visible)")
    return torch.device("cuda", index)


def pin_visible_gpu(spec: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Make ``spec``'s GPU the only one this process sees, for an engine that places itself on the
    first visible GPU (vLLM); returns the name that GPU then has here (``cuda:0``).

    ``cuda:N`` counts among the GPUs this process was started with (the controller resolved it
    on the same ``CUDA_VISIBLE_DEVICES``), so N picks entry N of that list, not physical GPU N.
    Anything but ``cuda:N`` is returned unchanged. Call it before CUDA is initialised here: the
    driver reads the variable once.
    """
    kind, _, number = spec.partition(":")
    if kind != "cuda" or not number:
        return spec
    index = int(number)
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        entry = number
    else:
        entries = visible_entries(listed)
        if index >= len(entries):
            raise RuntimeError(f"device {spec!r} does not exist ({len(entries)} GPU(s) visible: "
                               f"CUDA_VISIBLE_DEVICES={listed!r})")
        entry = entries[index]
    env["CUDA_VISIBLE_DEVICES"] = entry
    return "cuda:0"


def dtype_of(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, name)
