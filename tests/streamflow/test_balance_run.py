"""A streaming run with ``store.balancer`` on (2 shards, 2 reward workers): the controller starts
the coordinator, every stage worker joins its (table, task) group, owns shards, and leaves cleanly;
the run's result is that of a run without the balancer (same rows trained). The coordinator serves
its metrics on its own endpoint, listed in the run's Prometheus targets, and is scraped during the
run and at its end."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import storage.coordinator as coordinator_module
from streamflow.controller import run
from streamflow.metrics import targets_path

Samples = dict[tuple[str, frozenset], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def owned(samples: Samples, task: str) -> dict[str, float]:
    """streamflow_coordinator_owned_shards of one task, by consumer."""
    return {dict(labels)["consumer"]: v for (name, labels), v in samples.items()
            if name == "streamflow_coordinator_owned_shards" and dict(labels)["task"] == task}


@pytest.mark.slow
def test_periodic_run_with_the_balancer(tiny_config, monkeypatch) -> None:
    made: list[coordinator_module.Coordinator] = []
    during: list[Samples] = []  # scrapes of the coordinator's /metrics while the run goes
    final: list[Samples] = []  # the last scrape, as the controller stops the coordinator
    targets_seen: list[list] = []  # targets.json as it stood when the coordinator stopped

    class Recording(coordinator_module.Coordinator):
        def start(self, timeout: float = 10.0) -> coordinator_module.Coordinator:
            made.append(self)
            super().start(timeout)
            self._scraping = threading.Event()
            self._scraper = threading.Thread(target=self._scrape_loop, daemon=True)
            self._scraper.start()
            return self

        def _scrape_loop(self) -> None:
            while not self._scraping.wait(0.05):
                try:
                    during.append(scrape(f"127.0.0.1:{self.metrics_port}"))
                except OSError:
                    pass

        def stop(self, timeout: float = 10.0) -> None:
            self._scraping.set()
            self._scraper.join(5)
            final.append(scrape(f"127.0.0.1:{self.metrics_port}"))
            targets_seen.append(json.loads(targets_path(cfg.run.output_dir).read_text()))
            super().stop(timeout)

    monkeypatch.setattr(coordinator_module, "Coordinator", Recording)
    cfg = tiny_config("run.mode=periodic", "run.iterations=1", "run.eval_every=0",
                      "store.num_shards=2", "reward.num_workers=2")
    assert cfg.metrics.enabled
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
    # No churn: two equal workers on an even workload never trigger a depth move (hysteresis).
    assert m.reassignments.labels(table, "reward", "balance")._value.get() == 0

    # The coordinator had its own metrics endpoint, listed in targets.json like the other
    # processes (the file as it stood during the run, and as the run left it).
    address = f"127.0.0.1:{coord.metrics_port}"
    for groups_file in (targets_seen[0], json.loads(targets_path(cfg.run.output_dir).read_text())):
        listed = [g for g in groups_file if g["labels"]["role"] == "coordinator"]
        assert listed == [{"targets": [address], "labels": {
            "role": "coordinator", "worker": "coordinator", "run": cfg.run.name}}]
        assert {g["labels"]["role"] for g in groups_file} >= {"controller", "store", "reward"}
    # Scraped during the run: each reward worker was seen owning shards, and the per-consumer
    # gauges never added up to more shards than the table has (one owner per shard).
    assert during, "the coordinator's endpoint never answered during the run"
    for samples in during:
        assert sum(owned(samples, "reward").values()) <= 2
    for worker in ("reward-0", "reward-1"):
        assert any(owned(s, "reward").get(worker, 0) >= 1 for s in during), \
            (worker, [owned(s, "reward") for s in during][-40:])
    # Scraped at the end: reassignments by reason, members gone, the imbalance gauge present.
    (last,) = final
    leave = ("streamflow_coordinator_reassignments_total",
             frozenset({"table": table, "task": "reward", "reason": "leave"}.items()))
    assert last[leave] >= 1
    alive = ("streamflow_coordinator_consumers_alive",
             frozenset({"table": table, "task": "reward"}.items()))
    assert last[alive] == 0
    ratio = ("streamflow_coordinator_depth_imbalance_ratio",
             frozenset({"table": table, "task": "reward"}.items()))
    assert ratio in last
    assert owned(last, "reward") == {}  # who left owns nothing
