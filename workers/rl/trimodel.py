"""The unified tri-model: policy and reference log-probs of a micro-batch in one packed pass.

The reference is frozen at construction and scored by ``workers.rl.reference`` (the one owner of
reference log-probs) on the layout the policy runs (``choose_layout``: the one packing decision);
the old policy is never a held model (the trainer keeps the first pass's detached log-probs). See
docs/engines.md, "The tri-model". Both models score every response token, environment tokens
included; the ``response_loss_mask`` is the loss's (``workers.rl.tokens.apply_loss_masks``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from workers.rl.packing import PackedBatch, PackGroup, batch_logprobs, choose_layout
from workers.rl.reference import FrozenReference
from workers.settings import PackingSettings, SamplingSettings

ReferenceSource = Literal["copy"] | torch.nn.Module | str | os.PathLike[str] | None


@dataclass
class TriLogprobs:
    """Per group, per response token log-probs ``[L_i]`` of the policy and the reference (the old
    policy's are the detached policy's on the iteration's first pass, kept by the trainer)."""

    policy: list[list[torch.Tensor]]  # differentiable
    ref: list[list[torch.Tensor]] | None  # detached; None when no reference is held
    batch: PackedBatch  # the layout every model ran on (rows, tokens, packed or not)


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
        model = self._load_reference(reference)
        self.frozen = (FrozenReference(model, dtype=frozen_dtype, device=frozen_device)
                       if model is not None else None)

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference model (None: no reference is held)."""
        return self.frozen.model if self.frozen is not None else None

    def _load_reference(self, source: ReferenceSource) -> torch.nn.Module | None:
        if source is None:
            return None
        if isinstance(source, str) and source == "copy":
            return copy.deepcopy(self.policy)
        if isinstance(source, torch.nn.Module):
            return source
        if isinstance(source, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            if not os.path.isdir(source):
                raise FileNotFoundError(f"reference model directory not found: {source}")
            return AutoModelForCausalLM.from_pretrained(os.fspath(source))
        raise TypeError(
            f"reference must be 'copy', a module, a model directory or None, got {source!r}")

    def extra_bytes(self) -> int:
        """Bytes held by the frozen reference copy beyond the policy itself."""
        return _module_bytes(self.reference) if self.reference is not None else 0

    def forward(
        self, groups: Sequence[PackGroup], *, min_saving: float,
        temperature: float = SamplingSettings.temperature,
        token_budget: int = PackingSettings.token_budget, pack: bool = True,
        max_responses_per_row: int | None = None,
    ) -> TriLogprobs:
        """Lay ``groups`` out once (``choose_layout``: packed when ``pack``, the saving reaches
        ``min_saving`` and both models run it exactly), then score them with the policy and the
        frozen reference."""
        models = [self.policy] + ([self.reference] if self.reference is not None else [])
        batch = choose_layout(groups, models, pack=pack, min_saving=min_saving,
                              token_budget=token_budget,
                              max_responses_per_row=max_responses_per_row)
        device = next(self.policy.parameters()).device
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            return self._forward(batch, temperature, device)

    def _forward(self, batch: PackedBatch, temperature: float, device: torch.device) -> TriLogprobs:
        policy = batch_logprobs(self.policy, batch, temperature=temperature)
        ref = None
        if self.frozen is not None:
            out = self.frozen.logprobs(batch, temperature)
            ref = [[t.to(device=device, dtype=torch.float32) for t in g] for g in out]
        return TriLogprobs(policy=[[t.float() for t in g] for g in policy], ref=ref, batch=batch)
