"""Fixtures for store tests: a real store node process on a free 127.0.0.1 port, an embedded
store, and a small table spec. Every process started here is stopped (SIGTERM, then SIGKILL) with
bounded waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from testkit import free_port, wait_until

import storage
from storage.schema import TableSpec, TaskSpec

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


class StoreProcess:
    """`python -m storage.server` in a child process; restartable on the same port."""

    def __init__(self, tmp: Path, *, shards: int = 1, node_index: int = 0,
                 port: int | None = None, metrics: bool = False,
                 persist_dir: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.shards, self.node_index = shards, node_index
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.metrics = metrics
        self.persist_dir, self.extra = persist_dir, extra
        self.metrics_port: int | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> StoreProcess:
        ready = self.tmp / f"ready-{self.port}.json"
        ready.unlink(missing_ok=True)
        cmd = [PY, "-m", "storage.server", "--bind", self.address, "--shards", str(self.shards),
               "--node-index", str(self.node_index), "--ready-file", str(ready),
               "--log-level", "WARNING"]
        if self.metrics:
            cmd += ["--metrics-port", "0"]
        if self.persist_dir is not None:
            cmd += ["--persist-dir", str(self.persist_dir)]
        cmd += list(self.extra)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env)

        def bound() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"store node exited with {self.proc.returncode}")
            return ready.exists()

        try:
            wait_until(bound, timeout, what="the store node's ready file")
        except AssertionError:
            self.kill()
            raise TimeoutError("store node did not become ready") from None
        self.metrics_port = json.loads(ready.read_text())["metrics_port"]
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def store_node(tmp_path) -> Iterator[StoreProcess]:
    node = StoreProcess(tmp_path, shards=2).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def store_factory(tmp_path) -> Iterator:
    started: list[StoreProcess] = []

    def make(**kwargs) -> StoreProcess:
        node = StoreProcess(tmp_path, **kwargs)
        started.append(node)
        return node

    try:
        yield make
    finally:
        for node in started:
            node.stop()


@pytest.fixture
def embedded_store() -> Iterator[storage.EmbeddedStore]:
    with storage.embedded(num_shards=2) as store:
        yield store


def make_spec(name: str = "t", **kwargs) -> TableSpec:
    """A small RL-shaped table: x is put, reward is written by the "reward" task, the trainer
    needs both. Grouped by gid (groups of 4)."""
    schema = pa.schema([("gid", pa.int64()), ("x", pa.list_(pa.int32())), ("reward", pa.float32())])
    tasks = (TaskSpec("reward", ("x",)), TaskSpec("train", ("x", "reward"), whole_groups=True))
    base = dict(group_column="gid", group_size=4, lease_seconds=30.0)
    base.update(kwargs)
    return TableSpec(name, schema, tasks, **base)


def make_rows(num_groups: int, start_gid: int = 0, width: int = 8) -> pa.RecordBatch:
    gids = [start_gid + g for g in range(num_groups) for _ in range(4)]
    xs = [[g] * width for g in gids]
    return pa.record_batch({"gid": pa.array(gids, pa.int64()), "x": pa.array(xs, pa.list_(pa.int32()))})


@pytest.fixture
def spec() -> TableSpec:
    return make_spec()


class _Helpers:
    """Helper functions handed to tests as a fixture (importing conftest by name is fragile when
    several test packages have one)."""

    make_spec = staticmethod(make_spec)
    make_rows = staticmethod(make_rows)
    StoreProcess = StoreProcess
    free_port = staticmethod(free_port)
    repo = REPO


@pytest.fixture(scope="session")
def h() -> type[_Helpers]:
    return _Helpers
