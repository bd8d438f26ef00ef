"""The unified tri-model: policy, old-policy and reference log-probs of a micro-batch in one pass.

Owns the trainable policy plus up to two frozen copies, and the rule for when each copy is
refreshed. ``forward`` packs the micro-batch ONCE (``workers.packing``) and runs every model on the
same packed tensors, so neither a separate reference worker nor an old-policy recomputation pass is
needed (``reference.placement = trainer``).

Lifecycle and invariants:
- ``reference`` is frozen at construction: a copy of the INITIAL policy (``reference="copy"``), a
  model directory loaded with transformers, a given module, or None (no KL term). It never changes.
- Old policy, ``updates_per_batch == 1`` (on-policy, one optimizer step per batch): no old copy is
  held and no old forward runs. ``old`` is ``policy.detach()``: the old policy IS the policy until
  the step, so its log-probs are equal by construction and the PPO ratio is exactly 1.
- Old policy, ``updates_per_batch > 1`` (PPO epochs / mini-batches): ``begin_iteration()`` copies
  the policy into the old copy at the START of each iteration, before its first optimizer step;
  every forward of the iteration then scores against that snapshot. It is never refreshed between
  steps, so it is never a one-step-stale copy. ``forward`` refuses to run before the first
  ``begin_iteration()``.
- Frozen copies may live in a lower precision (``frozen_dtype=torch.bfloat16``) and/or another
  device (``frozen_device="cpu"``); their log-probs come back as float32 on the policy's device.
  ``extra_bytes()`` is what they cost beyond the policy.
- ``autocast_dtype`` (bfloat16 on a GPU): every forward runs under ``torch.autocast`` in that dtype
  while the policy's master weights (and AdamW) stay float32; log-probs come back float32.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from workers.packing import (
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
    """Per group, per response token log-probs ``[L_i]`` of the three models."""

    policy: list[list[torch.Tensor]]  # differentiable
    old: list[list[torch.Tensor]]  # detached; == policy by construction when updates_per_batch == 1
    ref: list[list[torch.Tensor]] | None  # detached; None when no reference is held
    batch: PackedBatch  # the layout all three ran on (rows, tokens, packed or not)


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
    """Holds the policy and its frozen copies; see the module docstring for the refresh rules."""

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        reference: ReferenceSource = "copy",
        updates_per_batch: int = 1,
        frozen_dtype: torch.dtype | None = None,
        frozen_device: str | torch.device | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(updates_per_batch, int) or updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be an int >= 1, got {updates_per_batch!r}")
        self.policy = policy
        self.updates_per_batch = updates_per_batch
        self.frozen_dtype = frozen_dtype
        self.frozen_device = frozen_device
        self.autocast_dtype = autocast_dtype
        self.reference = self._load_reference(reference)
        self.old_policy: torch.nn.Module | None = None
        if updates_per_batch > 1:
            self.old_policy = _freeze(copy.deepcopy(policy), frozen_dtype, frozen_device)
        self._iteration_started = False

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
            f"reference must be 'copy', a module, a model directory or None, got {source!r}"
        )

    def begin_iteration(self) -> None:
        """Snapshot the policy as the old policy; call at the start of every iteration.

        A no-op when ``updates_per_batch == 1`` (no old copy is held).
        """
        self._iteration_started = True
        if self.old_policy is None:
            return
        with torch.no_grad():
            src = dict(self.policy.named_parameters())
            src.update(self.policy.named_buffers())
            for name, t in [*self.old_policy.named_parameters(), *self.old_policy.named_buffers()]:
                t.copy_(src[name])  # copy_ converts dtype and device

    def extra_bytes(self) -> int:
        """Bytes held by the frozen copies (reference and old policy) beyond the policy itself."""
        return sum(_module_bytes(m) for m in (self.reference, self.old_policy) if m is not None)

    def forward(
        self,
        groups: Sequence[PackGroup],
        *,
        temperature: float = 1.0,
        token_budget: int = 4096,
        pack: bool = True,
        max_responses_per_row: int | None = None,
    ) -> TriLogprobs:
        """Pack ``groups`` once, then score them with the policy and the frozen copies."""
        if self.old_policy is not None and not self._iteration_started:
            raise RuntimeError(
                "updates_per_batch > 1: call begin_iteration() before the first forward so the "
                "old policy is the policy at the start of the iteration"
            )
        frozen = [m for m in (self.reference, self.old_policy) if m is not None]
        pack = pack and all(packing_unsupported_reason(m) is None for m in [self.policy, *frozen])
        if pack:
            batch = pack_groups(
                groups, token_budget=token_budget, max_responses_per_row=max_responses_per_row
            )
        else:
            batch = unpacked_rows(groups)
        device = next(self.policy.parameters()).device
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            return self._forward(batch, temperature, device)

    def _forward(self, batch: PackedBatch, temperature: float, device: torch.device) -> TriLogprobs:
        policy = batch_logprobs(self.policy, batch, temperature=temperature)
        policy = [[t.float() for t in g] for g in policy]
        if self.old_policy is None:
            old = [[t.detach() for t in g] for g in policy]
        else:
            old = self._frozen_logprobs(self.old_policy, batch, temperature, device)
        ref = None
        if self.reference is not None:
            ref = self._frozen_logprobs(self.reference, batch, temperature, device)
        return TriLogprobs(policy=policy, old=old, ref=ref, batch=batch)

    @staticmethod
    def _frozen_logprobs(
        model: torch.nn.Module, batch: PackedBatch, temperature: float, device: torch.device
    ) -> list[list[torch.Tensor]]:
        with torch.no_grad():
            out = batch_logprobs(model, batch, temperature=temperature)
        return [[t.to(device=device, dtype=torch.float32) for t in g] for g in out]
