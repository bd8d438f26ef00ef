"""Engine adapters: rollout engines behind the ``RolloutEngine`` protocol (``base``), training
engines, and the ``simulated`` engine (``simulated``, priced by the cost model ``sim_cost``).

``base`` holds the engine-neutral records (``SamplingParams``, ``Generation``) and the protocol;
``torch_rollout`` is the in-process torch engine (KV cache, batched sampling). Adapters for other
engines (e.g. vLLM) implement the same protocol; nothing above this package depends on which.

Importing this package imports no torch: ``sim_cost`` is read by the config checks and by
simulated hosts that run 100+ device threads in one process. The re-exports below load ``base``
(and torch) on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Generation", "RolloutEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workers.engines import base

        return getattr(base, name)
    raise AttributeError(f"module 'workers.engines' has no attribute {name!r}")
