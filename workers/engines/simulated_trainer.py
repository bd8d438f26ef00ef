"""The ``simulated`` trainer: the real ``Trainer`` lifecycle over a simulated training engine.

Owns only the wiring. Everything a trainer does with its rows (claim whole groups, park later
iterations, never train a row twice, drop dead groups, step once every row of the iteration is in,
publish, report, ack after the step) is ``workers.trainer.Trainer``'s own code; the compute is
``SimulatedTriModel`` (a device hold of ``cost.train_s`` per micro-batch, zero log-probs) and
``SimulatedTrainingEngine`` (``cost.step_s`` per optimizer step, a one-tensor "weights" file per
version), both in ``workers.engines.simulated``. Kept apart from that module because the trainer
imports torch, which the simulated rollout, reward and reference roles do not need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from workers.config import TrainerWorkerConfig
from workers.engines.simulated import Device, SimulatedTrainingEngine, SimulatedTriModel
from workers.loop import LeaseKeeper
from workers.trainer import Trainer
from workers.weights import WeightPublisher


class SimulatedTrainer(Trainer):
    """``Trainer`` whose device is simulated (see the module docstring); one rank, no checkpoints."""

    def __init__(
        self,
        client: Any,
        cfg: TrainerWorkerConfig,
        publisher: WeightPublisher,
        *,
        send: Callable[[Any], None] = lambda r: None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        if cfg.common.simulated is None:
            raise ValueError("trainer engine 'simulated' needs common.simulated (the device)")
        device = Device(cfg.common.simulated)
        # the simulated forward prices rows, not a packed layout
        settings = dataclasses.replace(cfg, pack=dataclasses.replace(cfg.pack, packing=False))
        super().__init__(
            client, cfg.common.table, SimulatedTrainingEngine(device),
            SimulatedTriModel(device, reference=not cfg.reference_worker),  # type: ignore[arg-type]
            settings, publisher, worker=cfg.common.name, send=send, keeper=keeper,
        )
        self.device = device
