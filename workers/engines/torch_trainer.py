"""The training engine contract (``TrainerEngine``) and its plain-torch AdamW implementation.

Lifecycle per iteration: backward(loss_sum) x micro-batches -> step(1 / total_tokens) ->
state_dict(). See docs/engines.md, "The training engine contract".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from workers.engines.optim import (
    OptimizerImpl,
    make_optimizer,
    optimizer_step,
    scale_gradients,
)
from workers.settings import OptimizerSettings


class TrainerEngine(Protocol):
    model: torch.nn.Module

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (a sum over tokens)."""
        ...

    def step(self, grad_scale: float) -> float:
        """Scale accumulated gradients by ``grad_scale``, clip, step, zero them; the grad norm."""
        ...

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Full policy weights with HF parameter names (what rollout engines load)."""
        ...

    def save_state(self, directory: str) -> None:
        """Optimizer (and engine) state next to a model checkpoint."""
        ...

    def load_state(self, directory: str) -> None: ...


def publishable(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached tensors under every name the loader expects; an alias of an earlier one (tied
    embeddings) is copied, since safetensors refuses shared storage."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out[name] = tensor.detach().clone() if tensor.data_ptr() in seen else tensor.detach()
        seen.add(tensor.data_ptr())
    return out


class TorchTrainerEngine:
    """AdamW on a single process, walked as ``optimizer_impl`` says (``OptimizerImpl``: the
    build picks "fused", or "single", torch's reference loop, with trainer.deterministic). Every
    choice updates each element from its own state alone, so two runs that accumulate the same
    gradients take bitwise-identical steps whatever the order of the parameters."""

    def __init__(self, model: torch.nn.Module, *, lr: float, fp64_accumulation: bool,
                 weight_decay: float = OptimizerSettings.weight_decay,
                 betas: tuple[float, float] = OptimizerSettings.betas,
                 max_grad_norm: float | None = OptimizerSettings.max_grad_norm,
                 warmup_steps: int = OptimizerSettings.warmup_steps,
                 optimizer_impl: OptimizerImpl = "single") -> None:
        self.model = model.train()
        self.optimizer = make_optimizer(model, lr, weight_decay, betas, warmup_steps=warmup_steps,
                                        impl=optimizer_impl)
        self.max_grad_norm = max_grad_norm
        # Float64 sums of the micro-batch gradients: addition is then order-independent to far
        # below fp32 resolution, so the same micro-batches in any arrival order give bitwise the
        # same fp32 gradient (Adam would otherwise turn rounding noise on parameters whose true
        # gradient is 0 into lr-sized, sign-random steps). Costs 8 bytes per parameter.
        self._acc: dict[torch.nn.Parameter, torch.Tensor] | None = {} if fp64_accumulation else None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._acc is None:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                acc = self._acc.get(p)
                if acc is None:
                    self._acc[p] = p.grad.detach().double()
                else:
                    acc.add_(p.grad.detach().double())
                p.grad = None

    def step(self, grad_scale: float) -> float:
        if self._acc is not None:
            for p, acc in self._acc.items():
                p.grad = (acc * grad_scale).to(p.dtype)
            self._acc.clear()
        else:
            scale_gradients(self.model, grad_scale)
        return optimizer_step(self.model, self.optimizer, self.max_grad_norm)

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return publishable(self.model.state_dict())

    def save_state(self, directory: str) -> None:
        path = Path(directory) / "optimizer.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self.optimizer.state_dict(), tmp)
        os.replace(tmp, path)

    def load_state(self, directory: str) -> None:
        # Our own checkpoint file on local disk (never bytes from a socket).
        state = torch.load(Path(directory) / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(state)
