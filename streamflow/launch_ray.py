"""``streamflow launch CONFIG --backend ray``: the multi-host run of ``streamflow.launch``, placed by
a Ray cluster the user already has.

Ray only places processes. One actor per ``placement.nodes`` entry (a placement group, one bundle
per entry, strategy ``STRICT_SPREAD``: the roles of an entry share a node, entries spread over
nodes) runs that entry's ordinary node launcher (``streamflow launch --node-rank r``) as a child
process, with the entry's ``host`` set to the address of the Ray node it landed on. So the
rendezvous, the store (ZeroMQ; nothing goes through Ray's object store), worker restarts, fencing,
the two-phase end and ``targets.json`` are exactly the launcher's. What this module adds: the
resources each node asks Ray for, checks that fail in one line before anything starts, the
replacement of a node launcher whose actor or Ray node died, and an ordered Ctrl-C.
Design and measurements: docs/multihost.md "Ray".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamflow.config import RunConfig
from streamflow.launch import LaunchError, placement_override, trainer_nodes

log = logging.getLogger("streamflow.launch_ray")

CONNECT_TIMEOUT_S = 5.0  # an address that does not answer this fast is reported, not retried
STOP_GRACE_S = 60.0  # after Ctrl-C: how long the launchers get for the two-phase end
_GPU_ROLES = ("rollout", "reference", "trainer")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError("--backend ray needs the ray package: pip install 'streamflow[ray]'"
                          ) from None
    return ray


def parse_resources(specs: list[str], nodes: int) -> dict[int, dict[str, float]]:
    """``--node-resources RANK:NAME=AMOUNT[,NAME=AMOUNT]`` (repeatable) -> rank -> resources."""
    out: dict[int, dict[str, float]] = {}
    for spec in specs:
        rank, sep, items = spec.partition(":")
        try:
            r = int(rank)
            pairs = [item.split("=", 1) for item in items.split(",")]
            res = {name.strip(): float(amount) for name, amount in pairs}
        except ValueError:
            raise LaunchError(f"--node-resources must be RANK:NAME=AMOUNT[,...], got {spec!r}"
                              ) from None
        if not sep or not 0 <= r < nodes or any(not n or a <= 0 for n, a in res.items()):
            raise LaunchError(f"--node-resources {spec!r}: rank in [0, {nodes}), names and "
                              "positive amounts")
        out.setdefault(r, {}).update(res)
    return out


def wants_gpu(cfg: RunConfig, role: str, cluster_gpus: int) -> bool:
    """Does a process of ``role`` take a GPU of its node (its device: cuda* always, auto when the
    cluster has GPUs; simulated engines hold no model)?"""
    if role not in _GPU_ROLES or cfg.rollout.engine == "simulated":
        return False
    device = getattr(cfg, role).device
    return device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)


def node_bundles(cfg: RunConfig, cluster_gpus: int,
                 custom: dict[int, dict[str, float]]) -> list[dict[str, float]]:
    """One Ray bundle per placement node: a CPU per process it runs (node 0 also runs the
    controller), a GPU per process that takes one (one in all with devices.placement=colocated),
    plus its ``--node-resources``."""
    bundles = []
    for rank, node in enumerate(cfg.placement.nodes):
        roles = {"store": node.store_nodes, "rollout": node.rollout, "reward": node.reward,
                 "reference": node.reference, "environment": node.environment,
                 "trainer": node.trainer}
        gpus = sum(n for role, n in roles.items() if wants_gpu(cfg, role, cluster_gpus))
        if cfg.devices.placement == "colocated":
            gpus = min(gpus, 1)
        bundle = {"CPU": float(sum(roles.values()) + (rank == 0))}
        if gpus:
            bundle["GPU"] = float(gpus)
        bundle.update(custom.get(rank, {}))
        bundles.append(bundle)
    return bundles


def check_fits(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> None:
    """One line naming what the cluster lacks: GPUs in all, a custom resource, a node big enough
    for a bundle. (Too few nodes is not an error: Ray waits for nodes to join.)"""
    total: dict[str, float] = {}
    for res in nodes:
        for name, amount in res.items():
            total[name] = total.get(name, 0.0) + amount
    for name in sorted({n for b in bundles for n in b}):
        want = sum(b.get(name, 0.0) for b in bundles)
        if want > total.get(name, 0.0):
            what = "GPUs" if name == "GPU" else "CPUs" if name == "CPU" else f"resource {name!r}"
            raise LaunchError(f"the config asks Ray for {want:g} {what} in all, the cluster has "
                              f"{total.get(name, 0.0):g}")
    for rank, bundle in enumerate(bundles):
        if not any(all(res.get(n, 0.0) >= a for n, a in bundle.items()) for res in nodes):
            raise LaunchError(f"no Ray node can hold placement node {rank} (it asks for "
                              f"{_show(bundle)})")


def _show(bundle: dict[str, float]) -> str:
    return ", ".join(f"{n}={a:g}" for n, a in sorted(bundle.items()))


def connect(ray: Any, address: str) -> None:
    """``ray.init`` that fails in seconds on an address nobody serves (Ray itself retries for a
    minute or more): a TCP probe of HOST:PORT first, ``ray.init`` after."""
    target = address.removeprefix("ray://")
    if address != "auto":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise LaunchError(f"--address must be auto, HOST:PORT or ray://HOST:PORT, got "
                              f"{address!r}")
        try:
            socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise LaunchError(f"no Ray cluster at {address} ({exc.strerror or exc})") from None
        if not address.startswith("ray://"):
            _probe_gcs(target)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    head = target.rpartition(":")[0]
    if address != "auto" and not address.startswith("ray://") and _is_local(head):
        kwargs["_node_ip_address"] = head  # a driver on the head's host joins the head's raylet
    try:
        ray.init(address=address, **kwargs)
        _first_lines_of_cluster_errors(ray)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(f"could not join the Ray cluster at {address}: "
                          f"{str(exc).splitlines()[0]}") from None


def _first_lines_of_cluster_errors(ray: Any) -> None:
    """Ray prints every cluster error on the driver's terminal, a dead node's with its raylet's
    state dump (hundreds of lines): keep the first line of each. Ray's own module attribute; left
    alone when a Ray version lacks it."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "first_lines", False):
        return

    def first_lines(data: dict, ignore_prefix: bool) -> None:
        lines = [str(line).splitlines()[0] if str(line) else line for line in data["lines"]]
        original({**data, "lines": lines}, ignore_prefix)

    first_lines.first_lines = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = first_lines


def _is_local(host: str) -> bool:
    """Is ``host`` an address of this machine (one it can bind)?"""
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


def _probe_gcs(address: str) -> None:
    """Ask the head's GCS for its cluster id, bounded (something that accepts TCP but is no GCS
    would keep ``ray.init`` retrying); its C++ retry warnings are kept off the terminal."""
    from ray._raylet import InnerGcsClient

    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            try:
                InnerGcsClient.standalone(address, None, int(CONNECT_TIMEOUT_S * 1000))
            except Exception as exc:
                raise LaunchError(f"no Ray cluster at {address} (no GCS answers there: "
                                  f"{str(exc).splitlines()[0][:120]})") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class NodeActor:
    """Runs one node launcher on its Ray node (a threaded actor: ``wait`` blocks, ``signal``
    and the others answer meanwhile). The launcher dies with the actor (``PR_SET_PDEATHSIG``),
    and its children with it, as on a host."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def where(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        from storage.ports import free_port

        return free_port(host)

    def start(self, argv: list[str], cwd: str, log_path: str) -> int:
        from streamflow.supervisor import _die_with_parent

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamflow", "launch", *argv], cwd=cwd, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_die_with_parent, start_new_session=True)
        return self.proc.pid

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


@dataclass
class _Node:
    rank: int
    actor: Any
    host: str
    done: Any  # the ObjectRef of actor.wait()
    replaced: int = 0  # times this node's launcher was replaced after its actor died
    code: int | None = None


@dataclass
class RayLaunch:
    """The driver: places the node launchers, watches them, replaces lost ones, stops them."""

    cfg: RunConfig
    config_path: str
    overrides: list[str]
    address: str
    custom: dict[int, dict[str, float]] = field(default_factory=dict)

    def run(self) -> int:
        ray = import_ray()
        t0 = time.monotonic()
        connect(ray, self.address)
        pg = None
        nodes: list[_Node] = []
        try:
            alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
            cluster_gpus = int(sum(r.get("GPU", 0) for r in alive))
            self.bundles = node_bundles(self.cfg, cluster_gpus, self.custom)
            check_fits(self.bundles, alive)
            from ray.util.placement_group import placement_group, remove_placement_group

            pg = placement_group(self.bundles, strategy="STRICT_SPREAD")
            ready, _ = ray.wait([pg.ready()], timeout=10.0)
            if not ready:  # e.g. nodes still joining: say so, then wait the rest of the timeout
                print(f"streamflow: waiting for Ray to place {len(self.bundles)} node(s) on "
                      f"distinct Ray nodes ({'; '.join(map(_show, self.bundles))})",
                      file=sys.stderr, flush=True)
                ready, _ = ray.wait([pg.ready()], timeout=self.cfg.run.startup_timeout_s)
            if not ready:
                raise LaunchError(
                    f"Ray could not place {len(self.bundles)} node(s) on distinct Ray nodes within "
                    f"run.startup_timeout_s ({'; '.join(map(_show, self.bundles))})")
            actors = [self._actor(b, pg, i) for i, b in enumerate(self.bundles)]
            hosts = ray.get([a.where.remote() for a in actors], timeout=60)
            port = ray.get(actors[0].free_port.remote(hosts[0]), timeout=60)
            self.coordinator = f"{hosts[0]}:{port}"
            self.hosts = list(hosts)
            nodes = [_Node(r, a, h, None) for r, (a, h) in enumerate(zip(actors, hosts, strict=True))]
            for node in nodes:
                self._start(node)
            print(f"streamflow: {len(nodes)} node launcher(s) placed by Ray on "
                  f"{', '.join(self.hosts)} in {time.monotonic() - t0:.1f}s", file=sys.stderr,
                  flush=True)
            try:
                return self._watch(ray, nodes)
            except KeyboardInterrupt:
                return self._interrupt(ray, nodes)
        finally:
            for node in nodes:
                with contextlib.suppress(Exception):
                    ray.kill(node.actor)
            if pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            with contextlib.suppress(Exception):
                ray.shutdown()

    def _actor(self, bundle: dict[str, float], pg: Any, index: int | None) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {n: a for n, a in bundle.items() if n not in ("CPU", "GPU")}
        options: dict[str, Any] = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                                   "resources": custom, "max_concurrency": 4,
                                   "max_restarts": 0}
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index)
        return ray.remote(NodeActor).options(**options).remote()

    def _argv(self, rank: int) -> list[str]:
        return [self.config_path, *self.overrides, placement_override(self.cfg, self.hosts),
                "--node-rank", str(rank), "--nodes", str(len(self.hosts)),
                "--coordinator", self.coordinator]

    def _start(self, node: _Node) -> None:
        import ray

        log_path = Path(self.cfg.run.output_dir).resolve() / "logs" / f"launcher-{node.rank}.log"
        ray.get(node.actor.start.remote(self._argv(node.rank), os.getcwd(), str(log_path)),
                timeout=60)
        node.done = node.actor.wait.remote()

    def _watch(self, ray: Any, nodes: list[_Node]) -> int:
        """Until node 0's launcher (the controller) exits; then the others, bounded."""
        end_by: float | None = None
        while True:
            pending = [n for n in nodes if n.code is None]
            if not pending or (end_by is not None and time.monotonic() > end_by):
                break
            done, _ = ray.wait([n.done for n in pending], num_returns=1, timeout=0.5)
            for node in (n for n in pending if n.done in done):
                try:
                    node.code = int(ray.get(node.done))
                except ray.exceptions.RayActorError as exc:
                    if nodes[0].code is None and self._replace(ray, node, exc):
                        continue
                    node.code = 1
            if nodes[0].code is not None and end_by is None:
                end_by = time.monotonic() + STOP_GRACE_S
        code = nodes[0].code if nodes[0].code is not None else 1
        return code or (1 if any(n.code for n in nodes) else 0)

    def _replace(self, ray: Any, node: _Node, exc: Exception) -> bool:
        """A node whose actor died (its Ray node left, or the actor was killed): start its
        launcher again on a Ray node with the resources for it, by the supervisor's rules: at
        most run.max_restarts times, never node 0 (controller, coordinator) nor a node holding
        store nodes or trainer ranks (their state went with it: continue with run.resume=auto)."""
        spec = self.cfg.placement.nodes[node.rank]
        cause = str(exc).splitlines()[0][:200]
        if node.rank == 0 or spec.store_nodes or node.rank in trainer_nodes(self.cfg):
            log.error("node %d's launcher was lost (%s); it holds state: not replaced", node.rank,
                      cause)
            return False
        if node.replaced >= self.cfg.run.max_restarts:
            log.error("node %d's launcher was lost again (%s) after %d replacement(s) "
                      "(run.max_restarts)", node.rank, cause, node.replaced)
            return False
        log.warning("node %d's launcher on %s was lost (%s); placing it again", node.rank,
                    node.host, cause)
        actor = self._actor(self.bundles[node.rank], None, None)
        ready, _ = ray.wait([where := actor.where.remote()],
                            timeout=self.cfg.placement.node_timeout_s)
        if not ready:
            ray.kill(actor)
            log.error("no Ray node has the resources for node %d (%s) within "
                      "placement.node_timeout_s", node.rank, _show(self.bundles[node.rank]))
            return False
        node.actor, node.host, node.replaced = actor, ray.get(where), node.replaced + 1
        self.hosts[node.rank] = node.host
        self._start(node)
        log.warning("node %d's launcher placed again on %s", node.rank, node.host)
        return True

    def _interrupt(self, ray: Any, nodes: list[_Node]) -> int:
        """Ctrl-C: node 0 stops the run (its launcher turns SIGTERM into the clean stop and tells
        the others); a second Ctrl-C, or the grace running out, kills every launcher."""
        print("streamflow: stopping the run (Ctrl-C again to kill it)", file=sys.stderr,
              flush=True)
        try:
            with contextlib.suppress(Exception):
                ray.get(nodes[0].actor.signal.remote(signal.SIGTERM), timeout=10)
            refs = [n.done for n in nodes if n.code is None]
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        except KeyboardInterrupt:
            pass
        return 130


def main(args: Any) -> int:
    """The CLI's ``streamflow launch CONFIG --backend ray [--address ...]``."""
    from streamflow.cli import LOG_FORMAT, _raise_interrupt
    from streamflow.config import dump_yaml, load_config
    from streamflow.launch import check_launch

    cfg = load_config(args.config, args.overrides)
    check_launch(cfg, 0, len(cfg.placement.nodes))
    custom = parse_resources(args.node_resources, len(cfg.placement.nodes))
    import_ray()
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    logging.basicConfig(level=cfg.run.log_level, format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's stop: as Ctrl-C
    return RayLaunch(cfg, str(Path(args.config).resolve()), list(args.overrides), args.address,
                     custom).run()
