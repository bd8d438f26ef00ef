"""``workers.runtime.heap``: a process's freed buffers stay in its heap for the next step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.runtime import heap

ROOT = Path(__file__).resolve().parents[2]

# A step's pattern, three times: six 8 MiB buffers taken from malloc, written, and freed. Then
# glibc's own accounting (mallinfo2) says how much the heap holds and how much of it is free at
# its top. Untuned, glibc maps the first step's buffers on their own, raises its mmap threshold to
# 8 MiB (its trim threshold to 16 MiB) at the first free, and from then on hands the 48 MiB freed
# at its top back to the kernel after every step, so the next step faults it in again. Kept, the
# 48 MiB stay. (Page-fault counts would say the same, but the kernel's own reclaim makes them
# vary from run to run; glibc's bookkeeping does not.)
_STEPS = """
import ctypes, ctypes.util, json, sys
from workers.runtime import heap
kept = heap.keep_heap() if sys.argv[1] == "kept" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
size = 8 << 20
for step in range(3):
    bufs = [libc.malloc(size) for _ in range(6)]
    for buf in bufs:
        ctypes.memset(buf, 1, size)
    for buf in bufs:
        libc.free(buf)
info = libc.mallinfo2()
print(json.dumps({"kept": kept, "heap": info.arena, "free_top": info.keepcost,
                  "mapped": info.hblkhd}))
"""

MIB = 1 << 20


def _run(which: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if k not in heap.USER_VARIABLES and k != "STREAMFLOW_KEEP_HEAP"}
    out = subprocess.run([sys.executable, "-c", _STEPS, which], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    return hasattr(os, "confstr") and bool(os.confstr("CS_GNU_LIBC_VERSION"))


@pytest.mark.skipif(not _glibc(), reason="the heap settings are glibc's")
def test_a_kept_heap_holds_a_steps_freed_buffers_for_the_next_step():
    plain, kept = _run("plain"), _run("kept")
    assert kept["kept"] is True
    # untuned: the freed 48 MiB went back to the kernel (nothing of it left mapped either)
    assert plain["free_top"] < 16 * MIB and plain["mapped"] < 8 * MIB
    # kept: the heap still holds them, free at its top, for the next step to take
    assert kept["free_top"] >= 48 * MIB and kept["heap"] >= 48 * MIB


@pytest.mark.skipif(not _glibc(), reason="the heap settings are glibc's")
def test_the_users_own_malloc_settings_and_the_opt_out_win():
    assert _run("kept", MALLOC_TRIM_THRESHOLD_="131072")["kept"] is False
    assert _run("kept", STREAMFLOW_KEEP_HEAP="0")["kept"] is False
