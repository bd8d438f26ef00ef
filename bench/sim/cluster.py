"""A simulated cluster: the real store, messages, balancer and admission rule, simulated devices.

``run_sim(SimConfig)`` starts a real store node process (``storage.server``), optionally the shard
coordinator (a thread of this process, as in a real streaming run), and host processes of
simulated workers (``bench.sim.host``: many device threads per process), then acts as the
controller: it puts iteration k's prompt rows once ``streamflow.admission.admissible`` says so
(the same function the real controller calls) and announces versions and admissions to the hosts.
It returns a ``SimResult``: achieved throughput in samples per *simulated* second, the lower bound
from ``bench.sim.bound`` (no schedule beats it), efficiency = bound time / achieved time (<= 1),
the reference schedule's time (``bench.sim.bound.reference_seconds``), utilisation per role and per
device, the holds (for timelines) and the CPU seconds the controller, the coordinator and the store
node spent (the control-plane cost the bench reports per micro-batch).

Clock: the run's time is from the first put to the announcement of the last version (the end of
the last optimizer step), in real seconds times ``time_scale``. Everything that is not a device
hold (claims, writes, acks, admission, thread wake-ups, this 2-core machine's load) therefore
counts against the engine, amplified by ``time_scale``: a conservative measure.

Layout by mode: ``sync`` runs one colocated host whose ``devices`` do every stage in turn;
``periodic``/``async`` put the trainer devices (one data-parallel job) in host 0 and spread the
rollout, reward and reference devices over ``hosts`` further processes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import pyarrow as pa
import zmq

import storage
from bench._store_node import spawn_store
from bench.sim.bound import Layout, bound_seconds, micro_batches, reference_seconds
from bench.sim.engine import PAYLOAD_TOKENS, SIM_COLUMN
from streamflow.admission import admissible, min_policy_version
from workers.engines.sim_cost import Workload, preset
from workers.schema import PUT_COLUMNS, SAMPLES_SCHEMA, samples_table_spec

TABLE = "sim"
ROLES = ("rollout", "reward", "reference", "trainer")


@dataclass
class SimConfig:
    mode: str  # sync | periodic | async
    layout: Layout
    workload: Workload
    staleness: int = 0  # async only (periodic and sync are 0 by definition)
    # periodic only: training waits for the whole iteration (generation and training take turns
    # on separate pools; the synchronous baseline of the Periodic Asynchrony paper): "sync-split"
    turns: bool = False
    cost: str = "7b-1acc"
    time_scale: float = 50.0  # simulated seconds per real second
    hosts: int = 2  # stage host processes (streaming modes)
    shards: int = 1
    balancer: bool = False  # ConsumerSessions + coordinator for ``balanced_roles``
    rebalance: bool = True  # with balancer: False = static round-robin shard ownership
    steal: bool = True
    balanced_roles: tuple[str, ...] = ("reference",)
    slowdown: dict[str, float] = field(default_factory=dict)  # device name -> cost factor
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "periodic", "async"):
            raise ValueError(f"SimConfig.mode must be sync, periodic or async, got {self.mode!r}")
        if self.mode != "async":
            self.staleness = 0
        elif self.staleness < 1:
            raise ValueError("SimConfig.staleness must be >= 1 in async mode")
        if self.turns and self.mode != "periodic":
            raise ValueError("SimConfig.turns applies to periodic only")
        lay = self.layout
        if self.mode == "sync" and lay.devices < 1:
            raise ValueError("sync needs layout.devices >= 1 (colocated devices)")
        if self.mode != "sync" and min(lay.rollout, lay.reward, lay.trainer) < 1:
            raise ValueError("periodic/async need >= 1 rollout, reward and trainer device")
        preset(self.cost)


@dataclass
class SimResult:
    mode: str
    staleness: int
    workers: int
    layout: dict[str, int]
    samples: int
    wall_real_s: float
    sim_seconds: float
    throughput: float  # samples per simulated second
    bound_seconds: float  # a lower bound on the time: no schedule beats it (bench.sim.bound)
    bound_throughput: float
    efficiency: float  # bound / achieved time: <= 1
    reference_seconds: float  # the zero-overhead greedy schedule (not a bound: runs can beat it)
    utilisation: dict[str, float]  # role -> mean busy fraction of its devices
    device_utilisation: dict[str, float]
    micro_batches: int
    controller_cpu_s: float
    coordinator_cpu_s: float
    store_cpu_s: float
    hosts_cpu_s: float
    time_scale: float
    holds: list[list[Any]] = field(default_factory=list, repr=False)  # relative sim seconds

    @property
    def label(self) -> str:
        return f"async(s={self.staleness})" if self.mode == "async" else self.mode


def table_spec(reference: bool, group_size: int) -> Any:
    spec = samples_table_spec(
        TABLE, group_size=group_size, reference_worker=reference, lease_seconds=600.0
    )
    schema = SAMPLES_SCHEMA.append(pa.field(SIM_COLUMN, pa.int32()))
    return dataclasses.replace(spec, schema=schema)


def _put_iteration(client: Any, w: Workload, k: int, staleness: int) -> None:
    n, g = w.prompts_per_iteration, w.group_size
    rows = n * g
    # Built with numpy: 65 k rows a put at 256 workers, and the put is on the critical path.
    prompt = pa.ListArray.from_arrays(
        pa.array(np.arange(rows + 1, dtype=np.int32) * PAYLOAD_TOKENS),
        pa.array(np.ones(rows * PAYLOAD_TOKENS, dtype=np.int32)),
    )
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(np.repeat(np.arange(k * n, (k + 1) * n, dtype=np.int64), g)),
            pa.array(np.full(rows, k, dtype=np.int64)),
            pa.array(np.full(rows, min_policy_version(k, staleness), dtype=np.int64)),
            prompt,
            pa.array(np.full(rows, "", dtype=object), pa.string()),
        ],
        schema=pa.schema([SAMPLES_SCHEMA.field(c) for c in PUT_COLUMNS]),
    )
    client.put(TABLE, batch, timeout=60.0)


def _start_store(tmp: Path, shards: int) -> tuple[subprocess.Popen, list[str]]:
    return spawn_store(shards, tmp)


def _host_specs(cfg: SimConfig, base: dict[str, Any]) -> list[dict[str, Any]]:
    lay = cfg.layout
    if cfg.mode == "sync":
        devices = [f"dev-{i}" for i in range(lay.devices)]
        return [{**base, "host": 0, "devices": devices, "trainer_devices": devices, "pools": {}}]
    specs = [
        {
            **base,
            "host": 0,
            "pools": {},
            "trainer_devices": [f"trainer-{i}" for i in range(lay.trainer)],
        }
    ]
    hosts = max(cfg.hosts, 1)
    pools: list[dict[str, list[str]]] = [{r: [] for r in ROLES[:3]} for _ in range(hosts)]
    i = 0
    for role in ROLES[:3]:
        for d in range(getattr(lay, role)):
            pools[i % hosts][role].append(f"{role}-{d}")
            i += 1
    for h in range(hosts):
        specs.append({**base, "host": h + 1, "pools": pools[h], "trainer_devices": []})
    return specs


def _thread_cpu(native_id: int | None) -> float:
    if native_id is None:
        return 0.0
    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def run_sim(cfg: SimConfig) -> SimResult:
    w, lay = cfg.workload, cfg.layout
    tmp = Path(tempfile.mkdtemp(prefix="sf-sim-"))
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind("tcp://127.0.0.1:*")
    pull.bind("tcp://127.0.0.1:*")
    store, addresses = _start_store(tmp, cfg.shards)
    procs: list[subprocess.Popen] = []
    coordinator: Any = None
    client: Any = None
    try:
        client = storage.connect(addresses, request_timeout=30.0)
        client.create_table(table_spec(cfg.mode == "sync" or lay.reference > 0, w.group_size))
        if cfg.balancer:
            from storage.balance import BalancerConfig
            from storage.coordinator import Coordinator

            coordinator = Coordinator(
                store_addresses=addresses,
                context=ctx,
                balancer=BalancerConfig(rebalance=cfg.rebalance),
            ).start()
        base = {
            "mode": cfg.mode,
            "cost": cfg.cost,
            "workload": dataclasses.asdict(w),
            "time_scale": cfg.time_scale,
            "store_addresses": addresses,
            "table": TABLE,
            "state_address": pub.getsockopt_string(zmq.LAST_ENDPOINT),
            "report_address": pull.getsockopt_string(zmq.LAST_ENDPOINT),
            "coordinator_address": coordinator.address if coordinator else None,
            "balanced_roles": list(cfg.balanced_roles),
            "steal": cfg.steal,
            "slowdown": cfg.slowdown,
            "turns": cfg.turns,
        }
        specs = _host_specs(cfg, base)
        for spec in specs:
            path = tmp / f"host-{spec['host']}.json"
            path.write_text(json.dumps(spec))
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.sim.host", str(path)]))
        state = {"version": 0, "admitted": 0, "stop": False}

        def announce() -> None:
            pub.send(msgpack.packb(state))

        def receive(timeout_ms: int) -> list[dict[str, Any]]:
            out = []
            while pull.poll(timeout_ms):
                out.append(msgpack.unpackb(pull.recv()))
                timeout_ms = 0
            return out

        def check_hosts() -> None:
            for p in procs:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"a simulated host exited with {p.returncode}")

        ready: set[int] = set()
        deadline = time.monotonic() + 60
        while len(ready) < len(specs):
            announce()
            ready |= {m["host"] for m in receive(50) if m["kind"] == "ready"}
            check_hosts()
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated hosts not ready: {len(ready)}/{len(specs)}")
        store_cpu0 = sum(psutil.Process(store.pid).cpu_times()[:2])
        coord_id = coordinator._thread.native_id if coordinator else None
        coord_cpu0 = _thread_cpu(coord_id)
        t0 = time.time()
        cpu0 = time.thread_time()
        t_end, version, last_beat = t0, 0, 0.0
        deadline = time.monotonic() + cfg.timeout_s
        while version < w.iterations:
            changed = False
            while state["admitted"] < w.iterations and admissible(
                state["admitted"], cfg.staleness, version
            ):
                _put_iteration(client, w, state["admitted"], cfg.staleness)
                state["admitted"] += 1
                changed = True
            for msg in receive(5):
                if msg["kind"] == "version" and msg["version"] > version:
                    version, t_end = msg["version"], msg["time"]
                    state["version"] = version
                    changed = True
            if changed or time.monotonic() - last_beat > 0.05:
                announce()
                last_beat = time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated run did not finish in {cfg.timeout_s}s")
            if not changed:
                check_hosts()
        controller_cpu = time.thread_time() - cpu0
        coordinator_cpu = _thread_cpu(coord_id) - coord_cpu0
        store_cpu = sum(psutil.Process(store.pid).cpu_times()[:2]) - store_cpu0
        state["stop"] = True
        done: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while len(done) < len(specs) and time.monotonic() < deadline:
            announce()
            done += [m for m in receive(100) if m["kind"] == "done"]
        if len(done) < len(specs):
            raise RuntimeError("simulated hosts did not report at the end")
    finally:
        if procs:  # on an error too: hosts stop on the controller's word, not on a kill
            pub.send(msgpack.packb({"version": 0, "admitted": 0, "stop": True}))
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if client is not None:
            client.close()
        if coordinator is not None:
            coordinator.stop()
        store.terminate()
        try:
            store.wait(timeout=10)
        except subprocess.TimeoutExpired:
            store.kill()
        pub.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)
    return _result(cfg, t0, t_end, done, controller_cpu, coordinator_cpu, store_cpu)


def _result(
    cfg: SimConfig,
    t0: float,
    t_end: float,
    done: list[dict[str, Any]],
    controller_cpu: float,
    coordinator_cpu: float,
    store_cpu: float,
) -> SimResult:
    w, lay, scale = cfg.workload, cfg.layout, cfg.time_scale
    wall = max(t_end - t0, 1e-9)
    sim = wall * scale
    samples = w.iterations * w.rows_per_iteration
    cost = preset(cfg.cost)
    mode = "sync-split" if cfg.turns else cfg.mode
    bound = bound_seconds(mode, cfg.staleness, lay, cost, w)
    holds = [h for d in done for h in d["holds"]]  # device, role, kind, start, end, it, rows
    busy: dict[str, float] = {}
    by_role: dict[str, float] = {}
    rel = []
    for device, role, kind, start, end, it, rows in holds:
        s, e = max(start, t0), min(end, t_end)
        if e > s:
            busy[device] = busy.get(device, 0.0) + (e - s)
            by_role[role] = by_role.get(role, 0.0) + (e - s)
        rel.append([device, role, kind, (start - t0) * scale, (end - t0) * scale, it, rows])
    counts = (
        {r: lay.devices for r in ROLES}
        if cfg.mode == "sync"
        else {r: getattr(lay, r) for r in ROLES}
    )
    util = {r: by_role.get(r, 0.0) / (counts[r] * wall) for r in ROLES if counts[r]}
    micro = micro_batches(w, cfg.mode == "sync" or lay.reference > 0)
    return SimResult(
        mode="sync-split" if cfg.turns else cfg.mode,
        staleness=cfg.staleness,
        workers=lay.workers,
        layout=dataclasses.asdict(lay),
        samples=samples,
        wall_real_s=wall,
        sim_seconds=sim,
        throughput=samples / sim,
        bound_seconds=bound,
        bound_throughput=samples / bound,
        efficiency=bound / sim,
        reference_seconds=reference_seconds(mode, cfg.staleness, lay, cost, w),
        utilisation=util,
        device_utilisation={d: b / wall for d, b in sorted(busy.items())},
        micro_batches=micro,
        controller_cpu_s=controller_cpu,
        coordinator_cpu_s=coordinator_cpu,
        store_cpu_s=store_cpu,
        hosts_cpu_s=sum(d["cpu_s"] for d in done),
        time_scale=scale,
        holds=rel,
    )
