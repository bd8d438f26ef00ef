"""A worker's device and dtype, checked with torch where the model is placed.

The controller resolves every process's device on its own probe (``streamflow/devices.py``, no
torch); this is the authoritative check in the process that uses it: a CUDA device this process
cannot see is a one-line error naming the device, before any model is loaded onto it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_device(spec: str, offset: int = 0) -> torch.device:
    """``spec`` ('cpu' | 'cuda' | 'cuda:N') as a checked ``torch.device``; ``offset`` is added to a
    CUDA index (DeepSpeed rank r of a trainer placed at cuda:N runs on cuda:N+r)."""
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
    dev = torch.device(spec)
    if dev.type != "cuda" or dev.index is None:
        return spec
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        entry = str(dev.index)
    else:
        entries = [e for e in listed.replace(" ", "").split(",") if e]
        if entries and entries[0].startswith("-"):  # "-1": CUDA hides every device
            entries = []
        if dev.index >= len(entries):
            raise RuntimeError(f"device {spec!r} does not exist ({len(entries)} GPU(s) visible: "
                               f"CUDA_VISIBLE_DEVICES={listed!r})")
        entry = entries[dev.index]
    env["CUDA_VISIBLE_DEVICES"] = entry
    return "cuda:0"


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
