"""End to end: `streamflow run` of multi-turn trajectories whose tool is an MCP server's
(env.fn mcp, tests/workers/agent/mcp_calculator.py over stdio): the environment worker starts the
server, the built-in model's calculator calls are answered by it without error, and the run
finishes with the server stopped. The calls themselves: tests/workers/agent/test_mcp_tools.py.

A warm start written wholly as calculator tapes (model.warmstart_tool_fraction=1) makes the
built-in model call on nearly every prompt: untrained, its calls are malformed and never reach
a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from testkit import no_children_left, wait_until

from streamflow.controller import run

SERVER = Path(__file__).resolve().parents[1] / "workers" / "agent" / "mcp_calculator.py"
CALLING = ("rollout.max_turns=2", "run.iterations=1", "run.eval_every=0",
           "data.prompts_per_iteration=8", "data.group_size=2", "rollout.max_new_tokens=12",
           "model.warmstart_steps=300", "model.warmstart_tool_fraction=1.0",
           "model.warmstart_lr=3e-3", "model.builtin.hidden_size=64",
           "model.builtin.intermediate_size=128")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_periodic_run_calls_the_mcp_servers_tools(tiny_config, tmp_path) -> None:
    log = tmp_path / "calls.log"
    command = json.dumps([sys.executable, str(SERVER), "--log", str(log)])
    cfg = tiny_config("run.mode=periodic", *CALLING, "env.fn=mcp", f"env.mcp_command={command}")
    summary = run(cfg)
    no_children_left()
    out = Path(cfg.run.output_dir)
    assert summary.status == "ok" and summary.iterations == 1
    events = pq.read_table(out / "trace").to_pylist()
    calls = [(e["tool"], e["error"]) for e in events if e["task"] == "env.1" and e["tool"]]
    assert calls and set(calls) == {("calculator", None)}, calls  # every one answered
    answered = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert len(answered) >= len(calls)  # by the server (a redelivered row may ask again)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rows = cfg.data.prompts_per_iteration * cfg.data.group_size
    assert round(record["tool_calls_mean"] * rows) == len(calls)
    pids = {int(pid) for pid, _ in answered}
    assert len(pids) == 1  # one server for the worker's whole run, stopped with the worker
    wait_until(lambda: all(_gone(pid) for pid in pids), timeout=10, what="the server to exit")
