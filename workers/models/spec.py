"""The size of the embedded Qwen2 model, declared once: ``TinyModelSpec``'s defaults are the run's
``model.builtin.*`` defaults too (``streamflow.config.sections``). No torch here, so the config
and ``--dry-run`` can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TinyModelSpec:
    """Size of the embedded Qwen2 model (defaults: ~0.8 M parameters with the char tokenizer)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"TinyModelSpec.{name} must be > 0, got {getattr(self, name)}")
        for big, small in (("hidden_size", "num_heads"), ("num_heads", "num_kv_heads")):
            if getattr(self, big) % getattr(self, small):
                raise ValueError(f"TinyModelSpec.{big} ({getattr(self, big)}) must be divisible by "
                                 f"{small} ({getattr(self, small)})")
