"""Rollout engine adapters: the ``RolloutEngine`` protocol (``base``) and its implementations.

``base`` holds the engine-neutral records (``SamplingParams``, ``Generation``) and the protocol;
``torch_rollout`` is the in-process torch engine (KV cache, batched sampling). Adapters for other
engines (e.g. vLLM) implement the same protocol; nothing above this package depends on which.
"""

from workers.engines.base import Generation, RolloutEngine, SamplingParams

__all__ = ["Generation", "RolloutEngine", "SamplingParams"]
