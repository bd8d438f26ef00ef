"""The trainer engines' optimizer: AdamW over the trainable parameters, its linear warm-up (kept
in the param groups, so it is saved and restored with the optimizer), gradient scaling and the
clip-then-step of the torch engine (docs/engines.md).
"""

from __future__ import annotations

from typing import Literal

import torch

from workers.settings import OptimizerSettings

# How AdamW walks the parameters: "single" one tensor at a time (torch's reference loop),
# "foreach" one multi-tensor kernel per operation, "fused" one kernel for the whole update. Each
# updates every element from that element's own state alone, so none depends on the order or
# grouping of the parameters; "fused" is the fastest and rounds differently in the last bits.
OptimizerImpl = Literal["single", "foreach", "fused"]


def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every accumulated gradient by ``factor`` (e.g. 1 / batch token count)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:  # one multi-tensor kernel; elementwise, so bitwise what a loop of mul_ gives
        with torch.no_grad():
            torch._foreach_mul_(grads, factor)


def make_optimizer(model: torch.nn.Module, lr: float,
                   weight_decay: float = OptimizerSettings.weight_decay,
                   betas: tuple[float, float] = OptimizerSettings.betas, *,
                   warmup_steps: int = OptimizerSettings.warmup_steps,
                   impl: OptimizerImpl = "single") -> torch.optim.AdamW:
    """AdamW over the trainable parameters, walked as ``impl`` says (``OptimizerImpl``);
    ``warmup_steps`` > 0 ramps the lr linearly (applied by ``optimizer_step``; docs/engines.md).
    "fused" falls back to "foreach" where this torch has no fused kernel for the parameters."""
    if lr <= 0:
        raise ValueError(f"make_optimizer: lr must be > 0, got {lr}")
    if warmup_steps < 0:
        raise ValueError(f"make_optimizer: warmup_steps must be >= 0, got {warmup_steps}")
    if impl not in ("single", "foreach", "fused"):
        raise ValueError(f"make_optimizer: impl must be single, foreach or fused, got {impl!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=lr, weight_decay=weight_decay, betas=betas)
    if impl == "fused":
        try:
            opt = torch.optim.AdamW(params, fused=True, **kw)
        except RuntimeError:  # a device or dtype without a fused kernel
            opt = torch.optim.AdamW(params, foreach=True, **kw)
    else:
        opt = torch.optim.AdamW(params, foreach=impl == "foreach", **kw)
    for group in opt.param_groups:
        group["base_lr"] = lr
        group["warmup_steps"] = int(warmup_steps)
        group["num_steps"] = 0
    return opt


def apply_warmup(optimizer: torch.optim.Optimizer) -> None:
    """Set each param group's lr for the step about to be taken and count it. The schedule lives
    in the param group (set by ``make_optimizer``), so it is saved and restored with the
    optimizer's state dict; call once per optimizer step, right before it."""
    for group in optimizer.param_groups:
        warmup = group.get("warmup_steps", 0)
        if warmup:
            group["lr"] = group["base_lr"] * min(1.0, (group["num_steps"] + 1) / warmup)
        group["num_steps"] = group.get("num_steps", 0) + 1


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> float:
    """Clip (if ``max_grad_norm``), step, zero the gradients; returns the pre-clip grad norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm is not None and max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif params:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.zeros(())
    apply_warmup(optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
