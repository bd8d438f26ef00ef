"""StreamFlow's side of ``streamflow bench phases``: one sync iteration in this process, per stage.

The same path ``streamflow run`` takes in ``sync`` mode (``Controller._run_colocated``):
``build_plan`` turns the run config into worker configs, the ``workers.roles.build`` builders make the
rollout stage (torch rollout engine), the reward stage, the reference stage and the trainer (torch
trainer engine), and ``StageLoop``s drain each stage over an embedded store before the trainer
polls its step. So whatever the engines, packing or the trainer do in this build is what is timed.

Per iteration, each stage's drain is timed on its own. Weight movement is not part of a phase:
the rollout's load of the new policy (``WeightSyncReport.seconds``) is taken out of generation
and the trainer's publish (``StepReport.publish_seconds``) out of the train step; both are
reported beside the phases (``weight_sync``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import storage
from streamflow.config import RunConfig
from streamflow.plan import build_plan
from workers.roles.build import build_reference, build_reward, build_rollout, build_trainer
from workers.roles.loop import LeaseKeeper, StageLoop
from workers.runtime.events import EventSender, StepReport, WeightSyncReport


@dataclass
class StreamFlowTimes:
    """Seconds of one sync iteration, per phase (weight movement taken out) and in all."""

    generation: float
    reward: float
    reference: float
    train_step: float
    weight_sync: float  # rollout load + trainer publish
    total: float
    reward_mean: float


class StreamFlowSync:
    """The colocated sync loop over ``cfg`` (which must give the reference its own worker)."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.plan = plan = build_plan(cfg, run_dir)
        if plan.reference is None:
            raise ValueError("bench phases: the StreamFlow side needs reference.placement=worker "
                             "and trainer.kl_coef > 0 (the reference forward is a phase)")
        self._stack = contextlib.ExitStack()
        store = self._stack.enter_context(storage.embedded(plan.store.num_shards))
        self.client = store.client()
        self.client.create_table(plan.table_spec)
        self.events: Any = EventSender(None)  # reports stay in memory (events.sent)
        self.keeper = LeaseKeeper(store.client)
        self.reward_stage = build_reward(plan.reward)
        stages = {
            "rollout": build_rollout(plan.rollout, self.events),
            "reward": self.reward_stage,
            "reference": build_reference(plan.reference),
        }
        self.trainer = build_trainer(plan.trainer, self.client, self.events, self.keeper)
        self.trainer.publish_current()
        self.loops = {
            role: StageLoop(self.client, plan.table, stage, worker=f"{role}-0", role=role,
                            events=self.events, keeper=self.keeper)
            for role, stage in stages.items()
        }

    def _put_iteration(self, k: int) -> None:
        """The prompts of iteration ``k`` (as the controller puts them)."""
        self.client.put(self.plan.table, self.plan.prompt_rows(k, 0), timeout=600.0)

    def iteration(self, k: int) -> StreamFlowTimes:
        t0 = time.perf_counter()
        self._put_iteration(k)
        seconds: dict[str, float] = {}
        for role, loop in self.loops.items():
            start = time.perf_counter()
            while loop.turn(0.0):  # the last (empty) claim carries the last write+ack
                pass
            seconds[role] = time.perf_counter() - start
        start = time.perf_counter()
        while not self.trainer.poll(0.0):
            pass
        seconds["trainer"] = time.perf_counter() - start
        total = time.perf_counter() - t0
        sent, self.events.sent = self.events.sent, []
        loads = sum(r.seconds for r in sent if isinstance(r, WeightSyncReport))
        steps = [r for r in sent if isinstance(r, StepReport)]
        if len(steps) != 1:
            raise RuntimeError(f"bench phases: iteration {k} gave {len(steps)} trainer steps")
        publish = steps[0].publish_seconds
        return StreamFlowTimes(
            generation=seconds["rollout"] - loads, reward=seconds["reward"],
            reference=seconds["reference"], train_step=seconds["trainer"] - publish,
            weight_sync=loads + publish, total=total, reward_mean=steps[0].reward_mean,
        )

    def close(self) -> None:
        self.keeper.close()
        self.reward_stage.close()
        self.client.close()
        self._stack.close()
        self.plan.cleanup()
