"""DeepSpeed ZeRO-1/2 behind the ``TrainerEngine`` protocol, one process per rank (torchrun).

Owns ``DeepSpeedSettings`` (the DeepSpeed config is built from them in one place), process-group
start-up and the exact loss-scale recipe that makes ZeRO's update equal the torch engine's.
Why it is exact, and checkpoints: docs/engines.md, "DeepSpeed ZeRO-1/2: exact token-mean scaling".
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from workers.checked import embed, flat
from workers.engines.optim import apply_warmup, make_optimizer
from workers.engines.torch_trainer import publishable
from workers.runtime.distributed import RankGroup, rank_env
from workers.settings import OptimizerSettings

CHECKPOINT_TAG = "deepspeed"  # sub-directory of a trainer checkpoint holding DeepSpeed's files
SUPPORTED_STAGES = (1, 2)
log = logging.getLogger(__name__)


class MissingExtraError(ImportError):
    """A config asks for an engine whose optional dependency is not installed."""


@flat
@dataclass(frozen=True)
class DeepSpeedSettings:
    """Everything the DeepSpeed engine needs from the run config (typed, validated here)."""

    zero_stage: int  # trainer.zero_stage
    optim: OptimizerSettings = embed(OptimizerSettings)  # lr, weight_decay, betas, max_grad_norm
    reduce_bucket_size: int = 50_000_000  # elements per gradient-reduction bucket
    allgather_bucket_size: int = 50_000_000  # elements per parameter all-gather bucket
    backend: str | None = None  # None: the accelerator's default (gloo on CPU, nccl on CUDA)
    verify_sync: bool = True  # after every step, check all ranks hold bitwise-equal parameters

    def __post_init__(self) -> None:
        if self.zero_stage not in SUPPORTED_STAGES:
            raise ValueError(
                f"DeepSpeedSettings.zero_stage must be one of {SUPPORTED_STAGES}, got "
                f"{self.zero_stage!r} (stage 3 shards parameters: not supported by this engine)")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if (value := getattr(self, name)) < 1:
                raise ValueError(f"DeepSpeedSettings.{name} must be >= 1, got {value}")

    def ds_config(self, world_size: int) -> dict[str, Any]:
        """The DeepSpeed JSON config these settings mean (fp32, ZeRO, caller-owned boundary)."""
        return {
            "train_micro_batch_size_per_gpu": 1,  # nominal: our micro-batches are streamed groups
            "gradient_accumulation_steps": 1,
            "train_batch_size": world_size,
            "managed_gradient_accumulation": False,  # step() is the boundary (docs/engines.md)
            "gradient_clipping": float(self.optim.max_grad_norm or 0.0),
            "zero_optimization": {
                "stage": self.zero_stage,
                "overlap_comm": False,
                "contiguous_gradients": True,
                "reduce_scatter": True,
                "reduce_bucket_size": self.reduce_bucket_size,
                "allgather_bucket_size": self.allgather_bucket_size,
            },
            "zero_allow_untested_optimizer": True,  # our torch AdamW (FusedAdam is slow on a CPU: docs/deepspeed.md)
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }


def require_deepspeed() -> Any:
    """Import deepspeed, or explain which extra installs it."""
    if importlib.util.find_spec("deepspeed") is None:
        raise MissingExtraError("trainer engine 'deepspeed' needs the deepspeed package: "
                                "pip install 'streamflow[deepspeed]'")
    import deepspeed

    engine_cls = deepspeed.runtime.engine.DeepSpeedEngine
    if not hasattr(engine_cls, "managed_gradient_accumulation"):
        raise MissingExtraError(
            f"deepspeed {deepspeed.__version__} lacks managed_gradient_accumulation=false, which "
            "streamed micro-batches need: pip install -U 'streamflow[deepspeed]'")
    return deepspeed


def start_ranks(backend: str | None = None) -> RankGroup:
    """Join the process group described by torch's launcher (torchrun) and return our view of it."""
    env = rank_env()
    if env is None:
        raise RuntimeError(
            "trainer engine 'deepspeed' runs one process per rank started by torch's launcher: "
            "python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1 "
            "--master-port P -m workers.main --role trainer --config F")
    deepspeed = require_deepspeed()
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(
        dist_backend=backend or get_accelerator().communication_backend_name(),
        auto_mpi_discovery=False, verbose=False)
    return RankGroup(env.rank, env.world_size)


class DeepSpeedTrainerEngine:
    """A ``TrainerEngine`` on DeepSpeed ZeRO-1/2. Build it on every rank, after ``start_ranks``."""

    def __init__(self, model: torch.nn.Module, settings: DeepSpeedSettings,
                 ranks: RankGroup) -> None:
        deepspeed = require_deepspeed()
        from deepspeed.runtime.utils import register_output_backward_hooks

        self._register_hooks = register_output_backward_hooks
        self.settings = settings
        self.ranks = ranks
        model.train()
        # Same optimizer as TorchTrainerEngine (AdamW, foreach off); ZeRO wraps it and steps it on
        # this rank's flat fp32 partition.
        o = settings.optim
        optimizer = make_optimizer(model, o.lr, o.weight_decay, o.betas,
                                   warmup_steps=o.warmup_steps)
        self._base_optimizer = optimizer  # ZeRO steps it; its param groups carry the warm-up
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=settings.ds_config(ranks.world_size))
        self.model: torch.nn.Module = self.ds.module
        self.ds.optimizer.override_loss_scale(1.0)  # exactly 1 during backward (docs/engines.md)
        self.last_digests: list[int] = []
        self.steps = 0  # optimizer steps taken by this engine object

    def backward(self, loss: torch.Tensor) -> None:
        # The prologue engine.forward would have hooked on its outputs (we never call it).
        self._register_hooks(loss, preprocess_once_fn=self.ds._backward_prologue)
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, grad_scale: float) -> float:
        if not grad_scale > 0:
            raise ValueError(f"step: grad_scale must be > 0, got {grad_scale}")
        zero = self.ds.optimizer
        zero.override_loss_scale(1.0 / (grad_scale * self.ranks.world_size))
        apply_warmup(self._base_optimizer)
        try:
            self.ds.step()
        finally:
            zero.override_loss_scale(1.0)
        self.steps += 1
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else 0.0
        if self.ranks.is_leader:
            log.info("step %d: grad_norm %.10g", self.steps, grad_norm)
        if self.settings.verify_sync and self.ranks.world_size > 1:
            self.last_digests = self.ranks.check_in_sync(self.model)  # raises RanksOutOfSync
            if self.ranks.is_leader:
                log.info("in sync after step %d: digests %s", self.steps, self.last_digests)
        return grad_norm

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        # ZeRO-1/2 never partition parameters: every rank holds the full weights after step()
        return publishable(self.model.state_dict())

    def save_state(self, directory: str) -> None:
        """Collective: every rank must call it; rank 0's ``directory`` is used by all."""
        path = self.ranks.broadcast_text(directory)
        self.ds.save_checkpoint(path, tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, directory: str) -> None:
        """Collective. DeepSpeed's own files, written by ``save_state`` on this number of ranks."""
        loaded, _ = self.ds.load_checkpoint(directory, tag=CHECKPOINT_TAG,
                                            load_optimizer_states=True,
                                            load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in {directory}")
        self.ds.optimizer.override_loss_scale(1.0)
