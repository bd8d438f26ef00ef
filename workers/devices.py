"""A worker's device and dtype, checked with torch where the model is placed.

The controller resolves every process's device on its own probe (``streamflow/devices.py``, no
torch); this is the authoritative check in the process that uses it: a CUDA device this process
cannot see is a one-line error naming the device, before any model is loaded onto it.
"""

from __future__ import annotations

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


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
