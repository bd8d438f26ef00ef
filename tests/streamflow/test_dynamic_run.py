"""Dynamic sampling end to end: a tiny run whose solved prompts (even answers, scored 1.0 by every
sample: tests/streamflow/solved_rewards.py) have zero reward variance, in sync and through worker
processes, and a run whose prompts are all solved."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from testkit import no_children_left

from streamflow import trace
from streamflow.controller import run
from workers.tasks.arithmetic import ArithmeticTask

P, G = 4, 2  # configs/tiny.yaml: data.prompts_per_iteration, data.group_size
ON = ("trainer.dynamic_sampling=on", "run.eval_every=0", "run.trace=true", "run.iterations=1",
      "run.plots=false", "rollout.groups_per_claim=1", "trainer.kl_coef=0",
      "metrics.enabled=false")


def _records(cfg) -> list[dict]:
    path = Path(cfg.run.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_trainer_trace(cfg, records: list[dict]) -> None:
    """Every step trained P groups, none of them solved; every row the trainer claimed was acked
    once (trained or not); the groups of k it claimed before its step and did not train are
    exactly the ones its record counts as filtered or surplus."""
    task = ArithmeticTask(digits=cfg.data.digits, operations=tuple(cfg.data.operations),
                          seed=cfg.data.seed)
    stream = list(task.train_problems(max(r["prompts_put"] for r in records) * 4))
    events = [e for e in trace.load(cfg.run.output_dir).to_pylist() if e["task"] == "trainer"]
    claimed: dict[int, float] = {}  # row -> claim time
    done: dict[int, str] = {}
    trained: dict[int, set[int]] = defaultdict(set)
    step_at: dict[int, float] = {}
    group_of, iteration_of = {}, {}
    for e in events:
        row = e["row_id"]
        group_of[row], iteration_of[row] = e["group_id"], e["iteration"]
        if e["event"] == "claim":
            assert row not in claimed and e["delivery"] == 1, e  # never redelivered
            claimed[row] = e["t"]
        elif e["event"] in ("consume", "ack"):
            assert row not in done, e
            done[row] = e["event"]
        if e["event"] == "consume":
            trained[e["iteration"]].add(e["group_id"])
            step_at.setdefault(e["iteration"], e["t"])
    assert set(done) == set(claimed)  # every claimed row acked: none left for redelivery
    for r in records:
        k = r["iteration"]
        assert len(trained[k]) == P and r["samples"] == P * G  # exactly P groups with variance
        assert all(int(stream[g].answer) % 2 for g in trained[k]), "a solved group was trained"
        before = {group_of[row] for row, t in claimed.items()
                  if iteration_of[row] == k and t < step_at[k]}
        assert len(before - trained[k]) == r["filtered_groups"] + r["surplus_groups"]
    assert sum(r["filtered_groups"] for r in records) > 0


def test_dynamic_sampling_trains_only_groups_with_variance(tiny_config) -> None:
    """Through worker processes (periodic: the trainer's counts reach the controller as reports,
    its top-ups go through the store): solved groups are acked untrained and counted, and the
    step trains P groups with variance (the controller topped the iteration up: more prompts put
    than P). Broken by training a zero-variance group, a step on fewer groups, a filtered row
    never acked (or redelivered), or a top-up never put (the run would stall). (sync's top-ups:
    test_all_solved_prompts_stop_the_run.)"""
    cfg = tiny_config("run.mode=periodic", *ON,
                      "reward.fn=tests.streamflow.solved_rewards:half_solved")
    assert run(cfg).status == "ok"
    no_children_left()
    records = _records(cfg)
    assert [r["iteration"] for r in records] == [0]
    assert records[0]["prompts_put"] > P  # over-provisioned or topped up
    _check_trainer_trace(cfg, records)


def test_all_solved_prompts_stop_the_run(tiny_config) -> None:
    """Every sample scores 1.0: no group ever has variance, so after trainer.solved_patience x
    P prompts (here 8: the first put's 4 and a top-up of 16, sync's colocated loop) the run stops
    with status "solved" and its one line, having trained nothing. Broken by a run that spins
    (the test would time out), by no top-up, or by one that trains on no signal."""
    cfg = tiny_config("run.mode=sync", *ON, "trainer.solved_patience=2",
                      "reward.fn=tests.streamflow.solved_rewards:all_solved")
    summary = run(cfg)
    assert summary.status == "solved"
    assert "no group with reward variance" in summary.error and "\n" not in summary.error
    assert not (Path(cfg.run.output_dir) / "metrics.jsonl").exists() or _records(cfg) == []
    saved = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    assert saved["status"] == "solved"
    puts = [e for e in trace.load(cfg.run.output_dir).to_pylist() if e["event"] == "put"]
    assert len(puts) == (P + P * 4) * G  # P, then (rate 1) P short x the cap 4: two batches
