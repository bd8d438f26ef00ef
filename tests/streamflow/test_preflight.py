"""Early checks (streamflow/preflight.py) below the CLI: the run directory rules as the controller
applies them to in-process runs, overwrite's deletion, and the port probe."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from testkit import free_port

from streamflow import preflight
from streamflow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def _old_run(path: Path) -> Path:
    (path / "checkpoints" / "step-000002").mkdir(parents=True)
    (path / "logs").mkdir()
    for name in ("config.yaml", "metrics.jsonl", "timeline.jsonl", "summary.json"):
        (path / name).write_text("{}\n")
    (path / "notes.txt").write_text("mine")  # not a run file: kept
    return path


def test_existing_run_needs_an_iteration_or_a_checkpoint(tmp_path: Path) -> None:
    assert preflight.existing_run(tmp_path / "missing") == []
    (tmp_path / "config.yaml").write_text("run: {}\n")
    (tmp_path / "summary.json").write_text("{}\n")  # a run that failed at start-up
    (tmp_path / "metrics.jsonl").write_text("")
    assert preflight.existing_run(tmp_path) == []
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    assert preflight.existing_run(tmp_path) == ["checkpoints/"]


def test_overwrite_deletes_only_what_a_run_writes(tmp_path: Path) -> None:
    run = _old_run(tmp_path / "run")
    preflight.clear_output_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_controller_refuses_an_existing_run_before_building_anything(tmp_path: Path) -> None:
    """In-process runs (benchmarks, notebooks) get the CLI's rule: before the model is built."""
    from streamflow.controller import run

    out = _old_run(tmp_path / "run")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.output_dir={out}"])
    with pytest.raises(ConfigError, match="run.output_dir: .* already holds a run"):
        run(cfg)
    assert not (tmp_path / ".cache").exists()  # no model built
    assert (out / "metrics.jsonl").read_text() == "{}\n"  # untouched


def test_port_probe_sees_a_listener_but_not_a_closed_port() -> None:
    # The port must still be free once this listener closes (the last check): free_port's pick,
    # below the ephemeral range that every outgoing connection on the machine draws from.
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        cfg = load_config(None, [f"store.port={port}"])
        with pytest.raises(ConfigError, match=f"store.port: tcp://127.0.0.1:{port} is already"):
            preflight.check_ports(cfg)
        # a sync run keeps its store in-process: the store port is not bound, not checked
        preflight.check_ports(load_config(None, [f"store.port={port}", "run.mode=sync"]))
        with pytest.raises(ConfigError, match=f"metrics.port: 127.0.0.1:{port} is already"):
            preflight.check_ports(load_config(None, [f"metrics.port={port}"]))
        preflight.check_ports(load_config(None, [f"metrics.port={port}",
                                                 "metrics.enabled=false"]))
    preflight.check_ports(load_config(None, [f"store.port={port}", f"metrics.port={port}"]))


def test_the_arithmetic_task_and_its_held_out_split_are_checked_before_anything(
    tmp_path: Path,
) -> None:
    def check(*overrides: str) -> None:
        cfg = load_config(ROOT / "configs" / "tiny.yaml",
                          [f"run.output_dir={tmp_path / 'run'}", *overrides])
        preflight.check_inputs(cfg)

    check("data.digits=1", "run.eval_prompts=4")  # 1-digit sums hold out a few problems
    with pytest.raises(ConfigError, match=r"^run.eval_prompts: 64: .*held-out problems; lower "):
        check("data.digits=1", "run.eval_prompts=64")
    with pytest.raises(ConfigError, match=r"^data.digits: .*1\.\.9"):
        check("data.digits=10")
    assert not (tmp_path / "run").exists()
