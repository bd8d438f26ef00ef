"""The C heap of a compute process: freed tensor buffers stay mapped for the next step.

PyTorch's CPU tensors come from glibc ``malloc``. By default glibc hands a freed top of its heap
back to the kernel once it exceeds a trim threshold (twice the dynamic mmap threshold: 64 MiB at
most), and serves each buffer above the mmap threshold with its own ``mmap``/``munmap``. A
training step or a batched forward frees tens of MiB of activations and asks for them again a
moment later, so every step faults the same memory in again, page by page (the page faults and
system time with and without the settings below, and their command: docs/performance.md).

``keep_heap`` raises the trim threshold and the top pad and pins the mmap threshold at its
maximum (32 MiB): the reuse PyTorch CPU tuning guides get by preloading jemalloc or tcmalloc,
without a library to install. It changes only this process, is called where a process starts
computing (a worker, the colocated ``sync`` controller, the warm start), keeps at most about
``TRIM_THRESHOLD`` + ``TOP_PAD`` of freed memory at the heap's top, and stands aside where it
cannot or should not act: not glibc (musl, macOS), the user set glibc's own ``MALLOC_*_``
variables (their choice wins), or ``STREAMFLOW_KEEP_HEAP=0`` (a host short of memory).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (glibc <malloc.h>)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MIB = 1 << 20
# The largest value glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit); a buffer above it is still mapped
# on its own, as most tensors of a step are below it.
MMAP_THRESHOLD = 32 * MIB
# Free memory the heap keeps at its top before returning any: what a step frees, it reuses.
TRIM_THRESHOLD = 1024 * MIB
# Extra memory each heap growth asks for, so a step's first allocations do not grow it one by one.
TOP_PAD = 256 * MIB

USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_",
                  "MALLOC_MMAP_MAX_")


def keep_heap() -> bool:
    """Tune this process's glibc heap (idempotent); True when tuned, False where it stood aside."""
    if os.environ.get("STREAMFLOW_KEEP_HEAP", "1") == "0":
        return False
    if any(name in os.environ for name in USER_VARIABLES):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (and mallopt's meaning)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
