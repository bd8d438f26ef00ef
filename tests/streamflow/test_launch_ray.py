"""`streamflow launch --backend ray` on a real two-node Ray cluster (two raylets on 127.0.0.2 and
127.0.0.3 of this machine: Ray swaps 127.0.0.1 for the machine's main address), and its checks.

One run places the store, controller and trainer on node A and rollout/reward/reference on node B;
mid-run node B is killed (every process of that Ray node, SIGKILL). Its node launcher is placed
again (on A, the only node left), its workers come back, no row is lost, and the run ends with the
parameters of the same config on one host. The cluster is started and stopped by pid here: never
`ray stop`, which kills every Ray of the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from testkit import wait_until

from storage.ports import free_port
from streamflow.launch import LaunchError
from streamflow.launch_ray import check_fits, node_bundles, parse_resources
from tests.streamflow import slow_reward, test_launch
from tests.streamflow.test_launch import COMMON, _max_diff, _params

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"
HEAD, WORKER = "127.0.0.2", "127.0.0.3"
WORKER_PORTS = (23000, 23999)  # Ray workers' ports: the head's half, then node B's
pytestmark = pytest.mark.ray
one_host = test_launch.one_host  # the same config on one host, in-process (the reference)


def _port() -> int:
    """A free port outside Ray's default worker port range (a head port inside it fails) and
    outside the worker port ranges given to the two nodes here."""
    while (port := free_port(HEAD)) < 20000 or WORKER_PORTS[0] <= port <= WORKER_PORTS[1]:
        pass
    return port


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


class RayCluster:
    """`ray start --block` for the head (A) and one worker node (B): each stays the parent of
    its node's daemons, so the node is stopped (or killed) by its process tree."""

    def __init__(self, tmp: Path, marks: Path) -> None:
        self.tmp, self.port = tmp, _port()
        self.address = f"{HEAD}:{self.port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                    slow_reward.SCORING_DIR_ENV: str(marks)}
        self.nodes: dict[str, subprocess.Popen] = {}
        self.seen: set[psutil.Process] = set()  # every process of either node seen so far

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115
        self.nodes[name] = subprocess.Popen(
            [str(RAY), "start", "--block", "--num-cpus", "8", "--disable-usage-stats",
             "--object-store-memory", "100000000", *args], stdout=log, stderr=subprocess.STDOUT,
            env=self.env, cwd=ROOT, start_new_session=True)

    def start(self) -> None:
        self._start("head", ["--head", "--port", str(self.port), "--node-ip-address", HEAD,
                             "--include-dashboard=false", "--temp-dir", str(self.tmp / "ray"),
                             "--resources", '{"node_a": 1}', "--min-worker-port", "23000",
                             "--max-worker-port", "23499"])

        def gcs_up() -> bool:
            assert self.nodes["head"].poll() is None, (self.tmp / "head.log").read_text()
            with contextlib.suppress(OSError), socket.create_connection((HEAD, self.port), 1):
                return True
            return False

        wait_until(gcs_up, timeout=60, what="the Ray head's GCS")
        self.start_b()

    def start_b(self) -> None:
        """Node B joins the head (again, after a test killed it: the driver waits for it)."""
        ports = {k: str(_port()) for k in (
            "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")}
        self._start("b", ["--address", self.address, "--node-ip-address", WORKER,
                          "--min-worker-port", "23500", "--max-worker-port", "23999",
                          *(x for kv in ports.items() for x in kv)])

    def snapshot(self, name: str) -> list[psutil.Process]:
        procs = _tree(self.nodes[name].pid)
        self.seen.update(procs)
        return procs

    def kill(self, name: str) -> None:
        """The node dies: every process of its tree at once, no goodbye."""
        _kill(self.snapshot(name))

    def stop(self) -> None:
        for name in list(self.nodes):
            self.snapshot(name)
        for popen in self.nodes.values():  # --block: SIGTERM stops that node's daemons
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        for popen in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(20)
        _kill([p for p in self.seen if p.is_running()])  # what outlived its node (log_monitor...)


@pytest.fixture(scope="module")
def ray_cluster():
    tmp = Path(tempfile.mkdtemp(prefix="sfray-", dir="/tmp"))  # Ray's socket paths must be short
    (tmp / "marks").mkdir()
    cluster = RayCluster(tmp, tmp / "marks")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the nodes' sessions and logs


def _launch(cluster: RayCluster, out: Path, *args: str) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}-driver.log", "w")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "streamflow", "launch", str(ROOT / "configs" / "tiny.yaml"),
         f"run.output_dir={out}", *args, "--backend", "ray", "--address", cluster.address],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


PLACEMENT = ("placement.nodes=[{host: 127.0.0.1, store_nodes: 1, trainer: 1}, "
             "{host: 127.0.0.1, rollout: 1, reward: 1, reference: 1}]")


def _run_family(out: Path) -> list[psutil.Process]:
    """Every process of the run: the node launchers (their argv names the run directory, wherever
    Ray started them) and everything below them."""
    found: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        if any(f"run.output_dir={out}" == a for a in p.info["cmdline"] or ()):
            found.extend(_tree(p.pid))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_of_the_driver_stops_every_node_in_order(ray_cluster, model_cache: Path) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the driver's process group, mid-run. Breaks if:
    the driver leaves the launchers to Ray's kill (a worker would die holding leases: rows in
    flight or redelivered, restarts, no summary), node 0 is not told first (status not
    `interrupted` by SIGTERM), the exit is not 130, or any process of the run outlives it on
    either node."""
    out = model_cache / "ray-ctrl-c"
    if ray_cluster.nodes["b"].poll() is not None:  # a test before this one killed node B
        ray_cluster.start_b()
    driver = _launch(ray_cluster, out, *COMMON, "run.iterations=1000", "store.lease_seconds=60",
                     PLACEMENT, "--node-resources", "0:node_a=1")
    log = out.parent / f"{out.name}-driver.log"
    metrics = out / "metrics.jsonl"
    try:
        def running() -> bool:  # an iteration done, and node B's workers up
            assert driver.poll() is None, log.read_text()[-3000:]
            b_pids = {p.pid for p in ray_cluster.snapshot("b")}
            on_b = any(p.pid in b_pids and "rollout" in " ".join(p.cmdline())
                       for p in _run_family(out) if p.is_running())
            return on_b and metrics.exists() and bool(metrics.read_text().strip())

        wait_until(running, timeout=150, what="an iteration over both Ray nodes")
        family = _run_family(out)
        assert len(family) >= 6, family  # 2 launchers; store, controller, trainer; rollout...
        os.killpg(driver.pid, signal.SIGINT)
        sent = time.monotonic()
        code = driver.wait(120)
        took = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "stopping the run" in text and "Traceback" not in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGTERM", summary
    assert summary["in_flight_rows"] == 0 and summary["redelivered_rows"] == 0, summary
    assert summary["worker_restarts"] == {}, summary["worker_restarts"]
    _, alive = psutil.wait_procs(family, timeout=15)
    assert alive == [], alive
    assert _run_family(out) == []
    print(f"Ctrl-C of the Ray driver to its exit: {took:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_two_nodes_equal_one_host_through_a_node_kill(ray_cluster, one_host,
                                                          model_cache: Path) -> None:
    """Breaks if: the nodes are not spread (B never runs rollout-0), a lost node launcher is not
    placed again (the run fails on node B's silence), rows of the killed workers are lost or
    trained twice (parameters differ, dead rows), or metrics targets miss a node."""
    out = model_cache / "ray-two-nodes"
    marks = ray_cluster.tmp / "marks"
    driver = _launch(ray_cluster, out, *COMMON, "run.iterations=2", "store.lease_seconds=2",
                     "placement.node_timeout_s=30", "reward.fn=tests.streamflow.slow_reward:score",
                     PLACEMENT, "--node-resources", "0:node_a=1")
    log = out.parent / f"{out.name}-driver.log"
    try:
        def b_is_scoring() -> bool:  # iteration 1 is admitted and B's reward worker holds rows
            assert driver.poll() is None, log.read_text()[-3000:]
            for name, node in ray_cluster.nodes.items():
                assert node.poll() is None, (ray_cluster.tmp / f"{name}.log").read_text()[-3000:]
            lines = [x for m in marks.glob("*") for x in m.read_text().split()]
            b_pids = {p.pid for p in ray_cluster.snapshot("b")}
            on_b = any(p.name().startswith("python") and "reward" in " ".join(p.cmdline())
                       for p in map(psutil.Process, b_pids) if p.is_running())
            return on_b and bool(lines) and time.time() - float(max(lines)) < 0.2

        wait_until(b_is_scoring, timeout=120, what="node B's reward worker to score a row")
        ray_cluster.kill("b")
        code = driver.wait(240)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)
    text = log.read_text()
    assert code == 0, text[-3000:] + (out / "logs" / "launcher-0.log").read_text()[-3000:]
    assert f"node 1's launcher placed again on {HEAD}" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 2, summary
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0, summary
    assert summary["redelivered_rows"] >= 1, summary  # the killed workers' leases expired
    targets = json.loads((out / "prometheus" / "targets.json").read_text())
    hosts = {t["targets"][0].rsplit(":", 1)[0] for t in targets}
    assert WORKER in hosts and HEAD in hosts, targets  # node B's workers were scraped there
    diff = _max_diff(one_host, _params(out, 2))
    assert diff <= 1e-6, diff


def test_ray_unreachable_address_fails_fast() -> None:
    """Breaks if the driver leaves Ray retrying: a closed port answers in well under a second."""
    port = _port()
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "streamflow", "launch", str(ROOT / "configs" / "tiny.yaml"),
         PLACEMENT, "--backend", "ray", "--address", f"{HEAD}:{port}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: no Ray cluster at {HEAD}:{port} (Connection refused)"
    assert time.monotonic() - t0 < 15


def test_more_gpus_than_the_cluster_is_one_line_before_anything_starts(ray_cluster) -> None:
    """Breaks if the driver places anything before it compares the config's GPUs with the
    cluster's (the cluster has none: a placement group would wait for GPUs forever)."""
    done = subprocess.run(
        [sys.executable, "-m", "streamflow", "launch", str(ROOT / "configs" / "tiny.yaml"),
         "trainer.device=cuda", PLACEMENT, "--backend", "ray", "--address", ray_cluster.address],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: the config asks Ray for 1 GPUs in all, the cluster has 0"), done.stderr


def test_bundles_count_processes_gpus_and_custom_resources(tiny_config) -> None:
    cfg = tiny_config("trainer.device=cuda", PLACEMENT.replace("127.0.0.1", "10.0.0.1"))
    bundles = node_bundles(cfg, 0, parse_resources(["1:ssd=1,fast=2"], 2))
    assert bundles == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 3.0, "ssd": 1.0, "fast": 2.0}]
    assert node_bundles(tiny_config(PLACEMENT), 0, {}) == [{"CPU": 3.0}, {"CPU": 3.0}]
    with pytest.raises(LaunchError, match=r"asks Ray for 1 GPUs in all, the cluster has 0$"):
        check_fits(bundles, [{"CPU": 8.0, "ssd": 1.0, "fast": 2.0}] * 2)
    with pytest.raises(LaunchError, match="no Ray node can hold placement node 1"):
        check_fits([{"CPU": 1.0}, bundles[1]], [{"CPU": 8.0, "ssd": 1.0}, {"CPU": 8.0, "fast": 2.0}])
    with pytest.raises(LaunchError, match="--node-resources"):
        parse_resources(["2:x=1"], 2)


def test_no_ray_installed_is_one_line(monkeypatch) -> None:
    from streamflow.launch_ray import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets without the package
    with pytest.raises(LaunchError, match=r"^--backend ray needs the ray package: pip install"):
        import_ray()
