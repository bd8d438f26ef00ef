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

from collections.abc import Callable
from typing import Any

from workers.config import SimulatedDevice
from workers.engines.simulated import Device, SimulatedTrainingEngine, SimulatedTriModel
from workers.loop import LeaseKeeper
from workers.trainer import Trainer, TrainerSettings
from workers.weights import WeightPublisher


class SimulatedTrainer(Trainer):
    """``Trainer`` whose device is simulated (see the module docstring); one rank, no checkpoints."""

    def __init__(
        self,
        client: Any,
        table: str,
        spec: SimulatedDevice,
        publisher: WeightPublisher,
        *,
        rows_per_iteration: int,
        group_size: int,
        rows_per_claim: int,
        reference_worker: bool,
        std_normalize: bool = True,
        worker: str = "trainer-0",
        send: Callable[[Any], None] = lambda r: None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        device = Device(spec)
        settings = TrainerSettings(
            rows_per_iteration=rows_per_iteration, group_size=group_size,
            reference_worker=reference_worker, std_normalize=std_normalize,
            rows_per_claim=rows_per_claim,
            packing=False,  # the simulated forward prices rows, not a packed layout
        )
        super().__init__(
            client, table, SimulatedTrainingEngine(device),
            SimulatedTriModel(device, reference=not reference_worker),  # type: ignore[arg-type]
            settings, publisher, worker=worker, send=send, keeper=keeper,
        )
        self.device = device
