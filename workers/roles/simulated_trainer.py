"""The ``simulated`` trainer role: the real ``Trainer`` lifecycle over the simulated training
engine of ``workers.engines.simulated`` (a role, so above the engines; kept apart: the trainer
imports torch, the other simulated roles do not). See docs/engines.md, "The simulated trainer".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from workers.config import TrainerWorkerConfig
from workers.engines.simulated import Device, SimulatedTrainingEngine, SimulatedTriModel
from workers.roles.trainer import Trainer
from workers.runtime.leases import LeaseKeeper
from workers.weights.file_sync import WeightPublisher


class SendingPublisher:
    """The real publisher, after the trainer's device held the send of the version to the rollout
    engines (``cost.sync_s``): a run's next training starts no earlier than a real one could."""

    def __init__(self, inner: WeightPublisher, device: Device) -> None:
        self.inner, self.device = inner, device

    def publish(self, state: Any, version: int) -> Any:
        self.device.hold(self.device.cost.sync_s())
        return self.inner.publish(state, version)

    def __getattr__(self, name: str) -> Any:  # close(), ... : the real publisher's
        return getattr(self.inner, name)


class SimulatedTrainer(Trainer):
    """``Trainer`` whose devices are simulated (docs/engines.md): ``num_ranks`` data-parallel
    devices modelled in this one process (no launcher), no checkpoints."""

    def __init__(
        self,
        client: Any,
        cfg: TrainerWorkerConfig,
        publisher: WeightPublisher,
        *,
        send: Callable[[Any], None] = lambda r: None,
        keeper: LeaseKeeper,
    ) -> None:
        if cfg.common.simulated is None:
            raise ValueError("trainer engine 'simulated' needs common.simulated (the device)")
        device = Device(cfg.common.simulated)
        # the simulated forward prices rows, not a packed layout
        settings = dataclasses.replace(cfg, pack=dataclasses.replace(cfg.pack, packing=False))
        super().__init__(
            client, cfg.common.table,
            SimulatedTrainingEngine(device, updates_per_batch=cfg.grpo.updates_per_batch,
                                    devices=cfg.num_ranks),
            SimulatedTriModel(device, reference=not cfg.reference_in_store,  # type: ignore[arg-type]
                              devices=cfg.num_ranks),
            settings, SendingPublisher(publisher, device),  # type: ignore[arg-type]
            worker=cfg.common.name, send=send, keeper=keeper,
        )
        self.device = device
