"""deploy/slurm/streamflow.sbatch on a real Slurm cluster: Debian's slurmctld, two slurmd (n1 at
127.0.0.2, n2 at 127.0.0.3, both on this machine) and a munged of its own, all started here without
systemd and stopped by pid. A short run over the two nodes, requeued mid-run, resumes from its
checkpoint and ends the job with status 0; the backend's checks of the allocation are unit tests
below.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
from streamflow.launch_slurm import SlurmNode, check_allocation

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "streamflow.sbatch"
pytestmark = pytest.mark.slurm

PLACEMENT = ("placement.nodes=[{host: 127.0.0.1, store_nodes: 1, trainer: 1}, "
             "{host: 127.0.0.1, rollout: 1, reward: 1}]")

SLURM_CONF = """\
ClusterName=sftest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket,cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=300
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
NodeName=n1 NodeAddr=127.0.0.2 NodeHostname={host} CPUs=4 Port={n1_port} State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.3 NodeHostname={host} CPUs=4 Port={n2_port} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """munged, slurmctld and two slurmd; each daemonizes, so each is found by its pid file."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.env = {**os.environ, "SLURM_CONF": str(tmp / "slurm.conf")}
        self.pids: dict[str, int] = {}

    def start(self) -> None:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
                pytest.fail(f"{tool} is missing: apt-get install slurm-wlm munge (make test does)")
        self.dir.chmod(0o755)  # munged runs as user munge: its directory lies below this one
        munge = self.dir / "munge"
        munge.mkdir()
        shutil.chown(munge, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged",
                        f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                        f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"],
                       check=True, timeout=30)
        self.pids["munged"] = int((munge / "munged.pid").read_text())
        (self.dir / "state").mkdir()
        (self.dir / "slurm.conf").write_text(SLURM_CONF.format(
            host=os.uname().nodename, dir=self.dir, ctld_port=free_port(),
            n1_port=free_port(), n2_port=free_port()))
        subprocess.run(["/usr/sbin/slurmctld", "-i"], env=self.env, check=True, timeout=30)
        self._pid("slurmctld", self.dir / "slurmctld.pid")
        for node in ("n1", "n2"):
            subprocess.run(["/usr/sbin/slurmd", "-N", node], env=self.env, check=True, timeout=30)
            self._pid(node, self.dir / f"slurmd-{node}.pid")

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=self.env,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            return out == ["idle", "2"]

        wait_until(idle, timeout=60, what="both slurmd idle")

    def _pid(self, name: str, path: Path) -> None:
        wait_until(path.exists, timeout=30, what=f"{name}'s pid file")
        self.pids[name] = int(path.read_text())

    def stop(self) -> None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scontrol", "shutdown"], env=self.env, timeout=30)
        procs = []
        for name, pid in self.pids.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
                if name == "munged":
                    procs[-1].terminate()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def slurm():
    cluster = Slurm(Path(tempfile.mkdtemp(prefix="sfslurm-", dir="/tmp")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.dir, ignore_errors=True)  # configs, state, spool, daemon logs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sbatch_runs_over_two_nodes_and_a_requeued_job_resumes(slurm, model_cache: Path) -> None:
    """A short run over two Slurm nodes, requeued mid-run by `scontrol requeue` (what a
    preemption does): the launchers get SIGTERM and stop the run cleanly, Slurm starts the job
    again (after cred_expire, 5 s here) and run.resume=auto continues from the newest checkpoint.
    Breaks if: the script does not start one launcher per node (the run never gets its rollout
    worker on n2 and fails), a launcher takes the wrong rank or address, the stop is not clean
    (no checkpoint to resume, rows lost), the second attempt starts over (iterations repeated in
    metrics.jsonl) or fails on the first's run directory, or the job's status is not the run's."""
    out = model_cache / "slurm-requeue"
    job_out = slurm.dir / "job.out"
    env = {**slurm.env, "STREAMFLOW": f"{sys.executable} -m streamflow", "PYTHONUNBUFFERED": "1"}
    # 0.25 s per sample (8 per iteration): once step 1's checkpoint is seen, the iterations left
    # take seconds, so the requeue lands mid-run (the tiny run alone ends within a second)
    iterations = 5
    submit = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", f"--chdir={ROOT}", f"--output={job_out}",
         str(SBATCH), str(ROOT / "configs" / "tiny.yaml"), f"run.output_dir={out}",
         f"run.iterations={iterations}", "run.checkpoint_every=1", "run.eval_every=0",
         "rollout.groups_per_claim=1", "trainer.kl_coef=0",
         "reward.fn=tests.streamflow.slow_reward:score", PLACEMENT],
        env=env, capture_output=True, text=True, timeout=60)
    job_id = submit.stdout.strip()
    assert submit.returncode == 0 and job_id.isdigit(), submit.stderr

    def job() -> dict[str, str]:  # scontrol's one-line record (kept MinJobAge after the end)
        line = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=slurm.env,
                              capture_output=True, text=True, check=True, timeout=30).stdout
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    def ended() -> bool:
        return job()["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")

    try:
        metrics = out / "metrics.jsonl"

        def one_iteration_checkpointed() -> bool:
            assert not ended(), job_out.read_text(errors="replace")[-3000:]
            done = metrics.read_text().splitlines() if metrics.exists() else []
            return len(done) >= 1 and (out / "checkpoints" / "step-000001").is_dir()

        wait_until(one_iteration_checkpointed, timeout=180, what="step 1's checkpoint")
        first_lines = metrics.read_text().splitlines()
        done_before = len(first_lines)
        assert done_before < iterations, "the run ended before the requeue"
        subprocess.run(["scontrol", "requeue", job_id], env=slurm.env, check=True, timeout=30)
        t0 = time.monotonic()
        wait_until(lambda: job()["Restarts"] == "1" and ended(), timeout=240,
                   what="the requeued job's end")
        took = time.monotonic() - t0
    finally:
        if not ended():
            subprocess.run(["scancel", job_id], env=slurm.env, timeout=30)
    text = job_out.read_text(errors="replace")
    final = job()
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", (final, text[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == iterations, summary
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0, summary
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == list(range(iterations)), lines
    assert lines[0] == first_lines[0]  # step 1 was resumed from, not done again
    # node 1 of the job (n2, 127.0.0.3) ran the rollout worker and bound its address
    worker = json.loads((out / "workers" / "node-1" / "rollout-0.json").read_text())
    assert "127.0.0.3" in json.dumps(worker), worker
    print(f"requeued after {done_before} iteration(s); requeue to the job's end: {took:.1f}s")


def _node(nodes: int, rank: int = 0) -> SlurmNode:
    return SlurmNode(rank, nodes, tuple(f"n{i}" for i in range(nodes)), 7)


def test_allocation_checks(tiny_config) -> None:
    cfg = tiny_config("trainer.kl_coef=0", PLACEMENT)
    with pytest.raises(LaunchError, match=r"has 1 node\(s\) but placement.nodes lists 2: .*-N 2$"):
        check_allocation(cfg, _node(1), 0)
    check_allocation(cfg, _node(3, 2), 0)  # more nodes than placed: the extra one idles
    gpu = tiny_config("trainer.kl_coef=0", "trainer.device=cuda", PLACEMENT)
    with pytest.raises(LaunchError, match=r"node 0 \(n0\) needs 1 GPU\(s\), the allocation gives "
                                          "it 0"):
        check_allocation(gpu, _node(2), 0)
    check_allocation(gpu, _node(2, 1), 0)  # node 1 runs no GPU role
    assert _node(2).coordinator_port == 20007


def test_outside_an_allocation_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "streamflow", "launch", str(ROOT / "configs" / "tiny.yaml"),
         "trainer.kl_coef=0", PLACEMENT, "--backend", "slurm"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "runs under srun inside an allocation" in done.stderr
