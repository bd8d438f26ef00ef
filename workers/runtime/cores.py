"""One host's CPU threads, handed back and forth between its compute processes by phase.

``CoreShare`` is a process's byte in a shared table (1 = busy); at each phase boundary it takes
``total // busy`` threads. ``busy()`` is the process-wide hook the stage loop and trainer wrap
compute in. Why, layout, lifecycle: docs/training.md "CPU threads shared by phase".
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SLOTS = 64


@dataclass
class CoreShareConfig:
    """Where a worker finds its host's budget (plain data: it travels in the worker's JSON)."""

    path: str  # the shared file (created by the controller)
    slot: int  # this process's byte, 0 <= slot < MAX_SLOTS, unique on the host
    total_threads: int  # the host's budget for its compute processes
    # at most this many threads for this process (0 = no cap; the rollout: its own `threads`)
    max_threads: int = 0


def create(path: str | os.PathLike[str]) -> Path:
    """Create (or reset) the shared table: every slot idle."""
    p = Path(path)
    p.write_bytes(bytes(MAX_SLOTS))
    return p


class CoreShare:
    """This process's view of the host's budget (docs/training.md)."""

    def __init__(self, cfg: CoreShareConfig) -> None:
        if not 0 <= cfg.slot < MAX_SLOTS:
            raise ValueError(f"CoreShare slot must be in 0..{MAX_SLOTS - 1}, got {cfg.slot}")
        if cfg.total_threads < 1:
            raise ValueError(f"CoreShare total_threads must be >= 1, got {cfg.total_threads}")
        self.cfg = cfg
        # another host's worker creates its host's own table (never truncating: keep the marks)
        with open(cfg.path, "a+b") as fh:
            if os.fstat(fh.fileno()).st_size < MAX_SLOTS:
                fh.truncate(MAX_SLOTS)
            self._map = mmap.mmap(fh.fileno(), MAX_SLOTS)
        self._map[cfg.slot] = 0
        self._depth = 0
        self.threads = 0  # the count last given to torch (0: not set yet)

    def share(self) -> int:
        """Threads this process should use now: its part of the budget among busy processes."""
        table = self._map[:MAX_SLOTS]
        busy = [i for i, b in enumerate(table) if b]
        if self.cfg.slot not in busy:
            busy.append(self.cfg.slot)
            busy.sort()
        base, extra = divmod(self.cfg.total_threads, len(busy))
        share = max(1, base + (1 if busy.index(self.cfg.slot) < extra else 0))
        return min(share, self.cfg.max_threads) if self.cfg.max_threads else share

    def refresh(self) -> int:
        """Apply ``share()`` to torch if it changed (cheap: reads 64 bytes); returns it."""
        want = self.share()
        if want != self.threads:
            import torch  # here, not at import: simulated hosts use the loop and never need torch

            torch.set_num_threads(want)
            self.threads = want
        return want

    @contextlib.contextmanager
    def busy(self) -> Iterator[int]:
        """Mark this process busy for a compute phase (re-entrant) and take its share."""
        self._depth += 1
        if self._depth == 1:
            self._map[self.cfg.slot] = 1
        try:
            yield self.refresh()
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._map[self.cfg.slot] = 0

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map[self.cfg.slot] = 0
            self._map.close()


_current: CoreShare | None = None


def install(share: CoreShare | None) -> None:
    """Make ``share`` the process's budget (``busy()`` acts on it)."""
    global _current
    _current = share


def busy() -> contextlib.AbstractContextManager[int]:
    """``CoreShare.busy`` of the installed share, or a no-op context without one."""
    if _current is None:  # torch's own count; a process without torch (simulated host): the CPUs
        torch = sys.modules.get("torch")
        return contextlib.nullcontext(torch.get_num_threads() if torch else os.cpu_count() or 1)
    return _current.busy()


def refresh() -> None:
    """Inside a phase, re-take this process's share now (a no-op outside one or without a share).
    Cheap enough to call between two layers: it reads the 64-byte table."""
    if _current is not None and _current._depth:
        _current.refresh()


def refresh_between_layers(model: Any) -> int:
    """Call ``refresh`` before each decoder layer's forward and before each layer's backward; the
    number of layers hooked (0: no ``model.layers`` list found, nothing hooked).

    Why: a trainer's micro-batch takes seconds on a CPU, and a share taken only where a phase
    begins is stale for most of it: the rollout finishing mid-pass left its thread idle until
    the trainer's next micro-batch, and the rollout starting mid-pass ran three threads on two
    cores. Between layers the hand-off lags by a layer (docs/training.md). The backward runs on
    the thread that called it (CPU autograd), so a share taken in a gradient hook applies to the
    rest of the backward.
    """
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return 0

    def before_backward(grad: torch.Tensor) -> None:
        refresh()

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        refresh()

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        # the gradient of a layer's output arrives first in that layer's backward
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(before_backward)

    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(after_forward)
    return len(layers)
