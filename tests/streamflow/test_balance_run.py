"""A streaming run with ``store.balancer`` on (2 shards, 2 reward workers): the controller starts
the coordinator, every stage worker joins its (table, task) group, owns shards, and leaves cleanly;
the run's result is that of a run without the balancer (same rows trained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import storage.coordinator as coordinator_module
from streamflow.controller import run


@pytest.mark.slow
def test_periodic_run_with_the_balancer(tiny_config, monkeypatch) -> None:
    made: list[coordinator_module.Coordinator] = []

    class Recording(coordinator_module.Coordinator):
        def start(self, timeout: float = 10.0) -> coordinator_module.Coordinator:
            made.append(self)
            return super().start(timeout)

    monkeypatch.setattr(coordinator_module, "Coordinator", Recording)
    cfg = tiny_config("run.mode=periodic", "run.iterations=1", "run.eval_every=0",
                      "store.num_shards=2", "reward.num_workers=2")
    summary = run(cfg)
    assert summary.status == "ok"
    assert len(made) == 1 and not made[0].running  # started once, stopped with the run
    coord = made[0]
    configs = list((Path(cfg.run.output_dir) / "workers").glob("*.json"))
    for path in configs:
        assert json.loads(path.read_text())["common"]["coordinator_address"] == coord.address
    (table,) = {t for t, _ in coord._groups}
    groups = {task: b for (_, task), b in coord._groups.items()}
    assert {"rollout", "reward"} <= set(groups)
    reward = groups["reward"]
    assert reward.generation > 0 and sorted(reward.owner) == [0, 1]
    # Both reward workers joined and left cleanly (a leave frees what they owned).
    m = coord.metrics
    assert m.reassignments.labels(table, "reward", "leave")._value.get() >= 1
    assert not reward.members  # everyone left at the end of the run
