"""End to end: `streamflow run` of a gateway run (agent.fn) through real processes: an agent
written with the OpenAI SDK drives the built-in model through the gateway, every call a turn of
its episode's row; and the run loses no turn and answers no call twice while the gateway, the
rollout worker and the agent worker are each SIGKILLed mid-run (docs/agents.md "When a process
dies")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from testkit import wait_until

from streamflow.tracefile import read_trace

ROOT = Path(__file__).resolve().parents[2]
AGENT = ("rollout.max_turns=3", "agent.fn=tests.streamflow.gateway_agents:two_calls",
         "agent.episodes_per_worker=16", "run.eval_every=0", "rollout.max_new_tokens=6",
         "rollout.max_total_tokens=24", "data.prompts_per_iteration=8", "data.group_size=2",
         "trainer.rows_per_claim=16", "run.stall_timeout_s=120")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _served_calls(out: Path) -> dict[tuple[int, int], dict]:
    """(row, call) -> what the gateway fed and answered; a call logged twice (a repeat answered
    from the row) must have been answered identically."""
    calls: dict[tuple[int, int], dict] = {}
    for line in _lines(out / "gateway-served.jsonl"):
        key = (line["row_id"], line["call"])
        assert calls.setdefault(key, line) == line, f"call {key} answered two ways"
    return calls


def _run(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"), *AGENT,
         f"run.output_dir={out}", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, text=True)


def test_an_openai_sdk_agent_drives_a_run_through_the_gateway(model_cache, tmp_path) -> None:
    out = model_cache / f"{tmp_path.name}-agent"
    proc = _run(out, "run.iterations=2")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["dead_rows"] == 0, summary
    assert [r["samples"] for r in _lines(out / "metrics.jsonl")] == [16, 16]
    calls = _served_calls(out)
    rows = {row for row, _ in calls}
    assert len(rows) == 32  # every episode called
    # two calls each, unless the first answer left no room for a second under the budget
    assert sum(1 for row, call in calls if call == 1) >= 16
    assert summary["stage_busy_seconds"].get("agent", 0.0) > 0.0
    # the row trace holds the gateway's part: its claims, its writes of each call (tool
    # "agent": the agent's seconds between answers) and acks, beside the rollout's turns
    trace = read_trace(out / "trace").to_pylist()
    gateway = [r for r in trace if r["worker"] == "gateway-0"]
    assert {r["event"] for r in gateway} >= {"claim", "write", "ack"}
    writes = [r for r in gateway if r["event"] == "write"]
    assert {r["task"] for r in writes} >= {"open", "env.1"}  # (turn 0 is piece 0)
    assert all(r["tool"] == "agent" and r["tool_seconds"] >= 0 for r in writes)
    assert {r["row_id"] for r in writes if r["task"] == "open"} == rows


def _worker(proc: subprocess.Popen, name: str) -> psutil.Process | None:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if f"/{name}.json" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow
def test_killing_gateway_rollout_and_agent_workers_loses_no_turn(model_cache, tmp_path) -> None:
    """Each of the three is SIGKILLed once, after the gateway has answered more calls: the
    supervisor restarts it, the leases it held come back within store.lease_seconds, and the
    run trains every iteration with every sample: no call was answered two ways (a repeat is
    answered from the row), no row is dead, none left in flight."""
    out = model_cache / f"{tmp_path.name}-agent-kills"
    proc = _run(out, "run.iterations=4", "store.lease_seconds=2", "run.max_restarts=2")
    try:
        def served() -> int:
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            path = out / "gateway-served.jsonl"
            return len(path.read_text().splitlines()) if path.exists() else 0

        # (about 32 calls an iteration: each kill lands in its own iteration)
        for victim, after in (("gateway-0", 16), ("rollout-0", 40), ("agent-0", 64)):
            wait_until(lambda n=after: served() >= n, timeout=240, what=f"{after} calls served")
            wait_until(lambda v=victim: _worker(proc, v), timeout=60, what=victim).kill()
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 4, summary
    assert summary["worker_restarts"] == {"gateway-0": 1, "rollout-0": 1, "agent-0": 1}
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    assert [r["samples"] for r in _lines(out / "metrics.jsonl")] == [16] * 4
    _served_calls(out)
