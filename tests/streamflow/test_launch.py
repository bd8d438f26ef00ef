"""`streamflow launch` across real network namespaces ("hosts" joined by a bridge, tests/netns.py).

The store, rollout and trainer sit in different namespaces, each with its own weights directory
(weights travel over the trainer's ZeroMQ fetch server), and the run ends with the parameters of
a one-host run of the same config. Then a network cut of a namespace for longer than the lease:
its workers' rows go to workers elsewhere, their late writes are fenced, every row is trained
exactly once, and the run completes with the same parameters again. And the DeepSpeed trainer with
one rank in each of two namespaces, started by each node's torchrun, gives the one-host parameters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from testkit import wait_until

from streamflow.controller import run
from tests.streamflow import slow_reward

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_sf_netns", ROOT / "tests" / "netns.py")
netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns)

COMMON = (
    "run.mode=periodic",
    "run.eval_every=0",
    "rollout.groups_per_claim=1",
    "reward.rows_per_claim=2",
)
PORT = 29611  # the coordinator's port inside namespace 0 (a fresh namespace: nothing else binds)


def _params(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _placement(hosts, nodes: list[dict]) -> str:
    items = [
        ", ".join([f"host: {hosts.addresses[i]}", *(f"{k}: {v}" for k, v in n.items())])
        for i, n in enumerate(nodes)
    ]
    return "placement.nodes=[" + ", ".join("{" + i + "}" for i in items) + "]"


def _launch(
    hosts, out: Path, overrides: list[str], env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    procs = []
    n = len(hosts.names)
    for rank in range(n):
        argv = [
            *hosts.exec_argv(rank),
            sys.executable,
            "-m",
            "streamflow",
            "launch",
            str(ROOT / "configs" / "tiny.yaml"),
            *overrides,
            f"run.output_dir={out}",
            "--node-rank",
            str(rank),
            "--nodes",
            str(n),
            "--coordinator",
            f"{hosts.addresses[0]}:{PORT}",
        ]
        log = open(out.parent / f"{out.name}-node{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                argv,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        )
    return procs


# A stuck run fails itself: its controller's run.startup_timeout_s and run.stall_timeout_s (300 s
# each by default) end it with a cause in the node logs. This bound only catches a launcher that
# never exits, so it lies past those and is no guess of how long a run takes on a loaded machine.
RUN_BOUND_S = 700


def _wait(procs: list[subprocess.Popen], timeout_s: float = RUN_BOUND_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        codes.append(p.wait(max(deadline - time.monotonic(), 1)))
    return codes


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _node_log(out: Path, rank: int) -> str:
    return (out.parent / f"{out.name}-node{rank}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def one_host(model_cache: Path, request: pytest.FixtureRequest) -> dict:
    """The reference: the same config on one host, 2 iterations. In-process `sync` (cheap: no
    child processes), which equals `periodic` bitwise with trainer.deterministic (tiny.yaml), as
    test_controller.py::test_periodic_equals_sync_through_processes proves. One run directory
    per module that uses it (test_launch_ray.py too): a second run into the first's would be
    refused as an existing run."""
    from streamflow.config import load_config

    out = model_cache / f"one-host-{request.module.__name__.rsplit('.', 1)[-1]}"
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"run.output_dir={out}",
            *COMMON,
            "run.iterations=2",
            "run.mode=sync",
            "reward.num_workers=2",
            "rollout.num_workers=2",
        ],
    )
    summary = run(cfg)
    assert summary.status == "ok"
    return _params(out, 2)


@pytest.fixture
def hosts():
    if not netns.available():
        pytest.fail("these tests need root to create network namespaces (ip netns)")
    with netns.Hosts(3) as h:
        yield h


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_BOUND_S)
def test_three_namespaces_equal_one_host(one_host, hosts, model_cache: Path) -> None:
    """Coordinator + controller + store in A, rollout/reward/reference in B, trainer in C."""
    out = model_cache / "three-hosts"
    overrides = [  # one worker per role (the one-host run had two: results do not depend on it)
        *COMMON,
        "run.iterations=2",
        _placement(
            hosts, [{"store_nodes": 1}, {"rollout": 1, "reward": 1, "reference": 1}, {"trainer": 1}]
        ),
    ]
    procs = _launch(hosts, out, overrides)
    try:
        codes = _wait(procs)
    finally:
        _kill(procs)
    assert codes == [0, 0, 0], [_node_log(out, r)[-3000:] for r in range(3)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 2
    assert summary["redelivered_rows"] == 0 and summary["dead_rows"] == 0
    # Node B's rollout had no shared directory with the trainer: it fetched every version.
    fetched = (out / "logs" / "node-1" / "rollout-0.log").read_text()
    assert "fetched policy version 1 from tcp://" + hosts.addresses[2] in fetched, fetched[-2000:]
    assert (out / "logs" / "node-2" / "trainer-0.log").exists()
    diff = _max_diff(one_host, _params(out, 2))
    assert diff <= 1e-6, diff


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_BOUND_S)
def test_network_cut_longer_than_the_lease(one_host, hosts, model_cache: Path) -> None:
    """Namespace B (rollout-0, reward-0) is cut off mid-iteration until its lease expired and
    the iteration went on without it."""
    out = model_cache / "cut"
    lease = 2.0
    overrides = [
        *COMMON,
        "run.iterations=2",
        "reward.num_workers=2",
        "rollout.num_workers=2",
        f"store.lease_seconds={lease}",
        "reward.fn=tests.streamflow.slow_reward:score",
        _placement(
            hosts,
            [
                {"store_nodes": 1, "reward": 1},
                {"rollout": 1, "reward": 1},
                {"trainer": 1, "rollout": 1, "reference": 1},
            ],
        ),
    ]
    marks = out.parent / f"{out.name}-scoring"  # when each score began, per namespace
    marks.mkdir()
    procs = _launch(hosts, out, overrides, env={slow_reward.SCORING_DIR_ENV: str(marks)})
    metrics = out / "metrics.jsonl"
    b_scoring = marks / _netns_inode(hosts.names[1])
    try:

        def iteration_done() -> bool:
            assert all(p.poll() is None for p in procs), [
                _node_log(out, r)[-2000:] for r in range(3)
            ]
            return metrics.exists() and bool(metrics.read_text().strip())

        wait_until(iteration_done, timeout=120, what="the first iteration")

        def b_is_scoring() -> bool:  # a score takes 0.25 s from its mark: this one is going on
            assert all(p.poll() is None for p in procs), [
                _node_log(out, r)[-2000:] for r in range(3)
            ]
            starts = b_scoring.read_text().split() if b_scoring.exists() else []
            return bool(starts) and time.time() - float(starts[-1]) < 0.2

        # iteration 1 is admitted: B's reward worker is scoring its rows, holding their lease
        wait_until(b_is_scoring, timeout=60, what="B's reward worker to score a row")
        hosts.cut(1)

        def iteration_1_done() -> bool:
            if len(metrics.read_text().splitlines()) >= 2:
                return True
            assert all(p.poll() is None for p in procs), [
                _node_log(out, r)[-2000:] for r in range(3)
            ]
            return False

        # The cut lasts until iteration 1 is recorded: the trainer cannot step before the rows B
        # holds come back, which they do only once B's lease expired under the cut (the fault
        # under test) and the workers elsewhere processed them.
        wait_until(iteration_1_done, timeout=120, what="iteration 1 with B cut off")
        hosts.heal(1)
        codes = _wait(procs)
    finally:
        hosts.heal(1)  # idempotent: the cable is back whatever happened above
        _kill(procs)
    assert codes == [0, 0, 0], [_node_log(out, r)[-3000:] for r in range(3)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 2
    # The cut-off worker's leases expired and its rows went to the others...
    assert summary["redelivered_rows"] >= 1, summary
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    # ... and its late result, arriving after the heal, was fenced (no split-brain write).
    b_logs = "".join(p.read_text() for p in (out / "logs" / "node-1").glob("*.log"))
    assert "fenced off" in b_logs, b_logs[-3000:]
    # Every row trained exactly once: each step saw exactly one iteration's rows.
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["samples"] for r in lines] == [4 * 2] * 2
    diff = _max_diff(one_host, _params(out, 2))
    assert diff <= 1e-6, diff


DS = ("trainer.engine=deepspeed", "trainer.num_ranks=2", "trainer.lr=0.01")


def _netns_inode(name: str) -> str:
    """What /proc/<pid>/ns/net shows for a process inside namespace ``name``."""
    return f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"


def _rank_line(log: Path, rank: int) -> str:
    """The line `workers.runtime.distributed.describe_rank` wrote when ``rank`` joined the group."""
    text = log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if f"rank {rank} of 2 joined" in x]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_BOUND_S)
def test_deepspeed_ranks_on_two_namespaces(model_cache: Path) -> None:
    """trainer.engine=deepspeed, 2 ranks: rank 0 in namespace A (with the coordinator,
    controller, store, rollout, reward and reference), rank 1 in namespace B. Each node starts its
    rank with torchrun (static rendezvous at A's address); the run ends with the parameters of a
    one-host run of the same config (the torch engine in one process: what the single-host
    DeepSpeed test compares with, at its tolerance)."""
    from streamflow.config import load_config

    overrides = [*COMMON, "run.iterations=2", "trainer.lr=0.01"]
    ref_dir = model_cache / "ds-reference"
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"run.output_dir={ref_dir}", *overrides, "run.mode=sync"],  # sync == periodic, bitwise
    )
    assert run(cfg).status == "ok"
    reference = _params(ref_dir, 2)

    if not netns.available():
        pytest.fail("this test needs root to create network namespaces (ip netns)")
    out = model_cache / "ds-two-hosts"
    nodes = [
        {"store_nodes": 1, "rollout": 1, "reward": 1, "reference": 1, "trainer": 1},
        {"trainer": 1},
    ]
    with netns.Hosts(2, tag="d") as hosts:
        procs = _launch(hosts, out, [*overrides, *DS, _placement(hosts, nodes)])
        try:
            codes = _wait(procs)
        finally:
            _kill(procs)
            hosts.kill_all()  # torchrun's ranks run in sessions of their own
        inodes = [_netns_inode(n) for n in hosts.names]
        addresses = list(hosts.addresses)
    assert codes == [0, 0], [_node_log(out, r)[-3000:] for r in range(2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 2, summary
    assert summary["redelivered_rows"] == 0 and summary["dead_rows"] == 0
    # Each rank's own line: started by torchrun (TORCHELASTIC_RUN_ID set), MASTER_ADDR is A's
    # address, and it ran in its node's namespace with its node's address toward the master.
    assert inodes[0] != inodes[1]
    logs = [out / "logs" / "trainer-0.log", out / "logs" / "node-1" / "trainer-0.1.log"]
    for rank, log in enumerate(logs):
        line = _rank_line(log, rank)
        assert "launcher=torchrun" in line, line
        assert f"MASTER_ADDR={addresses[0]} " in line, line
        assert f"netns={inodes[rank]}," in line, line
        assert f"via {addresses[rank]}," in line, line
    # Both ranks stepped together: the digests all-gathered after the last step are equal.
    synced = [x for x in logs[0].read_text().splitlines() if "in sync after step 2" in x]
    assert len(synced) == 1, logs[0].read_text()[-3000:]
    ds_files = out / "checkpoints" / "step-000002" / "deepspeed"  # one ZeRO partition per rank
    assert (ds_files / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    diff = _max_diff(reference, _params(out, 2))
    print(f"max abs parameter difference, 2 ranks on 2 namespaces vs one host: {diff:.3g}")
    assert diff <= 1e-5, diff
