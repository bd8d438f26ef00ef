"""The unified tri-model: policy and reference log-probs of a micro-batch in one packed pass.

The reference is frozen at construction; the old policy is never a held model (the trainer keeps
the first pass's detached log-probs). See docs/engines.md, "The tri-model".
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from workers.rl.packing import (
    PackedBatch,
    PackGroup,
    batch_logprobs,
    pack_groups,
    packing_unsupported_reason,
    unpacked_rows,
)

ReferenceSource = Literal["copy"] | torch.nn.Module | str | os.PathLike[str] | None


@dataclass
class TriLogprobs:
    """Per group, per response token log-probs ``[L_i]`` of the policy and the reference (the old
    policy's are the detached policy's on the iteration's first pass, kept by the trainer)."""

    policy: list[list[torch.Tensor]]  # differentiable
    ref: list[list[torch.Tensor]] | None  # detached; None when no reference is held
    batch: PackedBatch  # the layout every model ran on (rows, tokens, packed or not)


def _freeze(
    model: torch.nn.Module, dtype: torch.dtype | None, device: str | torch.device | None
) -> torch.nn.Module:
    model.requires_grad_(False)
    model.eval()
    return model.to(device=device, dtype=dtype)


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, tied tensors counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


class TriModel:
    """Holds the policy and its frozen reference; the old policy: docs/engines.md."""

    def __init__(
        self, policy: torch.nn.Module, *, reference: ReferenceSource = "copy",
        frozen_dtype: torch.dtype | None = None, frozen_device: str | torch.device | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.policy = policy
        self.frozen_dtype = frozen_dtype
        self.frozen_device = frozen_device
        self.autocast_dtype = autocast_dtype
        self.reference = self._load_reference(reference)

    def _load_reference(self, source: ReferenceSource) -> torch.nn.Module | None:
        if source is None:
            return None
        if isinstance(source, str) and source == "copy":
            return _freeze(copy.deepcopy(self.policy), self.frozen_dtype, self.frozen_device)
        if isinstance(source, torch.nn.Module):
            return _freeze(source, self.frozen_dtype, self.frozen_device)
        if isinstance(source, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            if not os.path.isdir(source):
                raise FileNotFoundError(f"reference model directory not found: {source}")
            model = AutoModelForCausalLM.from_pretrained(os.fspath(source))
            return _freeze(model, self.frozen_dtype, self.frozen_device)
        raise TypeError(
            f"reference must be 'copy', a module, a model directory or None, got {source!r}")

    def extra_bytes(self) -> int:
        """Bytes held by the frozen reference copy beyond the policy itself."""
        return _module_bytes(self.reference) if self.reference is not None else 0

    def forward(
        self, groups: Sequence[PackGroup], *, temperature: float = 1.0, token_budget: int = 4096,
        pack: bool = True, max_responses_per_row: int | None = None,
    ) -> TriLogprobs:
        """Pack ``groups`` once, then score them with the policy and the frozen reference."""
        frozen = [self.reference] if self.reference is not None else []
        pack = pack and all(packing_unsupported_reason(m) is None for m in [self.policy, *frozen])
        batch = (pack_groups(groups, token_budget=token_budget,
                             max_responses_per_row=max_responses_per_row)
                 if pack else unpacked_rows(groups))
        device = next(self.policy.parameters()).device
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            return self._forward(batch, temperature, device)

    def _forward(self, batch: PackedBatch, temperature: float, device: torch.device) -> TriLogprobs:
        policy = batch_logprobs(self.policy, batch, temperature=temperature)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                out = batch_logprobs(self.reference, batch, temperature=temperature)
            ref = [[t.to(device=device, dtype=torch.float32) for t in g] for g in out]
        return TriLogprobs(policy=[[t.float() for t in g] for g in policy], ref=ref, batch=batch)
