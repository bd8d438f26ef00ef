"""Engine adapters: rollout engines behind ``base.RolloutEngine``, training engines, and the
``simulated`` engine (priced by ``sim_cost``). Importing this package imports no torch: the
re-exports below load ``base`` on first use. See docs/engines.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Generation", "RolloutEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workers.engines import base

        return getattr(base, name)
    raise AttributeError(f"module 'workers.engines' has no attribute {name!r}")
