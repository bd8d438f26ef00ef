"""The placement section and `streamflow launch` usage: clear errors before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.cli import EXIT_OK, EXIT_USAGE, main
from streamflow.config import ConfigError, load_config
from streamflow.launch import store_slots, worker_nodes

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
GOOD = (
    "placement.nodes=[{host: 10.9.0.1, store_nodes: 2}, "
    "{host: 10.9.0.2, rollout: 1, reward: 1, reference: 1, store_nodes: 1}, "
    "{host: 10.9.0.3, trainer: 1}]"
)


def test_placement_assigns_every_process_once() -> None:
    cfg = load_config(TINY, [GOOD])
    assert [n.host for n in cfg.placement.nodes] == ["10.9.0.1", "10.9.0.2", "10.9.0.3"]
    assert worker_nodes(cfg) == {"rollout-0": 1, "reward-0": 1, "reference-0": 1, "trainer-0": 2}
    assert [store_slots(cfg, r) for r in range(3)] == [[0, 1], [2], []]
    assert load_config(TINY).placement.nodes == ()  # no section: one host, as before


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "placement.nodes=[{host: 0.0.0.0, store_nodes: 1, rollout: 1, reward: 1, reference: 1, "
            "trainer: 1}]",
            r"placement.nodes\[0\].host: must be an address",
        ),
        (
            "placement.nodes=[{host: a, store_nodes: 1, rollout: 2, reward: 1, reference: 1, "
            "trainer: 1}]",
            "places 2 rollout process.* has 1 .rollout.num_workers",
        ),
        (
            "placement.nodes=[{host: a, rollout: 1, reward: 1, reference: 1, trainer: 1}]",
            "must place between 1 and 256 store nodes",
        ),
        (
            "placement.nodes=[{host: a, store_nodes: 1, rollout: 1, reward: 1, trainer: 1}]",
            "places 0 reference",
        ),
        (
            "placement.nodes=[{host: a, store_nodes: 1, rollout: 1, reward: 1, reference: 1, "
            "trainr: 1}]",
            r"placement.nodes\[0\].trainr: unknown key.*did you mean 'trainer'",
        ),
        (
            "placement.nodes=[{host: a, store_nodes: -1}]",
            r"placement.nodes\[0\].store_nodes: must be >= 0",
        ),
    ],
)
def test_bad_placements_are_named(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [override])


def test_sync_mode_cannot_be_placed() -> None:
    with pytest.raises(ConfigError, match="run.mode 'sync'"):
        load_config(TINY, [GOOD, "run.mode=sync"])


def test_launch_usage_errors(capsys: pytest.CaptureFixture) -> None:
    base = ["launch", TINY, GOOD, "--coordinator", "10.9.0.1:29600"]
    assert main([*base, "--node-rank", "0", "--nodes", "2"]) == EXIT_USAGE
    assert "--nodes 2 but placement.nodes lists 3" in capsys.readouterr().err
    assert main([*base, "--node-rank", "3", "--nodes", "3"]) == EXIT_USAGE
    assert "--node-rank 3 is not in [0, 3)" in capsys.readouterr().err
    assert (
        main(["launch", TINY, "--node-rank", "0", "--nodes", "1", "--coordinator", "10.9.0.1:1"])
        == EXIT_USAGE
    )
    assert "no placement.nodes" in capsys.readouterr().err
    assert (
        main(
            [
                "launch",
                TINY,
                GOOD,
                "--node-rank",
                "0",
                "--nodes",
                "3",
                "--coordinator",
                "nohostport",
            ]
        )
        == EXIT_USAGE
    )
    assert "--coordinator must be HOST:PORT" in capsys.readouterr().err
    assert main([*base, "--node-rank", "1", "--nodes", "3", "--dry-run"]) == EXIT_OK
    assert "host: 10.9.0.2" in capsys.readouterr().out


@pytest.mark.parametrize("stopped_by, code", [("SIGTERM", 143), ("SIGINT", 130), (None, 130)])
def test_interrupted_launch_exits_like_an_interrupted_run(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str],
                                                         stopped_by: str | None,
                                                         code: int) -> None:
    from types import SimpleNamespace

    from storage.ports import free_port
    from streamflow import controller
    from streamflow.launch import launch

    summary = SimpleNamespace(status="interrupted", stopped_by=stopped_by)
    monkeypatch.setattr(controller, "run", lambda cfg, cluster: summary)
    cfg = load_config(TINY, [GOOD])
    assert launch(cfg, node_rank=0, nodes=3, coordinator=f"127.0.0.1:{free_port()}") == code
    assert "interrupted" in capsys.readouterr().err
    summary.status = "ok"
    assert launch(cfg, node_rank=0, nodes=3, coordinator=f"127.0.0.1:{free_port()}") == 0
