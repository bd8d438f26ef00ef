"""Shared fixtures for engine tests: the tiny config, with its built-in model cached per session,
store nodes started with `streamflow store serve` as a container would start them, and the
streaming run that several modules compare with (one real run per session, not one each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from testkit import wait_until

from streamflow.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache root per test session: the warm-started tiny model is built once."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def tiny_config(model_cache: Path, tmp_path: Path):
    def make(*overrides: str) -> RunConfig:
        out = model_cache / tmp_path.name
        return load_config(
            ROOT / "configs" / "tiny.yaml",
            [f"run.output_dir={out}", "run.progress=false", *overrides],
        )

    return make


# configs/tiny.yaml streamed through real processes: 2 iterations, every group its own claim, two
# rollout workers, weights by file (and its plots drawn). test_controller.py compares it with
# sync, and test_weight_sync_run.py with the same run on collective weight sync.
PERIODIC = ("run.mode=periodic", "run.iterations=2", "run.eval_every=0",
            "rollout.groups_per_claim=1", "rollout.num_workers=2", "weights.timeout_s=60")


class SharedRun(NamedTuple):
    cfg: RunConfig
    summary: Any  # streamflow.rundir.RunSummary
    overrides: tuple[str, ...]  # what a test adds to configs/tiny.yaml for a run like it


@pytest.fixture(scope="session")
def periodic_run(model_cache: Path) -> SharedRun:
    """``PERIODIC`` with file weight sync, run once per session."""
    from streamflow.controller import run

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"run.output_dir={model_cache / 'periodic-file'}", "run.progress=false", *PERIODIC,
        "weights.sync=file", "run.name=periodic", "run.plots=true"])
    return SharedRun(cfg, run(cfg), PERIODIC)


@pytest.fixture
def store_serve(tmp_path: Path):
    """``start(shards) -> (address, process)``: a `streamflow store serve` child on a free
    loopback port, ready to serve; every node started is stopped at teardown."""
    nodes: list[subprocess.Popen] = []

    def start(shards: int) -> tuple[str, subprocess.Popen]:
        ready = tmp_path / f"store-ready-{len(nodes)}.json"
        node = subprocess.Popen(
            [sys.executable, "-m", "streamflow", "store", "serve", "--bind", "tcp://127.0.0.1:0",
             "--shards", str(shards), "--ready-file", str(ready)], cwd=ROOT,
        )
        nodes.append(node)

        def up() -> bool:
            assert node.poll() is None, f"store node exited with {node.returncode}"
            return ready.exists()

        wait_until(up, timeout=60, what="the store node's ready file")
        return json.loads(ready.read_text())["addresses"][0], node

    yield start
    for node in nodes:
        if node.poll() is None:
            node.terminate()
            node.wait(timeout=30)
