"""``streamflow launch CONFIG --backend slurm``: one node launcher per node of a Slurm allocation.

Run once per allocated node under ``srun`` (deploy/slurm/streamflow.sbatch): the task on the job's
node r (``SLURM_NODEID``) is ``streamflow launch --node-rank r``, with every ``placement.nodes``
host set to the address Slurm knows the allocated node by (``scontrol show node``: NodeAddr)
and the coordinator on node 0 at a port derived from the job id. Everything after that is the
ordinary launcher's. GPUs are the allocation's (Slurm sets ``CUDA_VISIBLE_DEVICES`` per step).
Design: docs/multihost.md "Slurm".
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamflow.config import RunConfig
from streamflow.launch import LaunchError, check_launch, placement_override

log = logging.getLogger("streamflow.launch_slurm")

PORT_BASE, PORT_SPAN = 20000, 10000  # coordinator port: PORT_BASE + job id % PORT_SPAN


@dataclass(frozen=True)
class SlurmNode:
    """This task's place in the allocation, from the environment ``srun`` gives it."""

    rank: int  # SLURM_NODEID: this node's index in the job
    nodes: int  # SLURM_NNODES
    names: tuple[str, ...]  # the job's node names, in SLURM_NODEID order
    job_id: int

    @property
    def coordinator_port(self) -> int:
        return PORT_BASE + self.job_id % PORT_SPAN


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {exc}") from None


def from_env(env: Mapping[str, str]) -> SlurmNode:
    missing = [k for k in ("SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
               if k not in env]
    if missing:
        raise LaunchError(f"--backend slurm runs under srun inside an allocation ({', '.join(missing)}"
                          " not set): see deploy/slurm/streamflow.sbatch")
    names = tuple(_scontrol("show", "hostnames", env["SLURM_JOB_NODELIST"]).split())
    return SlurmNode(int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"]), names,
                     int(env["SLURM_JOB_ID"]))


def node_addresses(names: tuple[str, ...]) -> list[str]:
    """Each node's NodeAddr (its name when slurm.conf sets none), as an IP address."""
    found: dict[str, str] = {}
    for line in _scontrol("show", "node", "-o", ",".join(names)).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    out = []
    for name in names:
        try:
            out.append(socket.gethostbyname(found.get(name, name)))
        except OSError as exc:
            raise LaunchError(f"cannot resolve Slurm node {name} ({found.get(name, name)}): "
                              f"{exc}") from None
    return out


def check_allocation(cfg: RunConfig, node: SlurmNode, gpus: int) -> None:
    """One line naming what the allocation lacks: nodes, or GPUs on this node."""
    from streamflow.launch_ray import node_bundles

    want = len(cfg.placement.nodes)
    if node.nodes < want:
        raise LaunchError(f"the allocation has {node.nodes} node(s) but placement.nodes lists "
                          f"{want}: submit with sbatch -N {want}")
    if node.rank < want:
        need = int(node_bundles(cfg, gpus, {})[node.rank].get("GPU", 0))
        if need > gpus:
            raise LaunchError(f"placement node {node.rank} ({node.names[node.rank]}) needs {need} "
                              f"GPU(s), the allocation gives it {gpus}: sbatch --gpus-per-node="
                              f"{need}")


def main(args: Any) -> int:
    """The CLI's ``streamflow launch CONFIG --backend slurm`` (one task per node)."""
    from streamflow.cli import LOG_FORMAT, _raise_interrupt
    from streamflow.config import dump_yaml, load_config
    from streamflow.devices import visible_gpus
    from streamflow.launch import launch

    cfg = load_config(args.config, args.overrides)
    check_launch(cfg, 0, len(cfg.placement.nodes))
    node = from_env(os.environ)
    check_allocation(cfg, node, visible_gpus())
    if node.rank >= len(cfg.placement.nodes):
        print(f"node {node.rank}: not used by placement.nodes", file=sys.stderr, flush=True)
        return 0
    hosts = node_addresses(node.names[: len(cfg.placement.nodes)])
    cfg = load_config(args.config, [*args.overrides, placement_override(cfg, hosts)])
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    logging.basicConfig(level=cfg.run.log_level, format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # scancel, a requeue, the time limit
    return launch(cfg, node_rank=node.rank, nodes=len(hosts),
                  coordinator=f"{hosts[0]}:{node.coordinator_port}")
